-- 0004_attempt_deadline: deadline_at becomes the attempt's own deadline (claim time + the job's
-- timeout, when the job timeout fires), no longer that plus 60 s. The backstop margin (the seed's
-- job_expiry: 60 s past the job timeout) is now a deployment setting applied by the heartbeat and
-- sweep queries (job_expiry_grace_seconds), so it can be tuned, and tested, without a migration.
-- Attempts claimed before this migration keep their deadline: their backstop comes 60 s later.

CREATE OR REPLACE FUNCTION orc_claim_v1(
    p_job_id uuid, p_procrastinate_job_id bigint, p_run integer, p_worker text,
    p_claimable text[], p_running text
) RETURNS TABLE (
    id uuid, job_type text, payload jsonb, attempt integer, max_attempts integer,
    dispatch_attempt integer, retry_count integer, max_retries integer, lease_token uuid,
    locked_by text, queue text, priority integer, timeout_seconds integer, trace_id text,
    agent_id text, started_at timestamptz
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
               jsonb_build_object('attempt', c.attempt, 'max_attempts', c.max_attempts,
                                  'run', c.dispatch_attempt, 'retry_count', c.retry_count,
                                  'max_retries', c.max_retries, 'worker', c.locked_by,
                                  'run_id', c.lease_token)
          FROM claimed AS c
    )
    SELECT c.id, c.job_type, c.payload, c.attempt, c.max_attempts, c.dispatch_attempt,
           c.retry_count, c.max_retries, c.lease_token, c.locked_by, c.queue, c.priority,
           c.timeout_seconds, c.trace_id, c.agent_id, c.started_at
      FROM claimed AS c;
END;
$$;
