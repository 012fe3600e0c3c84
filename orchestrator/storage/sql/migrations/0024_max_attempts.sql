-- 0024_max_attempts: job.running carries the worker contract's `max_attempts` again.
--
-- compatible-with-older-workers: yes
--
-- Since the dispatch's run budget was named `max_runs` (0013), no event had `max_attempts`, and
-- a consumer of the worker contract (terminal iff `attempt >= max_attempts`) found it missing.
-- It now means the most attempts the job can reach from here if every try fails
-- (docs/contracts.md, "Attempts and runs"). The failure events and `last_error` are shaped in
-- Python (orchestrator.domain.events); job.running is shaped in the claim, with no Python in
-- between, so the claim's rule is stated here too: orc_max_attempts_v1 is
-- orchestrator.domain.policy.max_attempts at a claim, and a test holds the two equal.
--
-- job.running is shaped by a function of its own now, as job.created is. orc_claim_v1 keeps
-- its arguments and its rows (the previous release's workers call it): only its event grows.

CREATE FUNCTION orc_max_attempts_v1(
    p_attempt integer, p_run integer, p_max_runs integer, p_retry_count integer,
    p_max_retries integer
) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    -- this attempt, the runs left in its dispatch, a dispatch of runs per retry left
    SELECT p_attempt::bigint + greatest(0, p_max_runs - p_run)
           + greatest(0, p_max_retries - p_retry_count)::bigint * p_max_runs
$$;

CREATE FUNCTION orc_running_event_v1(j orc_jobs) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object(
        'attempt', j.attempt,
        'max_attempts', orc_max_attempts_v1(j.attempt, j.dispatch_attempt, j.max_attempts,
                                            j.retry_count, j.max_retries),
        'run', j.dispatch_attempt, 'max_runs', j.max_attempts, 'retry_count', j.retry_count,
        'max_retries', j.max_retries, 'worker', j.locked_by, 'run_id', j.lease_token)
$$;

CREATE OR REPLACE FUNCTION orc_claim_v1(
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
        SELECT c.id, 'job.running', orc_running_event_v1(c) FROM claimed AS c
    )
    SELECT c.id, c.job_type, c.payload, c.attempt, c.max_attempts, c.dispatch_attempt,
           c.retry_count, c.max_retries, c.lease_token, c.locked_by, c.queue, c.priority,
           c.timeout_seconds, c.trace_id, c.agent_id, c.tenant_id, c.started_at, c.traceparent,
           c.run_at
      FROM claimed AS c;
END;
$$;
