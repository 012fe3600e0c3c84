-- 0018_claim_reports_run_at: the claim returns the job's run_at (when it was first due: its
-- submit, or the time it was submitted for), so a worker can measure how long a job waited in
-- the queue before its first attempt (orchestrator_queue_wait_seconds) also when its dispatch
-- was due at once (no scheduled_at). The function is otherwise as in 0017; its row type grows a
-- column, so it is made anew (orc_fetch_dispatch_v1 and the claim_dispatch query read its rows
-- whole, and carry the new column as they are).

DROP FUNCTION orc_claim_v1(uuid, bigint, integer, text, text[], text);
CREATE FUNCTION orc_claim_v1(
    p_job_id uuid, p_procrastinate_job_id bigint, p_run integer, p_worker text,
    p_claimable text[], p_running text
) RETURNS TABLE (
    id uuid, job_type text, payload jsonb, attempt integer, max_attempts integer,
    dispatch_attempt integer, retry_count integer, max_retries integer, lease_token uuid,
    locked_by text, queue text, priority integer, timeout_seconds integer, trace_id text,
    agent_id text, tenant_id text, started_at timestamptz, traceparent text, run_at timestamptz
)
-- plpgsql rather than sql: its plans are cached per session (before PostgreSQL 18, a sql
-- function with a data-modifying WITH is planned again on every call).
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
    WITH claimed AS (
        UPDATE orc_jobs AS j
           SET status = p_running,
               attempt = j.attempt + 1,
               dispatch_attempt = p_run,
               lease_token = gen_random_uuid(),
               locked_by = p_worker,
               heartbeat_at = now(),
               deadline_at = now() + make_interval(secs => coalesce(j.timeout_seconds, 3600)),
               started_at = coalesce(j.started_at, now()),
               next_retry_at = NULL
         WHERE j.id = p_job_id
           AND j.procrastinate_job_id = p_procrastinate_job_id
           AND (j.status = ANY (p_claimable)
                OR (j.status = p_running AND j.dispatch_attempt < p_run))
        RETURNING j.*
    ), event AS (
        INSERT INTO orc_job_events (job_id, kind, payload)
        SELECT c.id, 'job.running',
               jsonb_build_object('attempt', c.attempt, 'run', c.dispatch_attempt,
                                  'max_runs', c.max_attempts, 'retry_count', c.retry_count,
                                  'max_retries', c.max_retries, 'worker', c.locked_by,
                                  'run_id', c.lease_token)
          FROM claimed AS c
    )
    SELECT c.id, c.job_type, c.payload, c.attempt, c.max_attempts, c.dispatch_attempt,
           c.retry_count, c.max_retries, c.lease_token, c.locked_by, c.queue, c.priority,
           c.timeout_seconds, c.trace_id, c.agent_id, c.tenant_id, c.started_at, c.traceparent,
           c.run_at
      FROM claimed AS c;
END;
$$;
