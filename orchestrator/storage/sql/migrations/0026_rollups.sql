-- 0026_rollups: history that outlives the jobs. The jobs that finished in each minute are
-- summed into one row per (minute, job type, queue, tenant), and each hour's minutes into one
-- row per hour, kept far longer than the jobs (ORCHESTRATOR_ROLLUP_RETENTION_DAYS,
-- ORCHESTRATOR_ROLLUP_HOURLY_RETENTION_DAYS); the waiting and running jobs of each queue and
-- tenant are sampled once a minute. The stats API, `orchestrator stats` and the dashboard's
-- charts read these, never the jobs (docs/operations.md, "Rollups").
--
-- compatible-with-older-workers: yes
--
-- Written by the maintenance lane (the rollup_jobs service, orchestrator/services/rollup.py),
-- never on a job's own path: every closed minute past the watermark is rolled up from the jobs
-- that finished in it, a bounded span of minutes per statement, and the watermark moves past
-- it in the same statement. A rollup run again over the same minutes writes the same rows
-- (each row is replaced by its recomputed value, never added to).
--
-- orc_rolled_up_to_v1() is the watermark: every job that finished before it is counted in the
-- rollups (null: none yet). A deletion of finished jobs that must not lose history deletes
-- only jobs that finished before it.
--
-- The per-queue counts of unfinished jobs (the overview's queue table, GET /api/v1/queues) read
-- the jobs' queue and due times from the table, whose unfinished rows lie among the finished
-- ones: a scan of all history (130 ms at 1,000,000 jobs, bench/overview.py). The index the fleet
-- counts read (orc_jobs_unfinished_counts, 0016) now holds them too, so that read is an
-- index-only scan of the unfinished jobs. No index is added: a status change writes the same
-- entries as before, each about 24 B larger.
--
-- Compatible with older workers: it adds tables and functions that no release's worker uses,
-- changes none they do, and an index no statement names.

CREATE TABLE orc_job_rollups (
    period integer NOT NULL CHECK (period IN (60, 3600)),  -- seconds: a minute or an hour
    at timestamptz NOT NULL,           -- the period's start; its jobs finished in [at, at + period)
    job_type text NOT NULL,
    queue text NOT NULL,
    tenant text NOT NULL,              -- '' for jobs of no tenant (a key column is never null)
    completed integer NOT NULL,
    failed integer NOT NULL,
    cancelled integer NOT NULL,
    dead_lettered integer NOT NULL,    -- jobs with a dead letter (failed, or degraded)
    app_retries integer NOT NULL,      -- job.retry_scheduled with layer app, of these jobs
    infra_retries integer NOT NULL,    -- ... with layer infra (a Procrastinate re-run)
    timed integer NOT NULL,            -- jobs that ran (a duration: first claim to finish)
    duration_ms_sum bigint NOT NULL,
    duration_ms_max bigint NOT NULL,
    -- durations counted in buckets (orchestrator.domain.rollups.BUCKETS): under each bound
    lt_100ms integer NOT NULL, lt_500ms integer NOT NULL, lt_1s integer NOT NULL,
    lt_5s integer NOT NULL, lt_15s integer NOT NULL, lt_1min integer NOT NULL,
    lt_5min integer NOT NULL, lt_15min integer NOT NULL, lt_1h integer NOT NULL,
    ge_1h integer NOT NULL,
    PRIMARY KEY (period, at, job_type, queue, tenant)
);
-- A principal limited to tenants reads only its tenants' rows (its stats, its dashboard).
CREATE INDEX orc_job_rollups_tenant ON orc_job_rollups (tenant, period, at);

-- Jobs due and waiting to start, and running, per queue and tenant, as sampled in a minute.
CREATE TABLE orc_queue_depth (
    at timestamptz NOT NULL,
    queue text NOT NULL,
    tenant text NOT NULL,              -- '' for jobs of no tenant
    waiting integer NOT NULL,
    running integer NOT NULL,
    PRIMARY KEY (at, queue, tenant)
);

-- One row: the end of the last minute rolled up.
CREATE TABLE orc_rollup_watermark (
    one boolean PRIMARY KEY DEFAULT true CHECK (one),
    rolled_up_to timestamptz
);
INSERT INTO orc_rollup_watermark (rolled_up_to) VALUES (NULL);

CREATE FUNCTION orc_rolled_up_to_v1() RETURNS timestamptz
LANGUAGE sql STABLE AS $$
    SELECT rolled_up_to FROM orc_rollup_watermark
$$;

DROP INDEX orc_jobs_unfinished_counts;
CREATE INDEX orc_jobs_unfinished_counts ON orc_jobs (status, job_type, tenant_id, queue)
    INCLUDE (run_at, next_retry_at) WHERE finished_at IS NULL;
