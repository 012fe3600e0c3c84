-- fetch_dispatches --
-- The worker's fetch: Procrastinate's (leaving the `excluded` queues alone: external job
-- types'), plus the claim of our job, for up to `limit` dispatches
-- (see orc_fetch_dispatches_v3 in sql/functions/claim.sql: a job whose key has no room is parked, not
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
-- Success, for several attempts at once ([{ord, job_id, lease_token, result, attempt, run,
-- worker, duration_ms, procrastinate_job_id, delete_dispatch}]; see orc_complete_jobs_v1): each job COMPLETED with
-- its result, lease released, job.completed recorded, and its dispatch finished (succeeded) in
-- the same transaction. One row per item: whether its job was COMPLETED.
SELECT ord, completed FROM orc_complete_jobs_v1(%(items)s, %(target)s, %(sources)s)

-- complete_and_fetch --
-- A job others wait for completed (one item, as complete_jobs), and a fetch of one dispatch for
-- the slot its worker frees (as fetch_dispatches), in one statement: the fetch's limit reads
-- the completion's row, so it runs after the completion and sees the jobs that end released (a
-- chain's next link), claimed with no wake-up and one commit. One row: whether the job was
-- COMPLETED, and the fetched dispatch's columns (null: nothing was due).
SELECT c.completed, f.id, f.status, f.task_name, f.priority, f.lock, f.queueing_lock, f.args,
       f.scheduled_at, f.queue_name, f.attempts, f.worker_id
  FROM orc_complete_jobs_v1(%(items)s, %(target)s, %(sources)s) AS c
  LEFT JOIN LATERAL orc_fetch_dispatches_v3(
           CASE WHEN c.completed IS NULL THEN 0 ELSE %(limit)s END, %(queues)s::varchar[],
           %(excluded)s::varchar[], %(worker_id)s, %(task_prefix)s, %(worker)s, %(claimable)s,
           %(running)s) AS f ON true

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
-- A transient failure with budget left: RETRY, due again delay_seconds from now by the
-- database's clock (no worker's clock decides it: docs/contracts.md, "Times"), lease released;
-- that time is written in last_error's next_available_at and job.retry_scheduled's
-- available_at too, and the three get max_attempts, that of the claim the retry at %(layer)s
-- leads to (orc_max_attempts_after_v1). The app layer counts a retry and gives the job a new dispatch
-- (dispatch_jobs, same transaction); the infra layer leaves both to Procrastinate, which
-- re-runs the same dispatch then (retry_dispatch, given the row's next_retry_at).
WITH due AS (
    SELECT at, to_jsonb(to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'))
               AS stamp
      FROM (SELECT clock_timestamp() + make_interval(secs => %(delay_seconds)s) AS at) AS t
), retrying AS (
    UPDATE orc_jobs
       SET status = %(target)s,
           retry_count = retry_count + %(retry_increment)s,
           next_retry_at = due.at,
           last_error = jsonb_set(%(error)s::jsonb, '{next_available_at}', due.stamp)
               || jsonb_build_object('max_attempts', orc_max_attempts_after_v1(
                      attempt, dispatch_attempt, max_attempts, retry_count, max_retries,
                      %(layer)s)),
           lease_token = NULL, locked_by = NULL, heartbeat_at = NULL
      FROM due
     WHERE id = %(job_id)s AND lease_token = %(lease_token)s AND status = ANY (%(sources)s)
    RETURNING id, retry_count, next_retry_at, due.stamp,
              jsonb_build_object('max_attempts', last_error -> 'max_attempts') AS cap
), events AS (
    -- job.failed reports the counters at the failure; job.retry_scheduled those after it.
    INSERT INTO orc_job_events (job_id, kind, payload)
    SELECT r.id, e.kind, e.payload || r.cap
      FROM retrying AS r,
           LATERAL (VALUES (1, 'job.failed', %(failed_event)s::jsonb),
                           (2, 'job.retry_scheduled',
                            jsonb_set(%(retry_event)s::jsonb, '{available_at}', r.stamp)))
               AS e (n, kind, payload)
     ORDER BY e.n
)
SELECT id, next_retry_at, pg_notify('orc_wakeup', extract(epoch FROM next_retry_at)::text)
  FROM retrying

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

-- park_job --
-- A running job whose next call would wait long for its flow key's room gives its slot back:
-- PENDING, no budget used, a waiter of its key, sent for its earliest time when it has one
-- (orc_flow_park_v2, fenced by its lease).
SELECT orc_flow_park_v2(%(job_id)s, %(lease_token)s, %(sources)s, %(cost)s, %(blocked)s,
                        %(release)s, %(not_before)s) AS parked

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

-- flow_throttled --
-- The provider behind a key answered 429 or 529: paused for the hint's seconds from now (the
-- database's clock), or its rate halved.
SELECT orc_flow_throttled_v2(%(key)s, %(seconds)s, %(reason)s)
