-- 0061_runners_and_activity: what the overview needs to tell the truth (issue 44).
--
-- Which registered processes run jobs: a worker runs its job types' dispatches; the API server
-- (`serve`) registers too, for the dispatches of external job types, which external workers run
-- through it. The overview said "1 alive in the registry" with only `serve` up and every job
-- waiting. Each process now records what it runs beside its config version: `runs` is `jobs`
-- (a worker) or `external` (an API server). A release before this one writes its row without
-- it (null): it is counted as it was, a process that serves its application's types.
--
-- What happened by the minute it happened: the overview's activity chart counts the retries
-- scheduled and the failures of the last hour from their events (the rollups count a job in
-- the minute it finishes, minutes later). A partial index on those two kinds' times keeps that
-- read a range of the last hour, never the whole history. Applying it builds the index while
-- writes to orc_job_events wait (as 0025's: run it CONCURRENTLY by hand under this name before
-- migrating a large database; CREATE INDEX IF NOT EXISTS then finds it).
--
-- compatible-with-older-workers: yes

ALTER TABLE orc_worker_configs ADD COLUMN runs text;

CREATE INDEX IF NOT EXISTS orc_job_events_activity ON orc_job_events (at)
    WHERE kind IN ('job.retry_scheduled', 'job.dead_lettered');
