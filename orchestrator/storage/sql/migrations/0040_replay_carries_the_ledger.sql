-- 0040_replay_carries_the_ledger: a job requeued from a dead letter carries the replayed job's
-- side-effect ledger (functions/checkpoints.sql, orc_replay_ledger_v1): a committed effect
-- returns its result, a pending or failed one is reconciled before any new call, under the
-- invocation ids of the chain's first job (`effects_root`), which the external system saw.
-- Compatible: the release before neither reads nor writes the column; a replay one of its
-- workers runs makes its effects under its own ids, as it did before.
--
-- compatible-with-older-workers: yes
-- revises: functions/checkpoints.sql 96af210dc7d2f627fcde0f863f217eda3eea6e7e57aed27dd65c222593097e95

ALTER TABLE orc_jobs ADD COLUMN effects_root uuid;
