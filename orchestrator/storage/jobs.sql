-- submit_jobs --
-- Insert jobs and their first dispatches in one round trip (see orc_submit_jobs_v2).
SELECT ord, job_id, outcome
  FROM orc_submit_jobs_v2(%(specs)s, %(initial_status)s, %(waiting)s, %(task_prefix)s)

-- render_flow_key --
-- The flow key a submit of this row would store (orc_flow_key_v1, as orc_job_specs_v1 renders
-- it), or its refusal; nothing written.
SELECT orc_flow_key_v1(%(flow_template)s, %(job_type)s, %(tenant_id)s, %(agent_id)s,
                       %(payload)s) AS key

-- dispatch_jobs --
-- Give jobs a new Procrastinate job each, at their next_retry_at or run_at.
SELECT orc_dispatch_v1(%(job_ids)s::uuid[], %(task_prefix)s) AS dispatched

-- fail_jobs --
-- Terminal failures, every path's ([{ord, job_id, lease_token, dead_letter_id, error, failed,
-- before, degraded, dispatch_id, dispatch_status}], shaped by orchestrator/domain/failures.py):
-- each job FAILED with its dead letter and events, and the dispatch that ran it ended, in the
-- dead-letter flow's order (see orc_fail_jobs_v1). One row per item: the dead letter's id, or
-- null where the job was not failed.
SELECT ord, dead_letter_id FROM orc_fail_jobs_v1(%(items)s, %(target)s, %(sources)s)

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
    SELECT id, 'job.cancelled', orc_cancelled_event_v1(%(reason)s, %(by)s) FROM cancelled
)
SELECT id, procrastinate_cancel_job_v1(procrastinate_job_id, true, false) AS procrastinate_job
  FROM cancelled

-- job_state --
-- Why did a write match nothing? The job's current status and lease, if it exists.
SELECT status, lease_token FROM orc_jobs WHERE id = %(job_id)s

-- get_job --
-- With what it waits for, when it waits for capacity (docs/flow-control.md) or for other jobs
-- (docs/workflows.md).
SELECT j.*, w.blocked_on AS flow_blocked_on, k.paused_until AS flow_paused_until,
       jw.unsettled AS waits_for_jobs
  FROM orc_jobs AS j
  LEFT JOIN orc_flow_waiters AS w ON w.job_id = j.id
  LEFT JOIN orc_flow_keys AS k ON k.key = w.key
  LEFT JOIN orc_job_waits AS jw ON jw.job_id = j.id
 WHERE j.id = %(job_id)s

-- job_events --
SELECT id, job_id, kind, at, payload FROM orc_job_events WHERE job_id = %(job_id)s ORDER BY id

-- record_events --
-- Append events (a JSON array of {job_id, kind, payload}) in order.
INSERT INTO orc_job_events (job_id, kind, payload)
SELECT (e.event ->> 'job_id')::uuid, e.event ->> 'kind', e.event -> 'payload'
  FROM jsonb_array_elements(%(events)s) WITH ORDINALITY AS e (event, n)
 ORDER BY e.n

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

-- job_steps --
-- A job's checkpoints and side effects, for `orchestrator status`, the job's page and the demo:
-- step by step, each step's side effects in the order they began (`at`), then its checkpoint
-- (which commits them: its time is not theirs to be sorted among).
SELECT kind, step, invocation_id, name, status, detail, attempt, at FROM (
    SELECT 'checkpoint' AS kind, step, NULL AS invocation_id, NULL AS name, NULL AS status,
           state AS detail, attempt, created_at AS at
      FROM orc_checkpoints WHERE job_id = %(job_id)s
    UNION ALL
    SELECT 'side_effect', step, invocation_id, name, status,
           jsonb_build_object('args', args, 'result', result, 'error', error,
                              'reconciled', reconciled),
           attempt, created_at
      FROM orc_side_effects WHERE job_id = %(job_id)s
) AS steps
 ORDER BY step, kind = 'checkpoint', at, invocation_id

-- cancel_job_approvals --
-- A cancelled job's open approval is closed with it.
UPDATE orc_approvals
   SET status = 'cancelled', decided_at = now(), decided_by = %(by)s, reason = %(reason)s
 WHERE job_id = %(job_id)s AND status = 'pending'

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

-- held_lease --
-- The job an external worker reports on, if its attempt still holds the lease: RUNNING, this
-- attempt, this lease token. (The report's own write is fenced by the lease again: a sweep
-- between this read and that write makes the write match nothing.)
SELECT *,
       orc_max_attempts_v1(attempt, dispatch_attempt, max_attempts, retry_count, max_retries)
           AS most_attempts,
       -- since the claim (which set deadline_at to its time plus the job timeout)
       1000 * extract(epoch FROM now() - deadline_at
                                 + make_interval(secs => coalesce(timeout_seconds, 3600)))
           AS running_ms
  FROM orc_jobs
 WHERE id = %(job_id)s AND lease_token = %(lease_token)s AND attempt = %(attempt)s
   AND status = %(running)s
