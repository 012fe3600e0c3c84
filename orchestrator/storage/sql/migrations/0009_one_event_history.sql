-- 0009_one_event_history: the job's history is orc_job_events alone; Procrastinate's triggers
-- that copy each dispatch's status changes into procrastinate_events are disabled.
--
-- orc_job_events records every transition of a job, in the transaction that makes it, with the
-- payloads of seed 000; it is what `orchestrator status` and Orchestrator.job_events read.
-- Procrastinate's triggers wrote a second history, per dispatch: a row when a dispatch is
-- deferred, scheduled, started, finished or asked to abort (three rows for a job that runs once),
-- each with its index entries and its foreign-key check, inside the submit, the fetch and the
-- completion statements, so on the path from submit to start. Nothing of Procrastinate's
-- worker reads them. Measured with bench/latency.py's back-to-back loop, the triggers switched
-- on and off every 50 jobs in one process: 80-99 us less from submit to start with them off.
--
-- Procrastinate reads these rows in two places, neither used here: its `remove_old_jobs` task
-- (a finished job's age is its latest event's) and the deprecated `nb_seconds` form of stalled
-- jobs (the sweep here goes by heartbeats and leases). docs/operations.md says so.
--
-- The triggers are disabled, not dropped, so Procrastinate's own migrations, which drop and
-- create them by name, still apply; one that creates a trigger again leaves it enabled (the
-- cost comes back, nothing else changes). The notification triggers, and the one that unlinks
-- periodic defers when a dispatch is deleted, stay.
ALTER TABLE procrastinate_jobs
    DISABLE TRIGGER procrastinate_trigger_status_events_insert_v1,
    DISABLE TRIGGER procrastinate_trigger_status_events_update_v1,
    DISABLE TRIGGER procrastinate_trigger_scheduled_events_v1,
    DISABLE TRIGGER procrastinate_trigger_abort_requested_events_v1;
