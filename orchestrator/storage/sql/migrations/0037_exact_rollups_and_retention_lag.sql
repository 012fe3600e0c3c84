-- 0037_exact_rollups_and_retention_lag: the rollups' token and duration totals are exact
-- whatever the rows they sum hold, and retention records how far it has caught up, for the
-- fleet's metrics.
--
-- compatible-with-older-workers: yes
--
-- A rollup row's token totals (0030) and duration sum (0026) were bigint: one group's minute
-- summing two LLM calls that each reported 2^62 input tokens (a usage row holds any bigint)
-- failed the rollup statement with `bigint out of range`, at every run, and retention, which
-- deletes only jobs the rollups have counted, deleted nothing from then on, for the whole fleet.
-- They are numeric now: the statements already sum bigints to numeric (PostgreSQL's sum), so
-- every total is exact, and an hour's row re-summed from its minutes too. The change rewrites
-- orc_job_rollups once (an ACCESS EXCLUSIVE lock for as long: the stats reads and the rollup
-- wait, no job's path touches the table; docs/operations.md, "Rollups", gives the figure).
-- llm_calls stays bigint: a count of rows. duration_ms_max stays bigint: one job's duration.
--
-- orc_retention_progress: one row, the point retention has caught up to. A batch of the
-- prune_finished_jobs query that comes back short (nothing more it may delete) sets it, in the
-- same statement, to the earlier of its now() and the rollups' watermark plus the shortest
-- retention in force: every job that became due for deletion before that point and that
-- retention may delete is gone. A run that stops with jobs still due leaves it; so does a run
-- that fails, or none running. The fleet exporter exports now() minus it as
-- orchestrator_retention_lag_seconds (how long, at most, the oldest job overdue for deletion has
-- been overdue). Starts at the migration's time.
--
-- Compatible with older workers: their rollup statements write numeric columns as they wrote
-- bigint ones, and their reads sum them to numeric as before (the largest duration is still a
-- bigint); the new table is one they neither read nor write (while they prune, it does not
-- move, and the lag it gives grows: docs/operations.md, "OrchestratorRetentionBehind").

ALTER TABLE orc_job_rollups
    ALTER COLUMN duration_ms_sum TYPE numeric,
    ALTER COLUMN input_tokens TYPE numeric,
    ALTER COLUMN output_tokens TYPE numeric,
    ALTER COLUMN cache_read_tokens TYPE numeric,
    ALTER COLUMN cache_creation_tokens TYPE numeric;

CREATE TABLE orc_retention_progress (
    one boolean PRIMARY KEY DEFAULT true CHECK (one),
    caught_up_to timestamptz NOT NULL
);
INSERT INTO orc_retention_progress (caught_up_to) VALUES (now());
