-- Every statement the orchestrator runs, by name (loaded by orchestrator/queries.py).
--
-- Conventions: status writes are conditional on `status = ANY(%(sources)s)`, whose value comes
-- from orchestrator/states.py; writes made on behalf of an attempt are also fenced by its
-- `lease_token`. A write that matches no row changed nothing, and the caller finds out why.
-- A read that a partial index serves writes out the status its predicate names (`status =
-- 'RETRY'`): a parameter cannot match a predicate in a generic plan (tests/test_plans.py).

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
-- Procrastinate's channels, where it announces inserted jobs and abort requests.
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

-- migrations_table_compatibility --
-- Whether a migration of ours is compatible with the release before it (the file's marker, read
-- when it was applied): older code has no copy of the file. Rows recorded before this column
-- existed, and Procrastinate's, are not marked.
ALTER TABLE orc_schema_migrations
    ADD COLUMN IF NOT EXISTS compatible_with_older_workers boolean NOT NULL DEFAULT false

-- migrations_applied --
SELECT component, version, checksum FROM orc_schema_migrations

-- migrations_unknown --
-- Our migrations applied that this code does not have (a newer release applied them).
SELECT version, name, compatible_with_older_workers FROM orc_schema_migrations
 WHERE component = 'orchestrator' AND NOT version = ANY (%(known)s::text[])
 ORDER BY version

-- migrations_table_exists --
-- Was this database ever migrated?
SELECT to_regclass('orc_schema_migrations') IS NOT NULL AS migrated

-- migrations_record --
-- A function file is recorded again each time it changes (its new checksum).
INSERT INTO orc_schema_migrations (component, version, name, checksum,
                                   compatible_with_older_workers)
VALUES (%(component)s, %(version)s, %(name)s, %(checksum)s, %(compatible)s)
ON CONFLICT (component, version) DO UPDATE
SET checksum = EXCLUDED.checksum, applied_at = now()

-- definitions_unchecked --
-- Function files are applied as a restore applies a dump: bodies are checked when they run, so
-- a function may name one that a later file defines (until the transaction ends).
SET LOCAL check_function_bodies = off

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
-- Insert jobs and their first dispatches in one round trip (see orc_submit_jobs_v2).
SELECT ord, job_id, outcome
  FROM orc_submit_jobs_v2(%(specs)s, %(initial_status)s, %(waiting)s, %(task_prefix)s)

-- dispatch_jobs --
-- Give jobs a new Procrastinate job each, at their next_retry_at or run_at.
SELECT orc_dispatch_v1(%(job_ids)s::uuid[], %(task_prefix)s) AS dispatched

-- fetch_dispatches --
-- The worker's fetch: Procrastinate's (leaving the `excluded` queues alone: external job
-- types'), plus the claim of our job, for up to `limit` dispatches
-- (see orc_fetch_dispatches_v3, migration 0029: a job whose key has no room is parked, not
-- claimed, and the next dispatch fetched instead); no row: nothing is due. It waits for no lock:
-- a job another transaction holds at that instant is left to claim_dispatch (args: claim_later).
SELECT id, status, task_name, priority, lock, queueing_lock, args, scheduled_at, queue_name,
       attempts, worker_id
  FROM orc_fetch_dispatches_v3(%(limit)s, %(queues)s::varchar[], %(excluded)s::varchar[],
                               %(worker_id)s, %(task_prefix)s, %(worker)s, %(claimable)s,
                               %(running)s)

-- claim_dispatch --
-- The claim a fetch left for later (its job was locked at that instant), made now: it waits for
-- the job row, the only lock it takes. No row: the dispatch has gone stale meanwhile (its job
-- was replaced, cancelled or claimed, or it was parked for want of capacity on its key), and
-- its worker ends it.
SELECT * FROM orc_claim_v2(%(job_id)s, %(dispatch_id)s, %(run)s,
                           %(worker)s::text || '/w' || %(worker_id)s::text, %(claimable)s,
                           %(running)s, %(task_prefix)s)

-- complete_jobs --
-- Success, for several attempts at once ([{ord, job_id, lease_token, result, event,
-- procrastinate_job_id, delete_dispatch}]; see orc_complete_jobs_v1): each job COMPLETED with
-- its result, lease released, job.completed recorded, and its dispatch finished (succeeded) in
-- the same transaction. One row per item: whether its job was COMPLETED.
SELECT ord, completed FROM orc_complete_jobs_v1(%(items)s, %(target)s, %(sources)s)

-- fail_jobs --
-- Terminal failures, every path's ([{ord, job_id, lease_token, dead_letter_id, error, failed,
-- before, degraded, dispatch_id, dispatch_status}], shaped by orchestrator/domain/failures.py):
-- each job FAILED with its dead letter and events, and the dispatch that ran it ended, in the
-- dead-letter flow's order (see orc_fail_jobs_v1). One row per item: the dead letter's id, or
-- null where the job was not failed.
SELECT ord, dead_letter_id FROM orc_fail_jobs_v1(%(items)s, %(target)s, %(sources)s)

-- end_dispatch --
-- End a dispatch its worker ran (succeeded, failed or aborted), if it is still doing: a sweep may
-- have settled it already.
SELECT orc_end_dispatch_v1(%(dispatch_id)s, %(status)s) AS ended

-- retry_dispatch --
-- The infrastructure layer: Procrastinate runs the same dispatch again at retry_at (its attempts
-- + 1), unless an abort was requested meanwhile (then it ends failed).
SELECT procrastinate_retry_job_v2(%(dispatch_id)s, coalesce(%(retry_at)s, now()), NULL, NULL,
                                  NULL)

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
    -- job.failed reports the counters at the failure; job.retry_scheduled those after it.
    INSERT INTO orc_job_events (job_id, kind, payload)
    SELECT r.id, e.kind, e.payload
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
-- With what it waits for, when it waits for capacity (docs/flow-control.md).
SELECT j.*, w.blocked_on AS flow_blocked_on, k.paused_until AS flow_paused_until
  FROM orc_jobs AS j
  LEFT JOIN orc_flow_waiters AS w ON w.job_id = j.id
  LEFT JOIN orc_flow_keys AS k ON k.key = w.key
 WHERE j.id = %(job_id)s

-- job_events --
SELECT id, job_id, kind, at, payload FROM orc_job_events WHERE job_id = %(job_id)s ORDER BY id

-- list_jobs --
-- Newest first (ids are UUIDv7, so id order is creation order); a tenant's through
-- orc_jobs_tenant_id. A key is per tenant: without a tenant, every tenant's job with it.
SELECT j.*, w.blocked_on AS flow_blocked_on, k.paused_until AS flow_paused_until
  FROM (SELECT * FROM orc_jobs
         WHERE (%(status)s::text IS NULL OR status = %(status)s)
           AND (%(job_type)s::text IS NULL OR job_type = %(job_type)s)
           AND (%(tenant_id)s::text IS NULL OR tenant_id = %(tenant_id)s)
           AND (%(job_key)s::text IS NULL OR job_key = %(job_key)s)
         ORDER BY id DESC
         LIMIT %(limit)s) AS j
  LEFT JOIN orc_flow_waiters AS w ON w.job_id = j.id
  LEFT JOIN orc_flow_keys AS k ON k.key = w.key
 ORDER BY j.id DESC

-- soonest_due --
-- For the worker's wake-up timer: seconds until the next waiting job is due (null: none), and
-- whether one came due in the last %(lookback)s seconds (the worker may not have seen it). A
-- job waiting for capacity is due when its key's pump scheduled its dispatch for (a pump
-- announces only the soonest of the times it schedules). The statuses are written out, as in
-- the partial indexes they read (orc_jobs_retry_due, orc_jobs_pending_run_at): a parameter
-- cannot match an index's predicate in a generic plan, which then reads the whole table.
WITH due AS (
    SELECT next_retry_at AS at FROM orc_jobs
     WHERE status = 'RETRY' AND next_retry_at > now() - make_interval(secs => %(lookback)s)
    UNION ALL
    SELECT run_at FROM orc_jobs
     WHERE status = 'PENDING' AND run_at > now() - make_interval(secs => %(lookback)s)
    UNION ALL
    SELECT dispatched_at FROM orc_flow_waiters
     WHERE dispatched_at > now() - make_interval(secs => %(lookback)s)
)
SELECT extract(epoch FROM min(at) FILTER (WHERE at > now()) - now()) AS seconds,
       coalesce(bool_or(at <= now()), false) AS overdue
  FROM due

-- lost_dispatches --
-- The retry safety net: waiting jobs past due whose Procrastinate job is gone, finished, or
-- held by a worker that stopped heartbeating, but those this run could not handle. Bounded,
-- and SKIP LOCKED so sweepers never share a row. The waiting statuses are written out, as in
-- the partial indexes it reads (orc_jobs_pending_run_at, orc_jobs_retry_due; see soonest_due).
SELECT j.id, j.procrastinate_job_id, p.status AS procrastinate_status
  FROM orc_jobs AS j
  LEFT JOIN LATERAL (  -- a lookup per waiting job: a join's plan may hash the whole table
      SELECT d.id, d.status, d.worker_id FROM procrastinate_jobs AS d
       WHERE d.id = j.procrastinate_job_id
       LIMIT 1) AS p ON true
  LEFT JOIN procrastinate_workers AS w ON w.id = p.worker_id
 WHERE j.status IN ('PENDING', 'RETRY')
   AND coalesce(j.next_retry_at, j.run_at) < now() - make_interval(secs => %(grace_seconds)s)
   AND (p.id IS NULL
        OR p.status NOT IN ('todo', 'doing')
        OR (p.status = 'doing'
            AND (w.id IS NULL
                 OR w.last_heartbeat < now() - make_interval(secs => %(stalled_seconds)s))))
   AND j.id <> ALL (%(passed_over)s::uuid[])
   -- A job parked for capacity has no dispatch on purpose (its key's pump gives it one).
   AND NOT EXISTS (SELECT FROM orc_flow_waiters AS f
                    WHERE f.job_id = j.id AND f.dispatched_at IS NULL)
 ORDER BY coalesce(j.next_retry_at, j.run_at)
 LIMIT %(limit)s
   FOR UPDATE OF j SKIP LOCKED

-- register_worker --
-- A worker's entry in Procrastinate's registry (its fetches name it; its heartbeats keep it).
SELECT worker_id FROM procrastinate_register_worker_v1()

-- prune_stalled_workers --
-- Forget workers silent for longer than %(seconds)s (Procrastinate's rule).
SELECT worker_id FROM procrastinate_prune_stalled_workers_v1(%(seconds)s)

-- worker_heartbeat --
-- As procrastinate_update_heartbeat_v1, saying whether the worker was still registered (a worker
-- silent longer than the stalled-worker timeout, through a database outage, is pruned).
UPDATE procrastinate_workers SET last_heartbeat = now() WHERE id = %(worker_id)s

-- unregister_worker --
SELECT procrastinate_unregister_worker_v1(%(worker_id)s)

-- dispatches_to_abort --
-- Of these running dispatches, those asked to abort (their job was cancelled): the poll behind
-- the abort notifications, which a lost listener would miss.
SELECT id FROM procrastinate_jobs
 WHERE id = ANY (%(ids)s::bigint[]) AND status = 'doing' AND abort_requested

-- ping --
-- The liveness probe's question, and the listener's on a quiet connection: is the database there?
SELECT 1 AS ok

-- record_events --
-- Append events (a JSON array of {job_id, kind, payload}) in order.
INSERT INTO orc_job_events (job_id, kind, payload)
SELECT (e.event ->> 'job_id')::uuid, e.event ->> 'kind', e.event -> 'payload'
  FROM jsonb_array_elements(%(events)s) WITH ORDINALITY AS e (event, n)
 ORDER BY e.n

-- record_attempt_event --
-- An event an attempt writes about its own work (job.model_fallback), fenced by its lease: a
-- superseded attempt writes nothing (no row returned).
INSERT INTO orc_job_events (job_id, kind, payload)
SELECT j.id, %(kind)s, %(payload)s
  FROM orc_jobs AS j
 WHERE j.id = %(job_id)s AND j.lease_token = %(lease_token)s AND j.status = %(running)s
RETURNING job_id

-- record_maintenance_failures --
-- job.maintenance_failed for each job a maintenance service could not handle ([{job_id,
-- payload}]), unless the job's latest event already says the same: a row refused at every run
-- is recorded once, not once a run.
INSERT INTO orc_job_events (job_id, kind, payload)
SELECT f.job_id, 'job.maintenance_failed', f.payload
  FROM jsonb_to_recordset(%(failures)s) AS f (job_id uuid, payload jsonb)
 WHERE NOT EXISTS (
       SELECT FROM (SELECT e.kind, e.payload FROM orc_job_events AS e
                     WHERE e.job_id = f.job_id ORDER BY e.id DESC LIMIT 1) AS latest
        WHERE latest.kind = 'job.maintenance_failed' AND latest.payload = f.payload)
RETURNING job_id

-- list_dead_letters --
-- Newest first; a tenant's through orc_dead_letters_tenant; `tenants`: only theirs (an API
-- principal's), null for any.
SELECT * FROM orc_dead_letters
 WHERE (%(state)s::text IS NULL OR state = %(state)s)
   AND (%(tenant_id)s::text IS NULL OR tenant_id = %(tenant_id)s)
   AND (%(tenants)s::text[] IS NULL OR tenant_id = ANY (%(tenants)s))
 ORDER BY created_at DESC
 LIMIT %(limit)s

-- find_dead_letter --
SELECT * FROM orc_dead_letters WHERE id = %(dead_letter_id)s

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
-- By another person than the requester's (the persons: migration 0022's trigger).
UPDATE orc_dead_letters
   SET state = 'discarded', discarded_by = %(reviewer)s, resolved_at = now()
 WHERE id = %(dead_letter_id)s AND state = 'discard_requested'
   AND discard_requested_person <> orc_principal_person_v1(%(reviewer)s)
RETURNING id

-- == Checkpoints and the side-effect ledger (checkpoints/) ======================================
-- Writes made by an attempt lock its job row FOR SHARE while checking the lease: a concurrent
-- change of lease (a sweep) either waits for them or makes them match nothing.

-- last_checkpoint --
-- Where a stepped job resumes: its last committed step, that step's state, and whether it was
-- the final step.
SELECT step, state, final FROM orc_checkpoints
 WHERE job_id = %(job_id)s
 ORDER BY step DESC
 LIMIT 1

-- begin_effect --
-- Before a side-effecting call: what the ledger knows of it, and (if nothing) record it pending.
WITH leased AS (
    SELECT id FROM orc_jobs
     WHERE id = %(job_id)s AND lease_token = %(lease_token)s AND status = %(running)s
       FOR SHARE
), existing AS (
    SELECT status, result FROM orc_side_effects
     WHERE job_id = %(job_id)s AND invocation_id = %(invocation_id)s
), recorded AS (
    INSERT INTO orc_side_effects (job_id, invocation_id, step, name, args, status, attempt)
    SELECT id, %(invocation_id)s, %(step)s, %(name)s, %(args)s, 'pending', %(attempt)s
      FROM leased
     WHERE NOT EXISTS (SELECT 1 FROM existing)
)
SELECT EXISTS (SELECT 1 FROM leased) AS leased,
       (SELECT status FROM existing) AS status,
       (SELECT result FROM existing) AS result

-- retry_effect --
-- An earlier attempt's call failed, or is pending and will be made again: pending, for this one.
UPDATE orc_side_effects
   SET status = 'pending', error = NULL, attempt = %(attempt)s
 WHERE job_id = %(job_id)s AND invocation_id = %(invocation_id)s
   AND status IN ('pending', 'failed')
   AND EXISTS (SELECT 1 FROM orc_jobs
                WHERE id = %(job_id)s AND lease_token = %(lease_token)s AND status = %(running)s
                  FOR SHARE)
RETURNING invocation_id

-- fail_effect --
-- The call raised: the ledger keeps its classified error (the attempt's outcome follows).
UPDATE orc_side_effects
   SET status = 'failed', error = %(error)s
 WHERE job_id = %(job_id)s AND invocation_id = %(invocation_id)s AND status = 'pending'
   AND EXISTS (SELECT 1 FROM orc_jobs
                WHERE id = %(job_id)s AND lease_token = %(lease_token)s AND status = %(running)s
                  FOR SHARE)
RETURNING invocation_id

-- commit_effects --
-- Results of side effects ([{invocation_id, result, reconciled}]) become committed, outside a
-- checkpoint: a plain task's effects, reconciled ones, and those an ending attempt still holds.
-- Written again with the same results, it changes nothing and still matches every row, so a write
-- whose acknowledgement was lost can be made again.
UPDATE orc_side_effects AS e
   SET status = 'committed', result = coalesce(c.result, 'null'), reconciled = c.reconciled,
       error = NULL, attempt = %(attempt)s
  FROM jsonb_to_recordset(%(effects)s) AS c (invocation_id text, result jsonb, reconciled boolean)
 WHERE e.job_id = %(job_id)s AND e.invocation_id = c.invocation_id
   AND EXISTS (SELECT 1 FROM orc_jobs
                WHERE id = %(job_id)s AND lease_token = %(lease_token)s AND status = %(running)s
                  FOR SHARE)
RETURNING e.invocation_id

-- write_checkpoint --
-- A step's commit point, in one round trip: its checkpoint, its side effects' results, and a
-- job.checkpointed event. A stale attempt (superseded lease) writes none of them.
WITH leased AS (
    SELECT id, attempt FROM orc_jobs
     WHERE id = %(job_id)s AND lease_token = %(lease_token)s AND status = %(running)s
       FOR SHARE
), saved AS (
    INSERT INTO orc_checkpoints (job_id, step, state, final, attempt)
    SELECT id, %(step)s, %(state)s, %(final)s, attempt FROM leased
    RETURNING job_id, step
), committed AS (
    UPDATE orc_side_effects AS e
       SET status = 'committed', result = coalesce(c.result, 'null'),
           reconciled = c.reconciled, error = NULL, attempt = %(attempt)s
      FROM saved,
           jsonb_to_recordset(%(effects)s) AS c (invocation_id text, result jsonb,
                                                 reconciled boolean)
     WHERE e.job_id = saved.job_id AND e.invocation_id = c.invocation_id
       AND e.status <> 'committed'
    RETURNING e.invocation_id
), event AS (
    INSERT INTO orc_job_events (job_id, kind, payload)
    SELECT job_id, 'job.checkpointed',
           %(event)s::jsonb || jsonb_build_object('effects_committed',
                                                  (SELECT count(*) FROM committed))
      FROM saved
)
SELECT (SELECT count(*) FROM saved) AS saved, (SELECT count(*) FROM committed) AS committed

-- job_steps --
-- A job's checkpoints and side effects, for `orchestrator status` and the demo.
SELECT 'checkpoint' AS kind, step, NULL AS invocation_id, NULL AS name, NULL AS status,
       state AS detail, attempt, created_at AS at
  FROM orc_checkpoints WHERE job_id = %(job_id)s
UNION ALL
SELECT 'side_effect', step, invocation_id, name, status,
       jsonb_build_object('args', args, 'result', result, 'error', error,
                          'reconciled', reconciled),
       attempt, updated_at
  FROM orc_side_effects WHERE job_id = %(job_id)s
 ORDER BY step, at

-- == Approval gates ==============================================================================

-- step_approval --
-- The approval a step asked for (under its key), if it asked before.
SELECT * FROM orc_approvals
 WHERE job_id = %(job_id)s AND step = %(step)s AND key = %(key)s

-- request_approval --
-- The attempt stops and waits: WAITING_APPROVAL (lease released) with its approval record and a
-- job.waiting_approval event, in one statement (its notice, if any, is submitted in the same
-- transaction).
WITH waiting AS (
    UPDATE orc_jobs
       SET status = %(target)s, lease_token = NULL, locked_by = NULL, heartbeat_at = NULL
     WHERE id = %(job_id)s AND lease_token = %(lease_token)s AND status = ANY (%(sources)s)
    RETURNING id
), approval AS (
    INSERT INTO orc_approvals (id, job_id, step, key, question, details, on_reject, expires_at)
    SELECT %(approval_id)s, id, %(step)s, %(key)s, %(question)s, %(details)s, %(on_reject)s,
           now() + make_interval(secs => %(expires_in)s)
      FROM waiting
    RETURNING id, job_id, expires_at
), event AS (
    INSERT INTO orc_job_events (job_id, kind, payload)
    SELECT job_id, 'job.waiting_approval',
           %(event)s::jsonb || jsonb_build_object('expires_at', expires_at)
      FROM approval
)
SELECT id FROM approval

-- lock_approval --
-- An approval with its job (both locked, for the decision): the approval's own columns, and the
-- job's status and counters, which a failure reports.
SELECT a.id, a.step, a.status, a.on_reject, a.expires_at, a.job_id, j.status AS job_status,
       j.job_type, j.tenant_id, j.payload, j.attempt, j.max_attempts, j.dispatch_attempt, j.retry_count,
       j.max_retries, j.lease_token, j.locked_by
  FROM orc_approvals AS a JOIN orc_jobs AS j ON j.id = a.job_id
 WHERE a.id = %(approval_id)s
   FOR UPDATE OF a, j

-- decide_approval --
UPDATE orc_approvals
   SET status = %(decision)s, decided_at = now(), decided_by = %(decided_by)s,
       reason = %(reason)s
 WHERE id = %(approval_id)s AND status = 'pending'
RETURNING id

-- resume_after_approval --
-- Approved (or rejected down the task's rejection path): PENDING, no budget used, with an event;
-- dispatch_jobs gives it a new dispatch in the same transaction.
WITH resumed AS (
    UPDATE orc_jobs SET status = %(target)s
     WHERE id = %(job_id)s AND status = ANY (%(sources)s)
    RETURNING id
)
INSERT INTO orc_job_events (job_id, kind, payload)
SELECT id, %(kind)s, %(event)s FROM resumed
RETURNING job_id

-- expired_approvals --
-- Approvals past their expiry whose job still waits, but those this run could not handle;
-- bounded, SKIP LOCKED for several sweepers.
SELECT a.id, a.job_id
  FROM orc_approvals AS a JOIN orc_jobs AS j ON j.id = a.job_id
 WHERE a.status = 'pending' AND a.expires_at < now() AND j.status = %(waiting)s
   AND a.id <> ALL (%(passed_over)s::uuid[])
 ORDER BY a.expires_at
 LIMIT %(limit)s
   FOR UPDATE OF a SKIP LOCKED

-- list_approvals --
SELECT a.*, j.job_type, j.status AS job_status, j.tenant_id
  FROM orc_approvals AS a JOIN orc_jobs AS j ON j.id = a.job_id
 WHERE (%(status)s::text IS NULL OR a.status = %(status)s)
   AND (%(tenants)s::text[] IS NULL OR j.tenant_id = ANY (%(tenants)s))
 ORDER BY a.requested_at DESC
 LIMIT %(limit)s

-- get_approval --
SELECT a.*, j.job_type, j.status AS job_status, j.tenant_id
  FROM orc_approvals AS a JOIN orc_jobs AS j ON j.id = a.job_id
 WHERE a.id = %(approval_id)s

-- cancel_job_approvals --
-- A cancelled job's open approval is closed with it.
UPDATE orc_approvals
   SET status = 'cancelled', decided_at = now(), decided_by = %(by)s, reason = %(reason)s
 WHERE job_id = %(job_id)s AND status = 'pending'

-- == Retention ===================================================================================

-- prune_checkpoints --
-- Checkpoints of jobs finished before the cutoff; bounded per run.
WITH doomed AS (
    SELECT c.job_id, c.step FROM orc_checkpoints AS c
      JOIN orc_jobs AS j ON j.id = c.job_id
     WHERE j.finished_at < now() - make_interval(secs => %(older_than)s)
     LIMIT %(limit)s
)
DELETE FROM orc_checkpoints AS c USING doomed AS d
 WHERE c.job_id = d.job_id AND c.step = d.step

-- prune_side_effects --
-- Ledger rows of jobs finished before the cutoff; bounded per run.
WITH doomed AS (
    SELECT e.job_id, e.invocation_id FROM orc_side_effects AS e
      JOIN orc_jobs AS j ON j.id = e.job_id
     WHERE j.finished_at < now() - make_interval(secs => %(older_than)s)
     LIMIT %(limit)s
)
DELETE FROM orc_side_effects AS e USING doomed AS d
 WHERE e.job_id = d.job_id AND e.invocation_id = d.invocation_id

-- prune_finished_jobs --
-- One batch of the retention of finished jobs (orchestrator.services.retention): at most
-- %(limit)s jobs past their retention, deleted in this one statement with their dispatches
-- (their Procrastinate events go by cascade) and, by cascade, their events, checkpoints, ledger
-- rows, approvals, reviewed dead letters, LLM usage and token budget (0030). `candidates` is the whole rule of which jobs may go
-- (kept in this one place):
-- * finished longer ago than the retention of its (type, status): `retention` pairs every job
--   type present (a loose scan of orc_jobs_job_type_id, one probe per type) with each terminal
--   status, and each pair is one range of orc_jobs_finished_by_type (0025);
-- * finished before the rollups' watermark (orc_rolled_up_to_v1, 0026): counted in the
--   history that outlives it (none before the first rollup, whose watermark is null);
-- * not a FAILED job whose dead letter awaits review (recorded, discard_requested), nor one whose
--   dead letter was requeued to a job that has not finished (its replay_of points here);
-- * no dispatch still todo, or doing on a registered worker (one finishing it, in
--   orc_procrastinate_jobs_live_lock); a dispatch a dead worker left doing (Procrastinate pruned
--   the worker, which unset its worker_id: a job cancelled while it ran there) goes with the job;
-- * not locked by anyone else (SKIP LOCKED: two prunes never share a job).
-- Returns one row per job taken: its type and status, how many rows of each kind went with it,
-- and, with %(archive)s, the whole of it as JSON (read from the statement's snapshot: what the
-- deletes remove). With %(dry_run)s nothing is deleted: the rows are what one batch would take.
WITH RECURSIVE job_types AS (
    SELECT min(job_type) AS job_type FROM orc_jobs
    UNION ALL
    SELECT (SELECT min(j.job_type) FROM orc_jobs AS j WHERE j.job_type > t.job_type)
      FROM job_types AS t
     WHERE t.job_type IS NOT NULL
), retention AS (
    SELECT t.job_type, d.status, coalesce(o.seconds, d.seconds) AS seconds
      FROM job_types AS t
     CROSS JOIN unnest(%(statuses)s::text[], %(seconds)s::float8[]) AS d (status, seconds)
      LEFT JOIN unnest(%(override_types)s::text[], %(override_statuses)s::text[],
                       %(override_seconds)s::float8[]) AS o (job_type, status, seconds)
        ON o.job_type = t.job_type AND o.status = d.status
     WHERE t.job_type IS NOT NULL
), candidates AS (
    SELECT c.id, c.job_type, c.status
      FROM retention AS r
     CROSS JOIN LATERAL (
        SELECT j.id, j.job_type, j.status FROM orc_jobs AS j
         WHERE j.job_type = r.job_type AND j.status = r.status
           AND j.finished_at < now() - make_interval(secs => r.seconds)
           AND j.finished_at < (SELECT orc_rolled_up_to_v1())
           AND NOT EXISTS (
                   SELECT FROM orc_dead_letters AS l
                    WHERE l.job_id = j.id
                      AND (l.state IN ('recorded', 'discard_requested')
                           OR EXISTS (SELECT FROM orc_jobs AS replay
                                       WHERE replay.id = l.requeued_job_id
                                         AND replay.finished_at IS NULL)))
           AND NOT EXISTS (
                   SELECT FROM procrastinate_jobs AS p
                    WHERE p.lock = j.id::text AND p.status IN ('todo', 'doing')
                      AND (p.status = 'todo' OR p.worker_id IS NOT NULL))
         LIMIT %(limit)s
           FOR UPDATE OF j SKIP LOCKED
     ) AS c
     LIMIT %(limit)s
), dispatches AS (
    SELECT p.id, p.lock
      FROM procrastinate_jobs AS p  -- orc_procrastinate_jobs_finished_lock: a lookup per job
     WHERE p.lock = ANY (ARRAY(SELECT c.id::text FROM candidates AS c))
       AND p.status NOT IN ('todo', 'doing')
    UNION ALL
    SELECT p.id, p.lock
      FROM procrastinate_jobs AS p  -- orc_procrastinate_jobs_live_lock: a dead worker's
     WHERE p.lock = ANY (ARRAY(SELECT c.id::text FROM candidates AS c))
       AND p.status = 'doing' AND p.worker_id IS NULL
), dispatch_rows AS (
    SELECT x.lock, count(*) AS n, sum(pe.n)::bigint AS events,
           CASE WHEN %(archive)s THEN jsonb_agg(
               to_jsonb(p) || jsonb_build_object('events', pe.archived) ORDER BY p.id) END
               AS archived
      FROM dispatches AS x
      JOIN procrastinate_jobs AS p ON p.id = x.id
     CROSS JOIN LATERAL (
        SELECT count(*) AS n, coalesce(jsonb_agg(to_jsonb(e) ORDER BY e.id), '[]') AS archived
          FROM procrastinate_events AS e WHERE e.job_id = x.id
     ) AS pe
     GROUP BY x.lock
), deleted_dispatches AS (  -- by key: a join's generic plan, not knowing the batch is small,
    DELETE FROM procrastinate_jobs AS p  -- hashed the whole table
     WHERE p.id = ANY (ARRAY(SELECT x.id FROM dispatches AS x)) AND NOT %(dry_run)s
), deleted_jobs AS (
    DELETE FROM orc_jobs AS j
     WHERE j.id = ANY (ARRAY(SELECT c.id FROM candidates AS c)) AND NOT %(dry_run)s
)
SELECT c.id, c.job_type, c.status,
       (SELECT count(*) FROM orc_job_events AS e WHERE e.job_id = c.id) AS events,
       (SELECT count(*) FROM orc_checkpoints AS k WHERE k.job_id = c.id) AS checkpoints,
       (SELECT count(*) FROM orc_side_effects AS s WHERE s.job_id = c.id) AS side_effects,
       (SELECT count(*) FROM orc_approvals AS a WHERE a.job_id = c.id) AS approvals,
       (SELECT count(*) FROM orc_dead_letters AS l WHERE l.job_id = c.id) AS dead_letters,
       coalesce(r.n, 0) AS dispatches, coalesce(r.events, 0) AS dispatch_events,
       (SELECT count(*) FROM orc_llm_usage AS u WHERE u.job_id = c.id) AS llm_usage,
       CASE WHEN %(archive)s THEN jsonb_build_object(
           'job', (SELECT to_jsonb(j) FROM orc_jobs AS j WHERE j.id = c.id),
           'events', coalesce((SELECT jsonb_agg(to_jsonb(e) ORDER BY e.id)
                                 FROM orc_job_events AS e WHERE e.job_id = c.id), '[]'),
           'checkpoints', coalesce((SELECT jsonb_agg(to_jsonb(k) ORDER BY k.step)
                                      FROM orc_checkpoints AS k WHERE k.job_id = c.id), '[]'),
           'side_effects', coalesce((SELECT jsonb_agg(to_jsonb(s) ORDER BY s.invocation_id)
                                       FROM orc_side_effects AS s WHERE s.job_id = c.id), '[]'),
           'approvals', coalesce((SELECT jsonb_agg(to_jsonb(a) ORDER BY a.id)
                                    FROM orc_approvals AS a WHERE a.job_id = c.id), '[]'),
           'dead_letters', coalesce((SELECT jsonb_agg(to_jsonb(l) ORDER BY l.id)
                                       FROM orc_dead_letters AS l WHERE l.job_id = c.id), '[]'),
           'dispatches', coalesce(r.archived, '[]'),
           'llm_usage', coalesce((SELECT jsonb_agg(to_jsonb(u) ORDER BY u.id)
                                    FROM orc_llm_usage AS u WHERE u.job_id = c.id), '[]'))
       END AS archived
  FROM candidates AS c
  LEFT JOIN dispatch_rows AS r ON r.lock = c.id::text

-- prune_maintenance_dispatches --
-- The finished dispatches of the maintenance services' periodic ticks (no lock: no job is
-- theirs) whose tick is older than %(older_than)s seconds; Procrastinate unlinks the periodic
-- defer that names one. Returns how many went (or, with %(dry_run)s, would go). The queue is
-- written out (orchestrator.services.maintenance.QUEUE): as a parameter, a generic plan
-- estimated it by the average queue and read the whole table.
WITH doomed AS (
    SELECT p.id FROM procrastinate_jobs AS p  -- procrastinate_jobs_queue_name_idx_v1
     WHERE p.queue_name = 'maintenance' AND p.lock IS NULL
       AND p.status NOT IN ('todo', 'doing')
       AND CASE WHEN jsonb_typeof(p.args -> 'timestamp') = 'number'
                THEN (p.args ->> 'timestamp')::float8 END
           < extract(epoch FROM now()) - %(older_than)s
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), deleted AS (
    DELETE FROM procrastinate_jobs AS p
     WHERE p.id = ANY (ARRAY(SELECT d.id FROM doomed AS d)) AND NOT %(dry_run)s
)
SELECT count(*) AS n FROM doomed

-- prune_sessions --
-- Dashboard sessions past their expiry (orc_ui_sessions_expires_at).
WITH doomed AS (
    SELECT id_sha256 FROM orc_ui_sessions WHERE expires_at < now() LIMIT %(limit)s
), deleted AS (
    DELETE FROM orc_ui_sessions AS s USING doomed AS d
     WHERE s.id_sha256 = d.id_sha256 AND NOT %(dry_run)s
)
SELECT count(*) AS n FROM doomed

-- prune_event_listeners --
-- API servers' claims to wait for events that lapsed (a server that died without its stop).
WITH doomed AS (
    SELECT listener FROM orc_event_listeners WHERE until < now() LIMIT %(limit)s
), deleted AS (
    DELETE FROM orc_event_listeners AS x USING doomed AS d
     WHERE x.listener = d.listener AND NOT %(dry_run)s
)
SELECT count(*) AS n FROM doomed

-- prune_revoked_tokens --
-- API tokens revoked more than %(older_than)s seconds ago (the longest job retention: no kept
-- job's history can name one of them any more). Their sessions go by cascade.
WITH doomed AS (
    SELECT id FROM orc_api_tokens
     WHERE revoked_at < now() - make_interval(secs => %(older_than)s)
     LIMIT %(limit)s
), deleted AS (
    DELETE FROM orc_api_tokens AS t USING doomed AS d WHERE t.id = d.id AND NOT %(dry_run)s
)
SELECT count(*) AS n FROM doomed

-- == Liveness: heartbeats and the zombie sweep ===================================================

-- heartbeat --
-- One statement per worker per tick: refresh every job it runs, each fenced by its lease, and
-- return those still held (a missing one was swept and handed on: the worker cancels it).
-- heartbeat_at never passes the backstop (deadline_at + the expiry grace, Graphile Worker's job_expiry)
-- minus the zombie threshold: an attempt still running at its backstop goes stale even while it
-- heartbeats, and the sweep takes it.
-- The rows are locked first, in job-id order, as a batch of completions locks them: an UPDATE
-- joined to the list locks in whatever order its plan visits the rows, and a heartbeat and a
-- completion of the same jobs deadlocked (seen in the soak: the heartbeat rolled back).
WITH held AS (
    SELECT j.id
      FROM orc_jobs AS j
      JOIN unnest(%(job_ids)s::uuid[], %(lease_tokens)s::uuid[]) AS h (id, lease_token)
        ON j.id = h.id AND j.lease_token = h.lease_token
     WHERE j.status = %(running)s
     ORDER BY j.id
       FOR NO KEY UPDATE OF j
)
UPDATE orc_jobs AS j
   SET heartbeat_at = least(
           now(), j.deadline_at + make_interval(secs => %(expiry_grace)s - %(threshold)s))
  FROM held
 WHERE j.id = held.id
RETURNING j.lease_token

-- zombies --
-- RUNNING jobs whose heartbeat is older than the threshold (orc_jobs_running_heartbeat), oldest
-- first, but those this run could not handle; bounded, and SKIP LOCKED so sweepers running at
-- once never share a job.
SELECT id, job_type, tenant_id, payload, lease_token, heartbeat_at, deadline_at, attempt,
       max_attempts, dispatch_attempt, retry_count, max_retries, procrastinate_job_id, locked_by
  FROM orc_jobs
 WHERE status = 'RUNNING'  -- orc_jobs_running_heartbeat's predicate (see soonest_due)
   AND heartbeat_at < now() - make_interval(secs => %(threshold)s)
   AND id <> ALL (%(passed_over)s::uuid[])
 ORDER BY heartbeat_at
 LIMIT %(limit)s
   FOR UPDATE SKIP LOCKED

-- sweep_to_retry --
-- Zombies with budget left ([{id, lease_token, next_retry_at, error, zombie, retry}]): RETRY,
-- retry_count + 1, with job.zombie_detected and job.retry_scheduled (attempt bumped at the next
-- claim); dispatch_jobs gives them new dispatches in the same transaction.
WITH d AS (
    SELECT * FROM jsonb_to_recordset(%(decisions)s)
        AS d (id uuid, lease_token uuid, next_retry_at timestamptz, error jsonb, zombie jsonb,
              retry jsonb)
), moved AS (
    UPDATE orc_jobs AS j
       SET status = %(target)s, retry_count = j.retry_count + 1,
           next_retry_at = d.next_retry_at, last_error = d.error,
           lease_token = NULL, locked_by = NULL, heartbeat_at = NULL
      FROM d
     WHERE j.id = d.id AND j.lease_token = d.lease_token AND j.status = ANY (%(sources)s)
    RETURNING j.id
), events AS (
    INSERT INTO orc_job_events (job_id, kind, payload)
    SELECT m.id, e.kind, e.payload
      FROM moved AS m JOIN d ON d.id = m.id,
           LATERAL (VALUES (1, 'job.zombie_detected', d.zombie),
                           (2, 'job.retry_scheduled', d.retry)) AS e (n, kind, payload)
     ORDER BY m.id, e.n
)
SELECT id FROM moved

-- settle_procrastinate_jobs --
-- Close the Procrastinate jobs a dead worker left in `doing` (Procrastinate never does: its
-- stalled jobs stay there), so they free their locks and nothing lingers.
SELECT procrastinate_finish_job_v1(p.id, 'failed', false)
  FROM unnest(%(procrastinate_job_ids)s::bigint[]) AS x (id)
  JOIN procrastinate_jobs AS p ON p.id = x.id AND p.status = 'doing'

-- scaling_load --
-- The fleet's load, for autoscaling: jobs due and waiting (PENDING past run_at, RETRY past
-- next_retry_at) plus jobs running, so that workers = ceil(load / concurrency) never drops
-- below what the running jobs occupy. KEDA's PostgreSQL scaler polls this exact text
-- (k8s/autoscaling/scaledobject.yaml; tests/test_autoscaling.py checks that the two are the
-- same): literals, no parameters. Each count reads a partial index (orc_jobs_pending_run_at,
-- orc_jobs_retry_due, orc_jobs_running_heartbeat), never the finished jobs.
SELECT (SELECT count(*) FROM orc_jobs WHERE status = 'PENDING' AND run_at <= now())
     + (SELECT count(*) FROM orc_jobs WHERE status = 'RETRY' AND next_retry_at <= now())
     + (SELECT count(*) FROM orc_jobs WHERE status = 'RUNNING') AS load

-- fleet_snapshot --
-- The fleet's metrics are read in one snapshot: the counts below agree with each other.
SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY

-- fleet_jobs --
-- Unfinished jobs by status, type and tenant (orc_jobs_unfinished_counts: an index-only scan).
SELECT status, job_type, coalesce(tenant_id, '') AS tenant, count(*) AS n
  FROM orc_jobs
 WHERE finished_at IS NULL
 GROUP BY 1, 2, 3

-- fleet_queues --
-- Jobs due and waiting to start, by queue, and how long the oldest has been due
-- (orc_jobs_pending_run_at, orc_jobs_retry_due, whose predicates the statuses match: see
-- soonest_due).
SELECT queue, count(*) AS depth, extract(epoch FROM now() - min(due)) AS oldest_age
  FROM (SELECT queue, run_at AS due FROM orc_jobs
         WHERE status = 'PENDING' AND run_at <= now()
        UNION ALL
        SELECT queue, next_retry_at FROM orc_jobs
         WHERE status = 'RETRY' AND next_retry_at <= now()) AS waiting
 GROUP BY queue

-- fleet_dead_letters --
-- Dead letters by state and tenant (orc_dead_letters_state_tenant: an index-only scan).
SELECT state, coalesce(tenant_id, '') AS tenant, count(*) AS n
  FROM orc_dead_letters
 GROUP BY 1, 2

-- fleet_counts --
-- Approvals waiting (orc_approvals_pending_expiry) and zombies not swept yet
-- (orc_jobs_running_heartbeat).
SELECT (SELECT count(*) FROM orc_approvals WHERE status = 'pending') AS approvals,
       (SELECT count(*) FROM orc_jobs
         WHERE status = 'RUNNING'
           AND heartbeat_at < now() - make_interval(secs => %(threshold)s)) AS zombies


-- fleet_flow --
-- The flow keys for the exporter: paused or not, running and waiting jobs, the adaptive rate.
-- Keys that are paused, slowed or have waiters first; at most 200 (the series stay bounded).
SELECT k.key, coalesce(k.paused_until > now(), false) AS paused,
       (SELECT count(*) FROM orc_jobs AS j
         WHERE j.flow_key = k.key AND j.status = 'RUNNING' AND j.flow_key IS NOT NULL)::integer
           AS running,
       (SELECT count(*) FROM orc_flow_waiters AS w WHERE w.key = k.key)::integer AS waiting,
       coalesce(orc_flow_factor_v1(k, l), 1) AS rate_factor
  FROM orc_flow_keys AS k
  LEFT JOIN orc_flow_limits AS l ON l.name = k.limit_name
 ORDER BY coalesce(k.paused_until > now(), false) DESC,
          EXISTS (SELECT FROM orc_flow_waiters AS w WHERE w.key = k.key) DESC, k.key
 LIMIT 200

-- == The HTTP API (orchestrator serve) ===========================================================

-- lock_token_names --
-- Until the transaction ends, no other token is created: the names read next stay all there is
-- while a new one is compared with them (orchestrator.domain.principals.skeleton).
LOCK TABLE orc_api_tokens IN SHARE ROW EXCLUSIVE MODE

-- token_names --
SELECT name FROM orc_api_tokens

-- create_token --
INSERT INTO orc_api_tokens (id, name, secret_sha256, scopes, tenants, created_by)
VALUES (%(id)s, %(name)s, %(secret_sha256)s, %(scopes)s, %(tenants)s, %(created_by)s)
RETURNING id

-- find_token --
SELECT id, name, secret_sha256, scopes, tenants FROM orc_api_tokens
 WHERE id = %(id)s AND revoked_at IS NULL

-- list_tokens --
SELECT id, name, scopes, tenants, created_by, created_at, revoked_at FROM orc_api_tokens
 ORDER BY created_at, name

-- revoke_token --
-- By its name as typed or in normal form (a token made before 0022 may have kept another).
UPDATE orc_api_tokens SET revoked_at = now()
 WHERE name = ANY (%(names)s) AND revoked_at IS NULL
RETURNING id

-- listen_for_events --
-- This API server waits for events until %(seconds)s from now, unless it renews the claim
-- (orc_job_events' statement trigger notifies `orc_job_events` while any claim is live).
INSERT INTO orc_event_listeners (listener, until)
VALUES (%(listener)s, now() + make_interval(secs => %(seconds)s))
ON CONFLICT (listener) DO UPDATE SET until = excluded.until

-- stop_listening_for_events --
DELETE FROM orc_event_listeners WHERE listener = %(listener)s OR until < now()

-- latest_event_ids --
-- The newest event id of each of these jobs (one primary-key probe each): which of the jobs
-- waited for have new events since the waiter last looked. Not a global cursor: ids are handed
-- out before commit, so a lower id can commit after a higher one.
SELECT job_id, max(id) AS last_event_id FROM orc_job_events
 WHERE job_id = ANY (%(job_ids)s::uuid[])
 GROUP BY job_id

-- job_events_after --
-- A job's events after a cursor (an event id), oldest first, a page at a time.
SELECT id, job_id, kind, at, payload FROM orc_job_events
 WHERE job_id = %(job_id)s AND id > %(after)s
 ORDER BY id
 LIMIT %(limit)s

-- page_jobs --
-- Jobs newest first (ids are UUIDv7: id order is creation order), after a cursor (the last id
-- of the previous page), with the API's filters; tenants: a principal's tenants (null: any).
SELECT j.*, w.blocked_on AS flow_blocked_on, k.paused_until AS flow_paused_until
  FROM (SELECT * FROM orc_jobs
 WHERE (%(before)s::uuid IS NULL OR id < %(before)s)
   AND (%(status)s::text IS NULL OR status = %(status)s)
   AND (%(job_type)s::text IS NULL OR job_type = %(job_type)s)
   AND (%(tenant_id)s::text IS NULL OR tenant_id = %(tenant_id)s)
   AND (%(tenants)s::text[] IS NULL OR tenant_id = ANY (%(tenants)s))
   AND (%(agent_id)s::text IS NULL OR agent_id = %(agent_id)s)
   AND (%(job_key)s::text IS NULL OR job_key = %(job_key)s)
   AND (%(created_after)s::timestamptz IS NULL OR created_at >= %(created_after)s)
   AND (%(created_before)s::timestamptz IS NULL OR created_at < %(created_before)s)
 ORDER BY id DESC
 LIMIT %(limit)s) AS j
  LEFT JOIN orc_flow_waiters AS w ON w.job_id = j.id
  LEFT JOIN orc_flow_keys AS k ON k.key = w.key
 ORDER BY j.id DESC

-- queue_stats --
-- Per queue: jobs by status (unfinished), due and waiting, and the age of the oldest waiting
-- (orc_jobs_unfinished_counts holds every column read: an index-only scan).
SELECT queue,
       count(*) FILTER (WHERE status = 'PENDING') AS pending,
       count(*) FILTER (WHERE status = 'RUNNING') AS running,
       count(*) FILTER (WHERE status = 'RETRY') AS retry,
       count(*) FILTER (WHERE status = 'WAITING_APPROVAL') AS waiting_approval,
       count(*) FILTER (WHERE (status = 'PENDING' AND run_at <= now())
                           OR (status = 'RETRY' AND next_retry_at <= now())) AS due,
       extract(epoch FROM now() - min(CASE WHEN status = 'PENDING' AND run_at <= now()
                                           THEN run_at
                                           WHEN status = 'RETRY' AND next_retry_at <= now()
                                           THEN next_retry_at END)) AS oldest_due_age
  FROM orc_jobs
 WHERE finished_at IS NULL
   AND (%(tenants)s::text[] IS NULL OR tenant_id = ANY (%(tenants)s))
 GROUP BY queue
 ORDER BY queue

-- held_lease --
-- The job an external worker reports on, if its attempt still holds the lease: RUNNING, this
-- attempt, this lease token. (The report's own write is fenced by the lease again: a sweep
-- between this read and that write makes the write match nothing.)
SELECT *,
       -- since the claim (which set deadline_at to its time plus the job timeout)
       1000 * extract(epoch FROM now() - deadline_at
                                 + make_interval(secs => coalesce(timeout_seconds, 3600)))
           AS running_ms
  FROM orc_jobs
 WHERE id = %(job_id)s AND lease_token = %(lease_token)s AND attempt = %(attempt)s
   AND status = %(running)s

-- lock_replayed_job --
-- The internal replay endpoint runs one job now: its row first (the lock order), if it is
-- waiting (PENDING or RETRY), with the dispatch it waits in.
SELECT procrastinate_job_id FROM orc_jobs
 WHERE id = %(job_id)s AND status = ANY (%(claimable)s)
   FOR NO KEY UPDATE

-- take_dispatch --
-- ... then that dispatch, made doing under the API server's registry entry as Procrastinate's
-- fetch would (there is no upstream function to fetch one dispatch by id), due or not.
UPDATE procrastinate_jobs SET status = 'doing', worker_id = %(worker_id)s
 WHERE id = %(dispatch_id)s AND status = 'todo'
RETURNING id, attempts

-- == The dashboard (/ui) =========================================================================

-- create_session --
INSERT INTO orc_ui_sessions (id_sha256, token_id, csrf, expires_at)
VALUES (%(id_sha256)s, %(token_id)s, %(csrf)s, now() + make_interval(secs => %(seconds)s))

-- find_session --
-- A live session of a live token: the token's principal and the session's CSRF token.
SELECT t.id, t.name, t.scopes, t.tenants, s.csrf
  FROM orc_ui_sessions AS s JOIN orc_api_tokens AS t ON t.id = s.token_id
 WHERE s.id_sha256 = %(id_sha256)s AND s.expires_at > now() AND t.revoked_at IS NULL

-- end_session --
DELETE FROM orc_ui_sessions WHERE id_sha256 = %(id_sha256)s OR expires_at < now()

-- job_holders --
-- Who runs jobs now (a worker, an external worker, by its lease's holder) and since when it was
-- last heard of (orc_jobs_running_heartbeat).
SELECT locked_by, count(*) AS running, max(heartbeat_at) AS last_heartbeat FROM orc_jobs
 WHERE status = 'RUNNING'
   AND (%(tenants)s::text[] IS NULL OR tenant_id = ANY (%(tenants)s))
 GROUP BY locked_by
 ORDER BY locked_by

-- registered_workers --
-- The Procrastinate registry: workers (and API servers) alive by their own heartbeat.
SELECT id, last_heartbeat FROM procrastinate_workers
 WHERE last_heartbeat > now() - make_interval(secs => %(seconds)s)
 ORDER BY id

-- dead_letter_of_job --
SELECT * FROM orc_dead_letters WHERE job_id = %(job_id)s ORDER BY created_at DESC LIMIT 1

-- record_worker_config --
-- The retry config version a registered worker (or API server) runs now.
INSERT INTO orc_worker_configs (worker_id, worker, config_version, applied_at)
VALUES (%(worker_id)s, %(worker)s, %(version)s, %(applied_at)s)
ON CONFLICT (worker_id) DO UPDATE
   SET worker = EXCLUDED.worker, config_version = EXCLUDED.config_version,
       applied_at = EXCLUDED.applied_at

-- worker_configs --
-- The registry's live workers and API servers, each with the retry config version it recorded
-- (null: it records none, as the previous release).
SELECT w.id, c.worker, c.config_version, c.applied_at, w.last_heartbeat
  FROM procrastinate_workers AS w
  LEFT JOIN orc_worker_configs AS c ON c.worker_id = w.id
 WHERE w.last_heartbeat > now() - make_interval(secs => %(seconds)s)
 ORDER BY w.id

-- == Rollups: history that outlives the jobs (migration 0026, services/rollup.py) ========

-- roll_up_minutes --
-- The closed minutes past the watermark (at most %(minutes)s, ending %(settle)s seconds before
-- now: a finish committed later than that after its own clock time is not seen), rolled up from
-- the jobs that finished in them (orc_jobs_finished_at), each group's row replaced by its value
-- recomputed from those jobs, and the watermark moved past them; its row is locked first, so
-- two runs take turns. The first run starts at the oldest finished job. Retries are counted
-- by layer from the job's job.retry_scheduled events (its primary key), a dead letter from
-- orc_dead_letters_job_id. Returns the span rolled up and how many jobs finished in it.
-- Planned for the one row it reads (LIMIT 1: the table has one row, but the planner, without
-- statistics, guessed thousands and joined them to a sequential scan of orc_jobs), so the span
-- is found through orc_jobs_finished_at and each job's dead letter through its own lookup.
WITH mark AS (
    SELECT coalesce(w.rolled_up_to,
                    (SELECT date_trunc('minute', min(finished_at)) FROM orc_jobs),
                    date_trunc('minute', now())) AS since
      FROM orc_rollup_watermark AS w
     LIMIT 1
       FOR UPDATE
), span AS (
    SELECT m.since,
           greatest(m.since, least(m.since + make_interval(mins => %(minutes)s),
                                   date_trunc('minute',
                                              now() - make_interval(secs => %(settle)s))))
               AS until
      FROM mark AS m
), finished AS (
    SELECT date_trunc('minute', j.finished_at) AS at, j.job_type, j.queue,
           coalesce(j.tenant_id, '') AS tenant, j.status,
           round(1000 * extract(epoch FROM j.finished_at - j.started_at))::bigint AS ms,
           (SELECT true FROM orc_dead_letters AS d WHERE d.job_id = j.id) IS NOT NULL
               AS lettered,
           r.app, r.infra, u.calls, u.input, u.output, u.cache_read, u.cache_creation
      FROM span AS s
      JOIN orc_jobs AS j ON j.finished_at >= s.since AND j.finished_at < s.until
      CROSS JOIN LATERAL (
          SELECT count(*) FILTER (WHERE e.payload ->> 'layer' = 'app') AS app,
                 count(*) FILTER (WHERE e.payload ->> 'layer' = 'infra') AS infra
            FROM orc_job_events AS e
           WHERE e.job_id = j.id AND e.kind = 'job.retry_scheduled') AS r
      CROSS JOIN LATERAL (  -- its LLM calls (0030; orc_llm_usage's (job_id, call_id) index)
          SELECT count(*) AS calls, coalesce(sum(l.input_tokens), 0) AS input,
                 coalesce(sum(l.output_tokens), 0) AS output,
                 coalesce(sum(l.cache_read_tokens), 0) AS cache_read,
                 coalesce(sum(l.cache_creation_tokens), 0) AS cache_creation
            FROM orc_llm_usage AS l WHERE l.job_id = j.id) AS u
), bucketed AS (
    SELECT f.*, width_bucket(f.ms, %(bounds)s::bigint[]) AS b FROM finished AS f
), rolled AS (
    INSERT INTO orc_job_rollups AS r (
        period, at, job_type, queue, tenant, completed, failed, cancelled, dead_lettered,
        app_retries, infra_retries, timed, duration_ms_sum, duration_ms_max,
        lt_100ms, lt_500ms, lt_1s, lt_5s, lt_15s, lt_1min, lt_5min, lt_15min, lt_1h, ge_1h,
        llm_calls, input_tokens, output_tokens, cache_read_tokens, cache_creation_tokens)
    SELECT 60, at, job_type, queue, tenant,
           count(*) FILTER (WHERE status = 'COMPLETED'),
           count(*) FILTER (WHERE status = 'FAILED'),
           count(*) FILTER (WHERE status = 'CANCELLED'),
           count(*) FILTER (WHERE lettered),
           sum(app), sum(infra), count(ms), coalesce(sum(ms), 0), coalesce(max(ms), 0),
           count(*) FILTER (WHERE b = 0), count(*) FILTER (WHERE b = 1),
           count(*) FILTER (WHERE b = 2), count(*) FILTER (WHERE b = 3),
           count(*) FILTER (WHERE b = 4), count(*) FILTER (WHERE b = 5),
           count(*) FILTER (WHERE b = 6), count(*) FILTER (WHERE b = 7),
           count(*) FILTER (WHERE b = 8), count(*) FILTER (WHERE b = 9),
           sum(calls), sum(input), sum(output), sum(cache_read), sum(cache_creation)
      FROM bucketed
     GROUP BY at, job_type, queue, tenant
    ON CONFLICT (period, at, job_type, queue, tenant) DO UPDATE
       SET completed = excluded.completed, failed = excluded.failed,
           cancelled = excluded.cancelled, dead_lettered = excluded.dead_lettered,
           app_retries = excluded.app_retries, infra_retries = excluded.infra_retries,
           timed = excluded.timed, duration_ms_sum = excluded.duration_ms_sum,
           duration_ms_max = excluded.duration_ms_max, lt_100ms = excluded.lt_100ms,
           lt_500ms = excluded.lt_500ms, lt_1s = excluded.lt_1s, lt_5s = excluded.lt_5s,
           lt_15s = excluded.lt_15s, lt_1min = excluded.lt_1min, lt_5min = excluded.lt_5min,
           lt_15min = excluded.lt_15min, lt_1h = excluded.lt_1h, ge_1h = excluded.ge_1h,
           llm_calls = excluded.llm_calls, input_tokens = excluded.input_tokens,
           output_tokens = excluded.output_tokens,
           cache_read_tokens = excluded.cache_read_tokens,
           cache_creation_tokens = excluded.cache_creation_tokens
), moved AS (
    UPDATE orc_rollup_watermark SET rolled_up_to = s.until FROM span AS s
)
SELECT s.since, s.until, (SELECT count(*) FROM finished) AS jobs FROM span AS s

-- roll_up_hours --
-- The hours that %(since)s..%(until)s touched, summed again from their minutes (run after
-- roll_up_minutes, in its transaction), each row replaced by its new sum.
INSERT INTO orc_job_rollups AS r (
    period, at, job_type, queue, tenant, completed, failed, cancelled, dead_lettered,
    app_retries, infra_retries, timed, duration_ms_sum, duration_ms_max,
    lt_100ms, lt_500ms, lt_1s, lt_5s, lt_15s, lt_1min, lt_5min, lt_15min, lt_1h, ge_1h,
    llm_calls, input_tokens, output_tokens, cache_read_tokens, cache_creation_tokens)
SELECT 3600, date_trunc('hour', at), job_type, queue, tenant, sum(completed), sum(failed),
       sum(cancelled), sum(dead_lettered), sum(app_retries), sum(infra_retries), sum(timed),
       sum(duration_ms_sum), max(duration_ms_max), sum(lt_100ms), sum(lt_500ms), sum(lt_1s),
       sum(lt_5s), sum(lt_15s), sum(lt_1min), sum(lt_5min), sum(lt_15min), sum(lt_1h),
       sum(ge_1h), sum(llm_calls), sum(input_tokens), sum(output_tokens),
       sum(cache_read_tokens), sum(cache_creation_tokens)
  FROM orc_job_rollups
 WHERE period = 60
   AND at >= date_trunc('hour', %(since)s::timestamptz)
   AND at < date_trunc('hour', %(until)s::timestamptz - interval '1 microsecond')
            + interval '1 hour'
 GROUP BY 2, 3, 4, 5
ON CONFLICT (period, at, job_type, queue, tenant) DO UPDATE
   SET completed = excluded.completed, failed = excluded.failed,
       cancelled = excluded.cancelled, dead_lettered = excluded.dead_lettered,
       app_retries = excluded.app_retries, infra_retries = excluded.infra_retries,
       timed = excluded.timed, duration_ms_sum = excluded.duration_ms_sum,
       duration_ms_max = excluded.duration_ms_max, lt_100ms = excluded.lt_100ms,
       lt_500ms = excluded.lt_500ms, lt_1s = excluded.lt_1s, lt_5s = excluded.lt_5s,
       lt_15s = excluded.lt_15s, lt_1min = excluded.lt_1min, lt_5min = excluded.lt_5min,
       lt_15min = excluded.lt_15min, lt_1h = excluded.lt_1h, ge_1h = excluded.ge_1h,
       llm_calls = excluded.llm_calls, input_tokens = excluded.input_tokens,
       output_tokens = excluded.output_tokens, cache_read_tokens = excluded.cache_read_tokens,
       cache_creation_tokens = excluded.cache_creation_tokens

-- sample_queue_depth --
-- This minute's sample of each queue's and tenant's jobs due and waiting, and running (the
-- partial indexes orc_jobs_pending_run_at, orc_jobs_retry_due, orc_jobs_running_heartbeat);
-- a second sample in the same minute replaces the first.
INSERT INTO orc_queue_depth AS q (at, queue, tenant, waiting, running)
SELECT date_trunc('minute', now()), queue, coalesce(tenant_id, ''),
       count(*) FILTER (WHERE status <> 'RUNNING'), count(*) FILTER (WHERE status = 'RUNNING')
  FROM orc_jobs
 WHERE (status = 'PENDING' AND run_at <= now())
    OR (status = 'RETRY' AND next_retry_at <= now())
    OR status = 'RUNNING'
 GROUP BY 2, 3
ON CONFLICT (at, queue, tenant) DO UPDATE SET waiting = excluded.waiting, running = excluded.running

-- prune_rollups --
-- At most %(limit)s rollups of %(period)s seconds older than %(days)s days.
DELETE FROM orc_job_rollups
 WHERE ctid = ANY (ARRAY(SELECT ctid FROM orc_job_rollups
                          WHERE period = %(period)s
                            AND at < now() - make_interval(secs => %(days)s * 86400)
                          LIMIT %(limit)s))

-- prune_queue_depth --
-- At most %(limit)s queue depth samples older than %(days)s days.
DELETE FROM orc_queue_depth
 WHERE ctid = ANY (ARRAY(SELECT ctid FROM orc_queue_depth
                          WHERE at < now() - make_interval(secs => %(days)s * 86400)
                          LIMIT %(limit)s))

-- rolled_up_to --
SELECT orc_rolled_up_to_v1() AS rolled_up_to

-- job_stats --
-- The rollups of %(period)s seconds in [since, until), summed per step of %(step)s seconds
-- and per the dimensions asked for (the others are summed over); tenants: only these
-- ('' is no tenant's, never a principal's).
SELECT %(since)s::timestamptz
           + floor(extract(epoch FROM at - %(since)s::timestamptz) / %(step)s)
             * make_interval(secs => %(step)s) AS at,
       CASE WHEN %(by_job_type)s THEN job_type END AS job_type,
       CASE WHEN %(by_queue)s THEN queue END AS queue,
       CASE WHEN %(by_tenant)s THEN tenant END AS tenant,
       sum(completed) AS completed, sum(failed) AS failed, sum(cancelled) AS cancelled,
       sum(dead_lettered) AS dead_lettered, sum(app_retries) AS app_retries,
       sum(infra_retries) AS infra_retries, sum(timed) AS timed,
       sum(duration_ms_sum) AS duration_ms_sum, max(duration_ms_max) AS duration_ms_max,
       ARRAY[sum(lt_100ms), sum(lt_500ms), sum(lt_1s), sum(lt_5s), sum(lt_15s), sum(lt_1min),
             sum(lt_5min), sum(lt_15min), sum(lt_1h), sum(ge_1h)] AS buckets,
       sum(llm_calls) AS llm_calls, sum(input_tokens) AS input_tokens,
       sum(output_tokens) AS output_tokens, sum(cache_read_tokens) AS cache_read_tokens,
       sum(cache_creation_tokens) AS cache_creation_tokens
  FROM orc_job_rollups
 WHERE period = %(period)s AND at >= %(since)s AND at < %(until)s
   AND (%(tenants)s::text[] IS NULL OR tenant = ANY (%(tenants)s))
 GROUP BY 1, 2, 3, 4
 ORDER BY 2, 3, 4, 1

-- queue_depth_stats --
-- The queue depth sampled at the start of each step in [since, until), per the dimensions asked
-- for (queue, tenant; the others summed over); tenants: only these.
SELECT at,
       CASE WHEN %(by_queue)s THEN queue END AS queue,
       CASE WHEN %(by_tenant)s THEN tenant END AS tenant,
       sum(waiting) AS waiting, sum(running) AS running
  FROM orc_queue_depth
 WHERE at = ANY (ARRAY(SELECT generate_series(%(since)s::timestamptz,
                                              %(until)s::timestamptz - interval '1 second',
                                              make_interval(secs => %(step)s))))
   AND (%(tenants)s::text[] IS NULL OR tenant = ANY (%(tenants)s))
 GROUP BY 1, 2, 3
 ORDER BY 2, 3, 1
-- == Schedules (orchestrator.services.scheduler; migration 0027) ================================

-- sync_schedules --
-- The definitions a process holds ([{name, job_type, cron, tz, tenant_id, backfill_seconds}]),
-- written where new or changed; a new one's ticks are due from now on. In name order, so
-- processes starting together take the rows' locks in one order.
INSERT INTO orc_schedules AS s (name, job_type, cron, tz, tenant_id, backfill_seconds)
SELECT d.name, d.job_type, d.cron, d.tz, d.tenant_id, d.backfill_seconds
  FROM jsonb_to_recordset(%(schedules)s) AS d(name text, job_type text, cron text, tz text,
                                              tenant_id text, backfill_seconds integer)
 ORDER BY d.name
    ON CONFLICT (name) DO UPDATE
   SET job_type = excluded.job_type, cron = excluded.cron, tz = excluded.tz,
       tenant_id = excluded.tenant_id, backfill_seconds = excluded.backfill_seconds,
       defined_at = now()
 WHERE (s.job_type, s.cron, s.tz, s.tenant_id, s.backfill_seconds)
       IS DISTINCT FROM (excluded.job_type, excluded.cron, excluded.tz, excluded.tenant_id,
                         excluded.backfill_seconds)

-- schedules_to_fire --
-- The scheduler's one read per check: where each of its schedules stands, and the database's
-- clock, which every process reads ticks by.
SELECT name, fire_after, paused_at IS NOT NULL AS paused, statement_timestamp() AS now
  FROM orc_schedules
 WHERE name = ANY (%(names)s)
 ORDER BY name

-- fire_schedule --
-- The compare-and-set of a firing: the schedule moves past its last fired tick only if no other
-- process moved it since `seen` was read (nor paused it); no row: nothing to submit.
UPDATE orc_schedules
   SET fire_after = %(tick)s, last_tick = %(tick)s, last_job_id = %(job_id)s
 WHERE name = %(name)s AND fire_after = %(seen)s AND paused_at IS NULL
RETURNING name

-- list_schedules --
-- `tenants`: only theirs (an API principal's), null for any; a schedule without a tenant is
-- seen only by a principal of every tenant.
SELECT *, statement_timestamp() AS now FROM orc_schedules
 WHERE (%(tenants)s::text[] IS NULL OR tenant_id = ANY (%(tenants)s))
 ORDER BY name

-- pause_schedule --
-- Held until resumed; pausing a paused schedule keeps who paused it first.
UPDATE orc_schedules
   SET paused_at = coalesce(paused_at, now()), paused_by = coalesce(paused_by, %(by)s)
 WHERE name = %(name)s AND (%(tenants)s::text[] IS NULL OR tenant_id = ANY (%(tenants)s))
RETURNING *, statement_timestamp() AS now

-- resume_schedule --
-- Its ticks are due again from now on: those it missed while paused never run.
UPDATE orc_schedules
   SET fire_after = CASE WHEN paused_at IS NULL THEN fire_after
                         ELSE greatest(fire_after, now()) END,
       paused_at = NULL, paused_by = NULL
 WHERE name = %(name)s AND (%(tenants)s::text[] IS NULL OR tenant_id = ANY (%(tenants)s))
RETURNING *, statement_timestamp() AS now

-- == Flow control (docs/flow-control.md; migration 0029) =========================================

-- sync_flow_limits --
-- The limits of the config in effect ([{name, concurrency, requests, units, interval_seconds,
-- weights, key, share_by}]) and which job types run under them ([{job_type, limit,
-- fallback_after_seconds}]: null when the type names no fallback models), written
-- by each process that applies one; the names of the limits that changed (their keys' waiters
-- are then pumped: a raised limit frees capacity at once).
WITH given AS (
    SELECT * FROM jsonb_to_recordset(%(limits)s::jsonb)
        AS g (name text, concurrency integer, requests integer, units bigint,
              interval_seconds double precision, weights jsonb, key text, share_by text)
), types AS (
    SELECT * FROM jsonb_to_recordset(%(types)s::jsonb)
        AS t (job_type text, "limit" text, fallback_after_seconds double precision)
), gone_types AS (
    DELETE FROM orc_flow_job_types AS o
     WHERE NOT EXISTS (SELECT FROM types AS t
                        WHERE t.job_type = o.job_type AND t."limit" = o.limit_name)
), new_types AS (
    INSERT INTO orc_flow_job_types (job_type, limit_name, fallback_after_seconds)
    SELECT job_type, "limit", fallback_after_seconds FROM types
    ON CONFLICT (job_type) DO UPDATE
       SET limit_name = EXCLUDED.limit_name,
           fallback_after_seconds = EXCLUDED.fallback_after_seconds
), changed AS (
    INSERT INTO orc_flow_limits AS l (name, concurrency, requests, units, interval_seconds,
                                      weights, key_template, share_by)
    SELECT name, concurrency, requests, units, interval_seconds, coalesce(weights, '{}'), key,
           share_by
      FROM given
    ON CONFLICT (name) DO UPDATE
       SET concurrency = EXCLUDED.concurrency, requests = EXCLUDED.requests,
           units = EXCLUDED.units, interval_seconds = EXCLUDED.interval_seconds,
           weights = EXCLUDED.weights, key_template = EXCLUDED.key_template,
           share_by = EXCLUDED.share_by, updated_at = now()
     WHERE (l.concurrency, l.requests, l.units, l.interval_seconds, l.weights, l.key_template,
            l.share_by)
           IS DISTINCT FROM (EXCLUDED.concurrency, EXCLUDED.requests, EXCLUDED.units,
                             EXCLUDED.interval_seconds, EXCLUDED.weights, EXCLUDED.key_template,
                             EXCLUDED.share_by)
    RETURNING name
)
SELECT name FROM changed

-- pump_flow_keys --
-- Hand free capacity to the waiters of these keys (null: of every key with a waiter and none on
-- its way: the safety net's sweep, and after limits change). How many got a dispatch.
SELECT coalesce(sum(orc_flow_pump_v1(k.key)), 0)::integer AS dispatched
  FROM (SELECT DISTINCT w.key FROM orc_flow_waiters AS w
         WHERE w.dispatched_at IS NULL
           AND (%(keys)s::text[] IS NULL OR w.key = ANY (%(keys)s))
           AND NOT EXISTS (SELECT FROM orc_flow_waiters AS d
                            WHERE d.key = w.key AND d.dispatched_at IS NOT NULL
                              AND d.dispatched_at > now() - make_interval(secs => %(stale_seconds)s))
         ORDER BY w.key) AS k

-- flow_keys --
-- Every key: its limit, what runs and waits on it, what it spent in its window, its pause.
SELECT k.key, k.limit_name, k.paused_until, k.pause_reason, k.paused_by, k.throttled,
       orc_flow_factor_v1(k, l) AS rate_factor,
       l.concurrency, l.requests, l.units, l.interval_seconds,
       (SELECT count(*) FROM orc_jobs AS j
         WHERE j.flow_key = k.key AND j.status = 'RUNNING' AND j.flow_key IS NOT NULL)::integer
           AS running,
       (SELECT count(*) FROM orc_flow_waiters AS w WHERE w.key = k.key)::integer AS waiting,
       (SELECT coalesce(sum(s.requests), 0) FROM orc_flow_spends AS s
         WHERE s.key = k.key AND s.at > now() - make_interval(secs => l.interval_seconds))::bigint
           AS requests_used,
       (SELECT coalesce(sum(s.units), 0) FROM orc_flow_spends AS s
         WHERE s.key = k.key AND s.at > now() - make_interval(secs => l.interval_seconds))::bigint
           AS units_used
  FROM orc_flow_keys AS k
  LEFT JOIN orc_flow_limits AS l ON l.name = k.limit_name
 WHERE (%(key)s::text IS NULL OR k.key = %(key)s)
 ORDER BY k.key

-- pause_flow_key --
-- An operator pauses a key until a time: no job of it starts before then.
UPDATE orc_flow_keys
   SET paused_until = %(until)s, pause_reason = %(reason)s, paused_by = %(by)s
 WHERE key = %(key)s
RETURNING key

-- resume_flow_key --
-- An operator lifts a key's pause (and resets its adaptive rate): its waiters go at once
-- (see orc_flow_resume_v1). dispatched null: no such key.
SELECT orc_flow_resume_v1(%(key)s) AS dispatched

-- flow_throttled --
-- The provider behind a key answered 429 or 529: paused until the hint, or its rate halved.
SELECT orc_flow_throttled_v1(%(key)s, %(until)s, %(reason)s)

-- flow_key_paused_for --
-- Seconds the key stays paused from now (no row: it is not paused).
SELECT extract(epoch FROM paused_until - clock_timestamp())::float8 AS seconds
  FROM orc_flow_keys WHERE key = %(key)s AND paused_until > clock_timestamp()

-- flow_spend --
-- What an admitted job's call really used (see orc_flow_spend_v1): its reservation corrected
-- (the first call since its admission), or a later call's request and units added; dated from
-- when the call was sent.
SELECT orc_flow_spend_v1(%(key)s, %(job_id)s, %(units)s, %(sent_seconds_ago)s)

-- == Token accounting (migration 0030) ===========================================================

-- record_llm_usage --
-- One LLM call's usage (migration 0030), written as soon as the call returned, with the job's
-- tenant, agent and type. Written once per (job, call id): a try repeated after a lost
-- acknowledgement changes nothing. Not fenced by the lease: the tokens were spent whoever holds
-- the job now. Returns whether the row was written.
INSERT INTO orc_llm_usage (job_id, call_id, attempt, tenant_id, agent_id, job_type, model,
                           input_tokens, output_tokens, cache_read_tokens,
                           cache_creation_tokens)
VALUES (%(job_id)s, %(call_id)s, %(attempt)s, %(tenant_id)s, %(agent_id)s, %(job_type)s,
        %(model)s, %(input_tokens)s, %(output_tokens)s, %(cache_read_tokens)s,
        %(cache_creation_tokens)s)
ON CONFLICT (job_id, call_id) DO NOTHING
RETURNING id

-- set_token_budgets --
-- The token budgets of jobs just submitted (orchestrator.app: only submits that give one run
-- it), in the submit's transaction: a replaced job takes the new budget.
INSERT INTO orc_job_token_budgets (job_id, tokens)
SELECT b.job_id, b.tokens
  FROM unnest(%(job_ids)s::uuid[], %(tokens)s::bigint[]) AS b (job_id, tokens)
ON CONFLICT (job_id) DO UPDATE SET tokens = excluded.tokens

-- token_budget_state --
-- What a budget check reads before an LLM call: the job's own budget (null: none) and the tokens
-- its calls spent (orc_llm_usage's unique (job_id, call_id) index), and, when %(period)s is
-- given ('hour' or 'day'), the tokens the job's tenant spent since the start of the current
-- calendar period in UTC (an index-only range scan of orc_llm_usage_tenant_recorded_at).
SELECT (SELECT b.tokens FROM orc_job_token_budgets AS b WHERE b.job_id = %(job_id)s)
           AS job_budget,
       (SELECT coalesce(sum(u.input_tokens + u.output_tokens + u.cache_read_tokens
                            + u.cache_creation_tokens), 0)
          FROM orc_llm_usage AS u WHERE u.job_id = %(job_id)s)::bigint AS job_spent,
       CASE WHEN %(period)s::text IS NOT NULL THEN
           (SELECT coalesce(sum(u.input_tokens + u.output_tokens + u.cache_read_tokens
                                + u.cache_creation_tokens), 0)
              FROM orc_llm_usage AS u
             WHERE u.tenant_id = %(tenant_id)s
               AND u.recorded_at >= date_trunc(%(period)s, now(), 'UTC'))::bigint
       END AS tenant_spent,
       date_trunc(coalesce(%(period)s, 'day'), now(), 'UTC') AS period_start

-- llm_usage_totals --
-- Calls and tokens over [%(since)s, %(until)s) (either end open when null), grouped by the
-- columns whose by_ flag is set (the others are null in every row), largest first. `tenants`:
-- only theirs (an API principal's), null for any; usage of jobs without a tenant is seen only
-- by a principal of every tenant. A range is read from orc_llm_usage_recorded_at.
SELECT CASE WHEN %(by_job)s THEN u.job_id END AS job_id,
       CASE WHEN %(by_tenant)s THEN u.tenant_id END AS tenant_id,
       CASE WHEN %(by_agent)s THEN u.agent_id END AS agent_id,
       CASE WHEN %(by_model)s THEN u.model END AS model,
       CASE WHEN %(by_job_type)s THEN u.job_type END AS job_type,
       count(*) AS calls,
       sum(u.input_tokens)::bigint AS input_tokens,
       sum(u.output_tokens)::bigint AS output_tokens,
       sum(u.cache_read_tokens)::bigint AS cache_read_tokens,
       sum(u.cache_creation_tokens)::bigint AS cache_creation_tokens
  FROM orc_llm_usage AS u
 WHERE u.recorded_at >= coalesce(%(since)s::timestamptz, '-infinity')
   AND u.recorded_at < coalesce(%(until)s::timestamptz, 'infinity')
   AND (%(tenants)s::text[] IS NULL OR u.tenant_id = ANY (%(tenants)s))
   AND (%(tenant_id)s::text IS NULL OR u.tenant_id = %(tenant_id)s)
   AND (%(agent_id)s::text IS NULL OR u.agent_id = %(agent_id)s)
   AND (%(model)s::text IS NULL OR u.model = %(model)s)
   AND (%(job_type)s::text IS NULL OR u.job_type = %(job_type)s)
   AND (%(job_id)s::uuid IS NULL OR u.job_id = %(job_id)s)
 GROUP BY 1, 2, 3, 4, 5
 ORDER BY sum(u.input_tokens + u.output_tokens + u.cache_read_tokens
              + u.cache_creation_tokens) DESC, 1, 2, 3, 4, 5
 LIMIT %(limit)s

-- job_llm_usage --
-- A job's LLM calls in the order they were recorded, and its token budget (one row per call; a
-- job without calls gives one row of nulls but its budget).
SELECT b.tokens AS token_budget, u.call_id, u.attempt, u.model, u.input_tokens,
       u.output_tokens, u.cache_read_tokens, u.cache_creation_tokens, u.recorded_at
  FROM (SELECT %(job_id)s::uuid AS job_id) AS j
  LEFT JOIN orc_job_token_budgets AS b ON b.job_id = j.job_id
  LEFT JOIN orc_llm_usage AS u ON u.job_id = j.job_id
 ORDER BY u.id

-- fleet_llm_tokens --
-- Tokens recorded in the last %(window)s seconds by tenant ('' for none), model and kind, for the
-- fleet exporter (a range of orc_llm_usage_recorded_at).
SELECT coalesce(u.tenant_id, '') AS tenant, u.model,
       sum(u.input_tokens)::bigint AS input, sum(u.output_tokens)::bigint AS output,
       sum(u.cache_read_tokens)::bigint AS cache_read,
       sum(u.cache_creation_tokens)::bigint AS cache_creation
  FROM orc_llm_usage AS u
 WHERE u.recorded_at >= now() - make_interval(secs => %(window)s)
 GROUP BY 1, 2
