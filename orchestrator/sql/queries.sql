-- Every statement the orchestrator runs, by name (loaded by orchestrator/queries.py).
--
-- Conventions: status writes are conditional on `status = ANY(%(sources)s)`, whose value comes
-- from orchestrator/states.py; writes made on behalf of an attempt are also fenced by its
-- `lease_token`. A write that matches no row changed nothing, and the caller finds out why.

-- database_exists --
SELECT 1 FROM pg_database WHERE datname = %(dbname)s

-- create_database --
-- (the name is an identifier, formatted in with psycopg.sql)
CREATE DATABASE {}

-- drop_database --
DROP DATABASE IF EXISTS {} WITH (FORCE)

-- listen_channel --
-- (the channel is an identifier, formatted in with psycopg.sql). Workers listen on orc_wakeup,
-- where statements that schedule a dispatch send its due time (epoch seconds), and on
-- Procrastinate's channels, where it announces inserted jobs.
LISTEN {}

-- migrations_lock --
-- Two processes migrating at once take turns (released at commit).
SELECT pg_advisory_xact_lock(hashtextextended('orchestrator migrate', 0))

-- migrations_table --
CREATE TABLE IF NOT EXISTS orc_schema_migrations (
    component text NOT NULL,
    version text NOT NULL,
    name text NOT NULL,
    checksum text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (component, version)
)

-- migrations_applied --
SELECT component, version, checksum FROM orc_schema_migrations

-- migrations_record --
INSERT INTO orc_schema_migrations (component, version, name, checksum)
VALUES (%(component)s, %(version)s, %(name)s, %(checksum)s)

-- procrastinate_installed --
SELECT to_regclass('procrastinate_jobs')

-- sync_states --
INSERT INTO orc_states (status, terminal)
SELECT * FROM unnest(%(statuses)s::text[], %(terminal)s::boolean[])
ON CONFLICT (status) DO UPDATE SET terminal = EXCLUDED.terminal

-- sync_transitions --
-- Make orc_state_transitions exactly the pairs declared in states.py.
WITH declared AS (
    SELECT * FROM unnest(%(sources)s::text[], %(targets)s::text[]) AS d(from_status, to_status)
), removed AS (
    DELETE FROM orc_state_transitions AS t
     WHERE NOT EXISTS (SELECT 1 FROM declared AS d
                        WHERE d.from_status = t.from_status AND d.to_status = t.to_status)
)
INSERT INTO orc_state_transitions (from_status, to_status)
SELECT from_status, to_status FROM declared
ON CONFLICT DO NOTHING

-- submit_jobs --
-- Insert jobs and their first dispatches in one round trip (see orc_submit_jobs_v1).
SELECT ord, job_id, outcome
  FROM orc_submit_jobs_v1(%(specs)s, %(initial_status)s, %(waiting)s, %(task_prefix)s)

-- dispatch_jobs --
-- Give jobs a new Procrastinate job each, at their next_retry_at or run_at.
SELECT orc_dispatch_v1(%(job_ids)s::uuid[], %(task_prefix)s) AS dispatched

-- claim_job --
-- Claim a job for one run of a dispatch (see orc_claim_v1); no row: nothing to claim.
SELECT * FROM orc_claim_v1(%(job_id)s, %(procrastinate_job_id)s, %(run)s, %(worker)s,
                           %(sources)s, %(running)s)

-- fetch_dispatch --
-- The worker's fetch: Procrastinate's, plus the claim of our job (see orc_fetch_dispatch_v1).
SELECT id, status, task_name, priority, lock, queueing_lock, args, scheduled_at, queue_name,
       attempts, worker_id
  FROM orc_fetch_dispatch_v1(%(queues)s::varchar[], %(worker_id)s, %(task_prefix)s,
                             %(worker)s, %(claimable)s, %(running)s)

-- complete_job --
-- Success: COMPLETED with the result, lease released, job.completed recorded. Given the
-- attempt's Procrastinate job, the same statement also finishes it (succeeded), so a job is
-- never COMPLETED while its dispatch still shows as running, nor the other way round.
WITH done AS (
    UPDATE orc_jobs
       SET status = %(target)s, result = %(result)s,
           lease_token = NULL, locked_by = NULL, heartbeat_at = NULL
     WHERE id = %(job_id)s AND lease_token = %(lease_token)s AND status = ANY (%(sources)s)
    RETURNING id
), event AS (
    INSERT INTO orc_job_events (job_id, kind, payload)
    SELECT id, 'job.completed', %(event)s FROM done
), dispatch AS (
    -- Called directly: a guard such as `FROM procrastinate_jobs WHERE status = 'doing'` is
    -- planned as a scan and costs several times the whole completion. Like Procrastinate's
    -- own finish, it raises (and nothing is written) if the dispatch is not running.
    SELECT procrastinate_finish_job_v1(%(procrastinate_job_id)s, 'succeeded', %(delete_dispatch)s)
     WHERE %(procrastinate_job_id)s::bigint IS NOT NULL
)
SELECT (SELECT count(*) FROM done) AS completed, (SELECT count(*) FROM dispatch) AS finished

-- fail_job --
-- Terminal failure of an attempt. Seed 003's order: the dead letter is recorded, then the job
-- is FAILED; both rows and both events are written by this one statement.
WITH failed AS (
    UPDATE orc_jobs
       SET status = %(target)s, last_error = %(error)s, next_retry_at = NULL,
           lease_token = NULL, locked_by = NULL, heartbeat_at = NULL
     WHERE id = %(job_id)s AND lease_token = %(lease_token)s AND status = ANY (%(sources)s)
    RETURNING id, job_type, payload
), letter AS (
    INSERT INTO orc_dead_letters (id, job_id, job_type, payload, error)
    SELECT %(dead_letter_id)s, id, job_type, payload, %(error)s FROM failed
    RETURNING id, job_id
), events AS (
    INSERT INTO orc_job_events (job_id, kind, payload)
    SELECT letter.job_id, e.kind, e.payload || jsonb_build_object('dead_letter_id', letter.id)
      FROM letter,
           (VALUES (1, 'job.dead_lettered', '{}'::jsonb),
                   (2, 'job.failed', %(event)s::jsonb)) AS e (n, kind, payload)
     ORDER BY e.n
)
SELECT id FROM letter

-- schedule_retry --
-- A transient failure with budget left: RETRY until next_retry_at, lease released. The app
-- layer counts a retry and gives the job a new dispatch (dispatch_jobs, same transaction); the
-- infra layer leaves both to Procrastinate, which re-runs the same dispatch.
WITH retrying AS (
    UPDATE orc_jobs
       SET status = %(target)s,
           retry_count = retry_count + %(retry_increment)s,
           next_retry_at = %(next_retry_at)s,
           last_error = %(error)s,
           lease_token = NULL, locked_by = NULL, heartbeat_at = NULL
     WHERE id = %(job_id)s AND lease_token = %(lease_token)s AND status = ANY (%(sources)s)
    RETURNING id, retry_count, next_retry_at
), events AS (
    INSERT INTO orc_job_events (job_id, kind, payload)
    SELECT r.id, e.kind,
           e.payload || jsonb_build_object('retry_count', r.retry_count,
                                           'available_at', r.next_retry_at)
      FROM retrying AS r,
           (VALUES (1, 'job.failed', %(failed_event)s::jsonb),
                   (2, 'job.retry_scheduled', %(retry_event)s::jsonb)) AS e (n, kind, payload)
     ORDER BY e.n
)
SELECT id, pg_notify('orc_wakeup', extract(epoch FROM next_retry_at)::text) FROM retrying

-- hand_back_job --
-- An interrupted attempt (drain, abort) gives its job back: PENDING again, no retry budget used,
-- and a new dispatch from dispatch_jobs in the same transaction.
WITH released AS (
    UPDATE orc_jobs
       SET status = %(target)s, next_retry_at = NULL,
           lease_token = NULL, locked_by = NULL, heartbeat_at = NULL
     WHERE id = %(job_id)s AND lease_token = %(lease_token)s AND status = ANY (%(sources)s)
    RETURNING id
), event AS (
    INSERT INTO orc_job_events (job_id, kind, payload)
    SELECT id, 'job.interrupted', %(event)s FROM released
)
SELECT id FROM released

-- cancel_job --
-- Cancel a job that has not finished. A waiting dispatch is cancelled; a running one is asked
-- to abort (Procrastinate cancels its task); its attempt's writes are fenced out either way.
WITH cancelled AS (
    UPDATE orc_jobs
       SET status = %(target)s, next_retry_at = NULL,
           lease_token = NULL, locked_by = NULL, heartbeat_at = NULL
     WHERE id = %(job_id)s AND status = ANY (%(sources)s)
    RETURNING id, procrastinate_job_id
), event AS (
    INSERT INTO orc_job_events (job_id, kind, payload)
    SELECT id, 'job.cancelled', %(event)s FROM cancelled
)
SELECT id, procrastinate_cancel_job_v1(procrastinate_job_id, true, false) AS procrastinate_job
  FROM cancelled

-- job_state --
-- Why did a write match nothing? The job's current status and lease, if it exists.
SELECT status, lease_token FROM orc_jobs WHERE id = %(job_id)s

-- get_job --
SELECT * FROM orc_jobs WHERE id = %(job_id)s

-- job_events --
SELECT id, job_id, kind, at, payload FROM orc_job_events WHERE job_id = %(job_id)s ORDER BY id

-- list_jobs --
-- Newest first (ids are UUIDv7, so id order is creation order).
SELECT * FROM orc_jobs
 WHERE (%(status)s::text IS NULL OR status = %(status)s)
   AND (%(job_type)s::text IS NULL OR job_type = %(job_type)s)
 ORDER BY id DESC
 LIMIT %(limit)s

-- soonest_due --
-- For the worker's wake-up timer: seconds until the next waiting job is due (null: none), and
-- whether one came due in the last %(lookback)s seconds (the worker may not have seen it).
WITH due AS (
    SELECT next_retry_at AS at FROM orc_jobs
     WHERE status = %(retry)s AND next_retry_at > now() - make_interval(secs => %(lookback)s)
    UNION ALL
    SELECT run_at FROM orc_jobs
     WHERE status = %(pending)s AND run_at > now() - make_interval(secs => %(lookback)s)
)
SELECT extract(epoch FROM min(at) FILTER (WHERE at > now()) - now()) AS seconds,
       coalesce(bool_or(at <= now()), false) AS overdue
  FROM due

-- lost_dispatches --
-- The retry safety net: waiting jobs past due whose Procrastinate job is gone, finished, or
-- held by a worker that stopped heartbeating. Bounded, and SKIP LOCKED so sweepers never
-- share a row.
SELECT j.id, j.procrastinate_job_id, p.status AS procrastinate_status
  FROM orc_jobs AS j
  LEFT JOIN procrastinate_jobs AS p ON p.id = j.procrastinate_job_id
  LEFT JOIN procrastinate_workers AS w ON w.id = p.worker_id
 WHERE j.status = ANY (%(waiting)s)
   AND coalesce(j.next_retry_at, j.run_at) < now() - make_interval(secs => %(grace_seconds)s)
   AND (p.id IS NULL
        OR p.status NOT IN ('todo', 'doing')
        OR (p.status = 'doing'
            AND (w.id IS NULL
                 OR w.last_heartbeat < now() - make_interval(secs => %(stalled_seconds)s))))
 ORDER BY coalesce(j.next_retry_at, j.run_at)
 LIMIT %(limit)s
   FOR UPDATE OF j SKIP LOCKED

-- settle_procrastinate_job --
-- Close a Procrastinate job left in `doing` by a dead worker, so its lock frees the job.
SELECT procrastinate_finish_job_v1(%(procrastinate_job_id)s, 'failed', false)
 WHERE EXISTS (SELECT 1 FROM procrastinate_jobs
                WHERE id = %(procrastinate_job_id)s AND status = 'doing')

-- record_events --
-- Append events (a JSON array of {job_id, kind, payload}) in order.
INSERT INTO orc_job_events (job_id, kind, payload)
SELECT (e.event ->> 'job_id')::uuid, e.event ->> 'kind', e.event -> 'payload'
  FROM jsonb_array_elements(%(events)s) WITH ORDINALITY AS e (event, n)
 ORDER BY e.n

-- list_dead_letters --
SELECT * FROM orc_dead_letters
 WHERE (%(state)s::text IS NULL OR state = %(state)s)
 ORDER BY created_at DESC
 LIMIT %(limit)s

-- get_dead_letter --
SELECT * FROM orc_dead_letters WHERE id = %(dead_letter_id)s FOR UPDATE

-- mark_dead_letter_requeued --
UPDATE orc_dead_letters
   SET state = 'requeued', requeued_job_id = %(job_id)s, resolved_at = now()
 WHERE id = %(dead_letter_id)s AND state IN ('recorded', 'discard_requested')
RETURNING id

-- request_dead_letter_discard --
UPDATE orc_dead_letters
   SET state = 'discard_requested', discard_requested_by = %(reviewer)s,
       discard_reason = %(reason)s
 WHERE id = %(dead_letter_id)s AND state = 'recorded'
RETURNING id

-- confirm_dead_letter_discard --
UPDATE orc_dead_letters
   SET state = 'discarded', discarded_by = %(reviewer)s, resolved_at = now()
 WHERE id = %(dead_letter_id)s AND state = 'discard_requested'
   AND discard_requested_by <> %(reviewer)s
RETURNING id
