-- soonest_due --
-- For the worker's wake-up timer: seconds until the next waiting job is due (null: none),
-- whether one came due in the last %(lookback)s seconds (the worker may not have seen it), and
-- the database's clock (what the due times announced on orc_wakeup are read against). A
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
       coalesce(bool_or(at <= now()), false) AS overdue,
       extract(epoch FROM now()) AS now
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

-- ping --
-- The liveness probe's question (LivenessStore.ping), and the listener's on a quiet connection
-- (runtime/wakeups.py, interfaces/watch.py): is the database there?
SELECT 1 AS ok

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
-- once never share a job. swept_at: the database's now, which the sweep's decisions (a deadline
-- overrun, the retry's time) are measured from, never the sweeper's clock.
SELECT id, job_type, tenant_id, payload, lease_token, heartbeat_at, deadline_at, attempt,
       max_attempts, dispatch_attempt, retry_count, max_retries, procrastinate_job_id, locked_by,
       now() AS swept_at
  FROM orc_jobs
 WHERE status = 'RUNNING'  -- orc_jobs_running_heartbeat's predicate (see soonest_due)
   AND heartbeat_at < now() - make_interval(secs => %(threshold)s)
   AND id <> ALL (%(passed_over)s::uuid[])
 ORDER BY heartbeat_at
 LIMIT %(limit)s
   FOR UPDATE SKIP LOCKED

-- lock_flow_keys_of --
-- The flow keys the jobs' writes may pump, locked in one order (orc_flow_lock_keys_of_v1), once
-- the jobs are locked and before any is written.
SELECT orc_flow_lock_keys_of_v1(%(job_ids)s::uuid[])

-- sweep_to_retry --
-- Zombies with budget left ([{id, lease_token, delay_seconds, error, zombie, retry}]): RETRY,
-- retry_count + 1, due again delay_seconds from now by the database's clock (written in
-- last_error's next_available_at and job.retry_scheduled's available_at too), with
-- job.zombie_detected and job.retry_scheduled (attempt bumped at the next claim), last_error and
-- job.retry_scheduled with the max_attempts of an application retry (orc_max_attempts_after_v1); dispatch_jobs
-- gives them new dispatches in the same transaction.
WITH d AS (
    SELECT d.*, due.at,
           to_jsonb(to_char(due.at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'))
               AS stamp
      FROM jsonb_to_recordset(%(decisions)s)
           AS d (id uuid, lease_token uuid, delay_seconds float8, error jsonb, zombie jsonb,
                 retry jsonb),
           LATERAL (SELECT now() + make_interval(secs => d.delay_seconds) AS at) AS due
), moved AS (
    UPDATE orc_jobs AS j
       SET status = %(target)s, retry_count = j.retry_count + 1,
           next_retry_at = d.at,
           last_error = jsonb_set(d.error, '{next_available_at}', d.stamp)
               || jsonb_build_object('max_attempts', orc_max_attempts_after_v1(
                      j.attempt, j.dispatch_attempt, j.max_attempts, j.retry_count,
                      j.max_retries, 'app')),
           lease_token = NULL, locked_by = NULL, heartbeat_at = NULL
      FROM d
     WHERE j.id = d.id AND j.lease_token = d.lease_token AND j.status = ANY (%(sources)s)
    RETURNING j.id, j.last_error -> 'max_attempts' AS cap
), events AS (
    INSERT INTO orc_job_events (job_id, kind, payload)
    SELECT m.id, e.kind, e.payload
      FROM moved AS m JOIN d ON d.id = m.id,
           LATERAL (VALUES (1, 'job.zombie_detected', d.zombie),
                           (2, 'job.retry_scheduled',
                            jsonb_set(d.retry, '{available_at}', d.stamp)
                                || jsonb_build_object('max_attempts', m.cap)))
               AS e (n, kind, payload)
     ORDER BY m.id, e.n
)
SELECT id FROM moved

-- settle_procrastinate_jobs --
-- Close the Procrastinate jobs a dead worker left in `doing` (Procrastinate never does: its
-- stalled jobs stay there), so they free their locks and nothing lingers.
SELECT procrastinate_finish_job_v1(p.id, 'failed', false)
  FROM unnest(%(procrastinate_job_ids)s::bigint[]) AS x (id)
  JOIN procrastinate_jobs AS p ON p.id = x.id AND p.status = 'doing'
