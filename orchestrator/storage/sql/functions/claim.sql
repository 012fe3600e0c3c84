-- Fetch and claim: a worker's fetch takes Procrastinate dispatches and, in the same statement,
-- claims the job each one runs (RUNNING, attempt + 1, a new lease, job.running). A job is
-- RUNNING exactly while one of its dispatches is doing.
--
-- In use: orc_fetch_dispatches_v3 (the worker's fetch, a dispatch per free slot), through
-- orc_fetch_dispatch_v3 -> orc_take_dispatch_v1 (Procrastinate's fetch) -> the flow gate
-- (flow_admit.sql) -> orc_claim_v1; orc_claim_v2 (a claim the fetch left for later, and the replay's).

CREATE OR REPLACE FUNCTION orc_fetch_dispatches_v3(
    p_limit integer, p_queues character varying[], p_excluded character varying[],
    p_worker_id bigint, p_task_prefix text, p_worker text, p_claimable text[], p_running text
) RETURNS SETOF procrastinate_jobs
LANGUAGE plpgsql AS $$
DECLARE
    fetched procrastinate_jobs;
BEGIN
    FOR i IN 1 .. p_limit LOOP
        SELECT * INTO fetched
          FROM orc_fetch_dispatch_v3(p_queues, p_excluded, p_worker_id, p_task_prefix, p_worker,
                                     p_claimable, p_running);
        EXIT WHEN fetched.id IS NULL;
        RETURN NEXT fetched;
    END LOOP;
END;
$$;

-- One dispatch fetched (orc_take_dispatch_v1) and its job claimed through the flow gate: a
-- dispatch whose job is parked instead is deleted and the next one fetched in its place. A job
-- another transaction holds at that instant is not waited for: the dispatch comes back with
-- `claim_later`, and the worker claims it afterwards (orc_claim_v2). The gate is skipped for a
-- job with no key and a type without a limit.
-- A transaction waits for one flow key's lock at most, so that fetches meeting several keys in
-- different orders cannot deadlock: the first job under a limit that a fetch's transaction
-- meets goes through the gate, waiting for its key as it must; after it, a job of another key
-- goes through only if its key's lock is free at that instant (orc_flow_try_lock_v1), else it
-- comes back with `claim_later`, to be claimed in a statement of its own (as is a job that
-- has no key yet). The transaction-local setting orc.flow_key_locked says a gate was passed.
-- Past 100 parked in one call, the last one comes back without a claim (a stale dispatch),
-- so its worker fetches again at once rather than this statement running on.
CREATE OR REPLACE FUNCTION orc_fetch_dispatch_v3(
    p_queues character varying[], p_excluded character varying[], p_worker_id bigint,
    p_task_prefix text, p_worker text, p_claimable text[], p_running text
) RETURNS SETOF procrastinate_jobs
LANGUAGE plpgsql ROWS 1 AS $$
DECLARE
    fetched procrastinate_jobs;
    job uuid;
    j orc_jobs;
    gated boolean;
    claim jsonb;
BEGIN
    FOR parked IN 0 .. 100 LOOP
        fetched := orc_take_dispatch_v1(p_queues, p_excluded, p_worker_id);
        IF fetched.id IS NULL OR NOT starts_with(fetched.task_name, p_task_prefix) THEN
            RETURN NEXT fetched;
            RETURN;
        END IF;
        job := (fetched.args ->> 'job_id')::uuid;
        SELECT * INTO j FROM orc_jobs AS o WHERE o.id = job FOR NO KEY UPDATE SKIP LOCKED;
        IF NOT FOUND AND EXISTS (SELECT FROM orc_jobs AS o WHERE o.id = job) THEN
            fetched.args := fetched.args || '{"claim": null, "claim_later": true}';
            RETURN NEXT fetched;
            RETURN;
        END IF;
        gated := j.flow_key IS NOT NULL
                 OR EXISTS (SELECT FROM orc_flow_job_types AS t WHERE t.job_type = j.job_type);
        IF gated AND current_setting('orc.flow_key_locked', true) = 'yes'
           AND (j.flow_key IS NULL OR NOT orc_flow_try_lock_v1(j.flow_key)) THEN
            fetched.args := fetched.args || '{"claim": null, "claim_later": true}';
            RETURN NEXT fetched;
            RETURN;
        ELSIF gated THEN
            PERFORM set_config('orc.flow_key_locked', 'yes', true);
        END IF;
        IF NOT gated OR NOT orc_flow_gate_v1(job, fetched.id, p_claimable, p_task_prefix) THEN
            SELECT to_jsonb(c) INTO claim
              FROM orc_claim_v1(job, fetched.id, fetched.attempts + 1,
                                p_worker || '/w' || p_worker_id, p_claimable, p_running) AS c;
            IF gated THEN  -- the gate may have given the job its key
                claim := claim || jsonb_build_object(
                    'flow_key', (SELECT o.flow_key FROM orc_jobs AS o WHERE o.id = job));
            END IF;
            fetched.args := fetched.args || jsonb_build_object('claim', claim);
            RETURN NEXT fetched;
            RETURN;
        END IF;
    END LOOP;
    fetched.args := fetched.args || '{"claim": null}';  -- parked, and gone: the worker ends it
    RETURN NEXT fetched;
END;
$$;

-- Procrastinate's fetch (procrastinate_fetch_job_v2: the first waiting dispatch, by priority
-- then id, that is due, on one of `p_queues` (all when null), and that no other dispatch of its
-- lock holds back: one doing, or one waiting ahead of it), leaving the `p_excluded` queues
-- alone (those of external job types). Its own statement rather than Procrastinate's function,
-- for the plan: Procrastinate's is planned again on every call (its `queues IS NULL OR` makes
-- a custom plan look cheaper than the generic one, so plpgsql never settles), which cost more
-- than running it (a soak: 0.79 ms planning, 0.41 ms running, for 59,898 of 60,058 calls), and
-- each new plan follows the queue's statistics, which are always stale (a queue's waiting rows
-- come and go between two ANALYZEs): estimating a handful of waiting rows, it read every one
-- and sorted them, or read its lock's index whole per candidate. Here the plan is generic,
-- made once per connection, and the only one the planner may make: the walk down
-- procrastinate_jobs_priority_idx_v1 from its head, each candidate's lock looked up in
-- orc_procrastinate_jobs_live_lock, stopping at the first dispatch it may take
-- (tests/test_plans.py: the plan settled on, and stale statistics planted).
-- Never JIT-compiled: the generic plan, knowing nothing of LIMIT 1's early stop, is costed as a
-- walk of the whole queue, which crosses jit_above_cost once some 10,000 dispatches wait, and
-- compiling it took 7-10 ms of every fetch (PostgreSQL 15 with LLVM: a 20,000-job drain at 85
-- jobs/s, against 1,515 at 5,000).
CREATE OR REPLACE FUNCTION orc_take_dispatch_v1(
    p_queues character varying[], p_excluded character varying[], p_worker_id bigint
) RETURNS procrastinate_jobs
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_memoize = off
SET jit = off
AS $$
DECLARE
    fetched procrastinate_jobs;
BEGIN
    WITH candidate AS (
        SELECT jobs.id
          FROM procrastinate_jobs AS jobs
         WHERE jobs.status = 'todo'
           AND (p_queues IS NULL OR jobs.queue_name = ANY (p_queues))
           AND jobs.queue_name <> ALL (coalesce(p_excluded, '{}'))
           AND (jobs.scheduled_at IS NULL OR jobs.scheduled_at <= now())
           AND (jobs.lock IS NULL OR NOT EXISTS (
                   SELECT
                     FROM procrastinate_jobs AS other
                    WHERE other.lock = jobs.lock
                      AND other.status IN ('todo', 'doing')
                      AND (other.status = 'doing'
                           OR other.priority > jobs.priority
                           OR (other.priority = jobs.priority AND other.id < jobs.id))))
         ORDER BY jobs.priority DESC, jobs.id ASC
         LIMIT 1
           FOR UPDATE OF jobs SKIP LOCKED
    )
    UPDATE procrastinate_jobs
       SET status = 'doing', worker_id = p_worker_id
      FROM candidate
     WHERE procrastinate_jobs.id = candidate.id
    RETURNING procrastinate_jobs.* INTO fetched;
    RETURN fetched;
END;
$$;

-- orc_claim_v1 through the gate, naming the job's key: no row when the job was parked (or the
-- dispatch is stale).
CREATE OR REPLACE FUNCTION orc_claim_v2(
    p_job_id uuid, p_procrastinate_job_id bigint, p_run integer, p_worker text,
    p_claimable text[], p_running text, p_task_prefix text
) RETURNS TABLE (
    id uuid, job_type text, payload jsonb, attempt integer, max_attempts integer,
    dispatch_attempt integer, retry_count integer, max_retries integer, lease_token uuid,
    locked_by text, queue text, priority integer, timeout_seconds integer, trace_id text,
    agent_id text, tenant_id text, started_at timestamptz, traceparent text, run_at timestamptz,
    most_attempts bigint, has_dependants boolean, flow_key text
)
LANGUAGE plpgsql ROWS 1 AS $$
BEGIN
    PERFORM FROM orc_jobs AS o WHERE o.id = p_job_id FOR NO KEY UPDATE;
    IF orc_flow_gate_v1(p_job_id, p_procrastinate_job_id, p_claimable, p_task_prefix) THEN
        RETURN;
    END IF;
    RETURN QUERY
    SELECT c.*, (SELECT o.flow_key FROM orc_jobs AS o WHERE o.id = c.id)
      FROM orc_claim_v1(p_job_id, p_procrastinate_job_id, p_run, p_worker, p_claimable,
                        p_running) AS c;
END;
$$;

-- The atomic claim, for one run of the job's current Procrastinate job: attempt + 1, a
-- new lease, a heartbeat, and a job.running event. A duplicate or stale dispatch (another
-- Procrastinate job, or a job that is not claimable) claims nothing. The same Procrastinate job
-- may re-claim a RUNNING job on a later run: its earlier run ended without recording an outcome.
-- has_dependants: jobs wait for it, so its end may release them and its worker fetches after
-- that end is written (docs/workflows.md), whichever way the claim was made.
CREATE OR REPLACE FUNCTION orc_claim_v1(
    p_job_id uuid, p_procrastinate_job_id bigint, p_run integer, p_worker text,
    p_claimable text[], p_running text
) RETURNS TABLE (
    id uuid, job_type text, payload jsonb, attempt integer, max_attempts integer,
    dispatch_attempt integer, retry_count integer, max_retries integer, lease_token uuid,
    locked_by text, queue text, priority integer, timeout_seconds integer, trace_id text,
    agent_id text, tenant_id text, started_at timestamptz, traceparent text, run_at timestamptz,
    most_attempts bigint, has_dependants boolean
)
-- plpgsql rather than sql: its plans are cached per session (before PostgreSQL 18, a sql
-- function with a data-modifying WITH is planned again on every call).
LANGUAGE plpgsql ROWS 1 AS $$
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
           c.run_at, orc_max_attempts_v1(c.attempt, c.dispatch_attempt, c.max_attempts,
                                         c.retry_count, c.max_retries),
           c.has_dependants
      FROM claimed AS c;
END;
$$;

-- The worker contract's max_attempts, the most attempts the job can still make in all
-- (docs/contracts.md, "Attempts and runs"), at the claim of an attempt: its one production home
-- (the claim's row and job.running, and through orc_max_attempts_after_v1 every failure).
-- tests/test_max_attempts.py holds it (and orc_max_attempts_after_v1) to its Python model by a
-- property test.
CREATE OR REPLACE FUNCTION orc_max_attempts_v1(
    p_attempt integer, p_run integer, p_max_runs integer, p_retry_count integer,
    p_max_retries integer
) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    -- this attempt, the runs left in its dispatch, a dispatch of runs per retry left
    SELECT p_attempt::bigint + greatest(0, p_max_runs - p_run)
           + greatest(0, p_max_retries - p_retry_count)::bigint * p_max_runs
$$;

-- max_attempts after a failure of attempt p_attempt, with the counters the failure found
-- (p_run of p_max_runs, p_retry_count of p_max_retries): retried at p_layer, the claim it leads
-- to ('infra': the same dispatch's next run; 'app': a new dispatch, one retry used; 'pause': a
-- new dispatch, none used); ended (p_layer null), the attempt itself. Any other layer: an error.
CREATE OR REPLACE FUNCTION orc_max_attempts_after_v1(
    p_attempt integer, p_run integer, p_max_runs integer, p_retry_count integer,
    p_max_retries integer, p_layer text
) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    CASE p_layer
        WHEN 'infra' THEN
            RETURN orc_max_attempts_v1(p_attempt + 1, p_run + 1, p_max_runs, p_retry_count,
                                       p_max_retries);
        WHEN 'app' THEN
            RETURN orc_max_attempts_v1(p_attempt + 1, 1, p_max_runs, p_retry_count + 1,
                                       p_max_retries);
        WHEN 'pause' THEN
            RETURN orc_max_attempts_v1(p_attempt + 1, 1, p_max_runs, p_retry_count,
                                       p_max_retries);
        ELSE
            IF p_layer IS NULL THEN
                RETURN p_attempt;
            END IF;
            RAISE EXCEPTION 'orc_max_attempts_after_v1: no retry layer % (infra, app or pause)',
                p_layer;
    END CASE;
END;
$$;
