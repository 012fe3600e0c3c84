-- 0025_retention: finished jobs are deleted once past their retention (the prune_finished
-- maintenance service, docs/operations.md "Retention"), and each of its batches finds them, the
-- dispatches that go with them, and the rows that point at them, by index lookups only.
--
-- compatible-with-older-workers: yes
--
-- * orc_jobs_finished_by_type: finished jobs by type, status and finish time. A retention is
--   per (job type, terminal status) (per-type overrides in the retry config), so a batch reads
--   one range per pair: `job_type = t AND status = s AND finished_at < now() - retention(t, s)`,
--   and every entry it reads is due. An index on finish time alone would make every batch read
--   past the jobs kept longer (FAILED ones, 30 days by default, or a type's longer override)
--   to reach the due ones; 0020's BRIN index on finished_at cannot return rows in ranges at
--   all without reading whole block ranges. Partial: an unfinished job writes no entry in it,
--   and a job writes one when it finishes (the finishing update is not HOT: status is indexed).
-- * orc_procrastinate_jobs_finished_lock: a job's finished dispatches (every dispatch is locked
--   on its job id, 0001), deleted with the job. The live ones are in
--   orc_procrastinate_jobs_live_lock (0001); Procrastinate's own indexes do not lead with the
--   lock. A dispatch writes one entry more, when it ends.
-- * orc_jobs_replay_of, orc_dead_letters_requeued_job_id: the two foreign keys whose ON DELETE
--   SET NULL runs at each deletion had no index on the referencing column, so deleting a dead
--   letter read all of orc_jobs (for a replay pointing at it), and deleting a job all of
--   orc_dead_letters (for a requeue that made it). Measured (`./dev bench retention --jobs
--   200000`, run with `--without` naming both, and without): a batch of 1,000 jobs, 30 of them
--   with a dead letter, took 560 ms without them and 143 ms with them; the gap grows with the
--   tables.
--   Partial: only replays and requeued letters have an entry.
--
-- Applying it builds the indexes while writes to orc_jobs and procrastinate_jobs wait (CREATE
-- INDEX takes a SHARE lock; migrations run in one transaction, so CONCURRENTLY is not
-- available). Measured on PostgreSQL 15 (2-core VM, shared), 1,000,000 finished jobs of 10
-- types with one dispatch each (`./dev bench retention`, its `index` lines, two runs):
-- orc_jobs_finished_by_type 1.9-2.7 s and 50 bytes a job, orc_procrastinate_jobs_finished_lock
-- 0.8-2.6 s and 59 bytes a job, orc_jobs_replay_of 0.2 s, orc_dead_letters_requeued_job_id
-- under 0.1 s, the tables in cache. Plan a few seconds of stalled submits and completions per
-- million jobs kept (the first prune then deletes most of them), or build the same indexes
-- CONCURRENTLY by hand, under these names, before migrating (CREATE INDEX IF NOT EXISTS then
-- finds them).
--
-- No function changes: an older worker's writes fill the indexes as today's do.

CREATE INDEX IF NOT EXISTS orc_jobs_finished_by_type ON orc_jobs (job_type, status, finished_at)
    WHERE finished_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS orc_procrastinate_jobs_finished_lock ON procrastinate_jobs (lock)
    WHERE status NOT IN ('todo', 'doing') AND lock IS NOT NULL;
CREATE INDEX IF NOT EXISTS orc_jobs_replay_of ON orc_jobs (replay_of) WHERE replay_of IS NOT NULL;
CREATE INDEX IF NOT EXISTS orc_dead_letters_requeued_job_id ON orc_dead_letters (requeued_job_id)
    WHERE requeued_job_id IS NOT NULL;
