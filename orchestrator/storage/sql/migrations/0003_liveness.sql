-- 0003_liveness: heartbeats, the zombie sweep's index, and each attempt's deadline.
--
-- A claim stamps the attempt's deadline (claim time + the job's timeout + 60 s, the seed's
-- job_expiry). Heartbeats never move heartbeat_at past deadline_at minus the zombie threshold,
-- so an attempt that overruns its deadline goes stale even while something keeps heartbeating
-- it, and the sweep needs one index: heartbeat_at of RUNNING jobs.

ALTER TABLE orc_jobs ADD COLUMN deadline_at timestamptz;

CREATE INDEX orc_jobs_running_heartbeat ON orc_jobs (heartbeat_at) WHERE status = 'RUNNING';

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
               deadline_at = now() + make_interval(secs => coalesce(j.timeout_seconds, 3600) + 60),
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
