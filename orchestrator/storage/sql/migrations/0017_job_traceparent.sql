-- 0017_job_traceparent: a job keeps the trace context it was submitted in, and its attempts'
-- spans continue it (docs/operations.md, "Traces").
--
-- `traceparent` is a W3C trace context (`00-<trace id>-<span id>-<flags>`): the submit's own
-- span when tracing was on at submit, else the traceparent the caller gave, else null. The claim
-- returns it, so an attempt's span is a child of the submit's span, in the job's trace, across
-- processes and retries. The submit functions store it from the spec (a new field of
-- orc_job_spec_v1); a replaced or deduplicated job keeps its own, as it keeps its trace_id.
-- The functions are otherwise as in 0016 (orc_submit_jobs_v1, orc_submit_jobs_v2,
-- orc_claim_v1); the claim's row type grows a column, so it is made anew (orc_fetch_dispatch_v1
-- and the claim_dispatch query read its rows whole, and carry the new column as they are).

ALTER TABLE orc_jobs ADD COLUMN traceparent text;

ALTER TYPE orc_job_spec_v1 ADD ATTRIBUTE traceparent text;

CREATE OR REPLACE FUNCTION orc_submit_jobs_v2(
    p_specs jsonb, p_initial_status text, p_waiting text[], p_task_prefix text
) RETURNS TABLE (ord integer, job_id uuid, outcome text)
LANGUAGE plpgsql AS $$
BEGIN
    IF jsonb_path_exists(p_specs, '$[*] ? (@.job_key != null)') THEN
        RETURN QUERY SELECT * FROM orc_submit_jobs_v1(p_specs, p_initial_status, p_waiting,
                                                      p_task_prefix);
        RETURN;
    END IF;

    RETURN QUERY
    WITH spec AS (
        SELECT s.* FROM jsonb_populate_recordset(NULL::orc_job_spec_v1, p_specs) AS s
    ), dispatch AS (
        INSERT INTO procrastinate_jobs (queue_name, task_name, priority, lock, args, scheduled_at)
        SELECT s.queue, p_task_prefix || s.job_type, -s.priority, s.id::text,
               jsonb_build_object('job_id', s.id), CASE WHEN s.run_at > now() THEN s.run_at END
          FROM spec AS s
         ORDER BY s.ord
        RETURNING procrastinate_jobs.id, procrastinate_jobs.lock
    ), job AS (
        INSERT INTO orc_jobs (id, job_type, status, payload, queue, priority, run_at,
                              max_attempts, max_retries, agent_id, trace_id, timeout_seconds,
                              replay_of, tenant_id, procrastinate_job_id, traceparent)
        SELECT s.id, s.job_type, p_initial_status, coalesce(s.payload, 'null'), s.queue,
               s.priority, coalesce(s.run_at, now()), s.max_attempts, s.max_retries, s.agent_id,
               s.trace_id, s.timeout_seconds, s.replay_of, s.tenant_id, d.id, s.traceparent
          FROM spec AS s JOIN dispatch AS d ON d.lock = s.id::text
        RETURNING *
    ), created AS (
        INSERT INTO orc_job_events (job_id, kind, payload)
        SELECT j.id, 'job.created', orc_created_event_v1(j) FROM job AS j
    )
    SELECT s.ord, s.id, 'created'::text FROM spec AS s;

    -- Workers waiting for a future time are told, as orc_submit_jobs_v1 tells them.
    IF jsonb_path_exists(p_specs, '$[*] ? (@.run_at != null)') THEN
        PERFORM pg_notify('orc_wakeup', extract(epoch FROM min(s.run_at))::text)
           FROM jsonb_populate_recordset(NULL::orc_job_spec_v1, p_specs) AS s
          WHERE s.run_at > now()
         HAVING count(*) > 0;
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION orc_submit_jobs_v1(
    p_specs jsonb, p_initial_status text, p_waiting text[], p_task_prefix text
) RETURNS TABLE (ord integer, job_id uuid, outcome text)
LANGUAGE plpgsql AS $$
DECLARE
    specs orc_job_spec_v1[] := ARRAY(
        SELECT s FROM jsonb_populate_recordset(NULL::orc_job_spec_v1, p_specs) AS s);
    spec orc_job_spec_v1;
    existing orc_jobs;
    deferred bigint[];
    fresh uuid[] := '{}';  -- keyed rows that need a dispatch: created and replaced ones
    new_id uuid;
BEGIN
    -- Serialise submits of one key, so two of them cannot both create a job: every key's lock
    -- is taken first, in the order of the lock ids, so two batches naming the same keys in
    -- other orders take turns rather than deadlock.
    PERFORM pg_advisory_xact_lock(k.lock_id)
       FROM (SELECT DISTINCT hashtextextended('orc_job_key:' || s.job_key, 0) AS lock_id
               FROM unnest(specs) AS s
              WHERE s.job_key IS NOT NULL
              ORDER BY 1) AS k;
    -- Jobs without a key, set-based: their dispatches first, then the rows that point at them
    -- (matched by the dispatch's lock, which is the job id), so each row is written once.
    deferred := procrastinate_defer_jobs_v1(ARRAY(
        SELECT ROW(s.queue, p_task_prefix || s.job_type, -s.priority, s.id::text, NULL,
                   jsonb_build_object('job_id', s.id),
                   CASE WHEN s.run_at > now() THEN s.run_at END)::procrastinate_job_to_defer_v1
          FROM unnest(specs) AS s
         WHERE s.job_key IS NULL
         ORDER BY s.ord));
    WITH inserted AS (
        INSERT INTO orc_jobs (id, job_type, status, payload, queue, priority, run_at,
                              max_attempts, max_retries, agent_id, trace_id, timeout_seconds,
                              replay_of, tenant_id, procrastinate_job_id, traceparent)
        SELECT s.id, s.job_type, p_initial_status, coalesce(s.payload, 'null'), s.queue,
               s.priority, coalesce(s.run_at, now()), s.max_attempts, s.max_retries, s.agent_id,
               s.trace_id, s.timeout_seconds, s.replay_of, s.tenant_id, p.id, s.traceparent
          FROM unnest(specs) AS s
          JOIN procrastinate_jobs AS p  -- a lookup in orc_procrastinate_jobs_live_lock
            ON p.lock = s.id::text AND p.status = 'todo' AND p.id = ANY (deferred)
         WHERE s.job_key IS NULL
        RETURNING *
    )
    INSERT INTO orc_job_events (job_id, kind, payload)
    SELECT i.id, 'job.created', orc_created_event_v1(i) FROM inserted AS i;

    RETURN QUERY SELECT s.ord, s.id, 'created'::text FROM unnest(specs) AS s
                  WHERE s.job_key IS NULL;

    FOR spec IN SELECT * FROM unnest(specs) AS s WHERE s.job_key IS NOT NULL ORDER BY s.ord
    LOOP
        SELECT * INTO existing FROM orc_jobs AS j
         WHERE j.job_key = spec.job_key AND j.finished_at IS NULL
           FOR UPDATE;

        IF FOUND AND spec.job_key_mode = 'unsafe_dedupe' THEN
            UPDATE orc_jobs AS j SET revision = j.revision + 1 WHERE j.id = existing.id;
            ord := spec.ord; job_id := existing.id; outcome := 'deduplicated';
            RETURN NEXT;
            CONTINUE;
        END IF;

        IF FOUND AND existing.status = ANY (p_waiting) THEN
            UPDATE orc_jobs AS j
               SET payload = coalesce(spec.payload, 'null'),
                   queue = spec.queue,
                   priority = spec.priority,
                   max_attempts = spec.max_attempts,
                   max_retries = spec.max_retries,
                   agent_id = spec.agent_id,
                   tenant_id = spec.tenant_id,
                   timeout_seconds = spec.timeout_seconds,
                   run_at = CASE WHEN spec.job_key_mode = 'preserve_run_at' THEN j.run_at
                                 ELSE coalesce(spec.run_at, now()) END,
                   next_retry_at = CASE
                       WHEN j.next_retry_at IS NULL OR spec.job_key_mode = 'preserve_run_at'
                       THEN j.next_retry_at
                       ELSE coalesce(spec.run_at, now()) END,
                   revision = j.revision + 1
             WHERE j.id = existing.id;
            -- The waiting dispatch is replaced; one already fetched finds itself stale.
            PERFORM procrastinate_cancel_job_v1(existing.procrastinate_job_id, false, true)
               WHERE existing.procrastinate_job_id IS NOT NULL;
            INSERT INTO orc_job_events (job_id, kind, payload)
            VALUES (existing.id, 'job.replaced',
                    jsonb_build_object('job_key', spec.job_key, 'mode', spec.job_key_mode,
                                       'revision', existing.revision + 1,
                                       'tenant_id', spec.tenant_id));
            fresh := fresh || existing.id;
            ord := spec.ord; job_id := existing.id; outcome := 'replaced';
            RETURN NEXT;
            CONTINUE;
        END IF;

        new_id := spec.id;
        IF FOUND THEN
            UPDATE orc_jobs SET job_key = NULL WHERE id = existing.id;
            INSERT INTO orc_job_events (job_id, kind, payload)
            VALUES (existing.id, 'job.key_revoked',
                    jsonb_build_object('job_key', spec.job_key, 'replaced_by', new_id));
        END IF;
        WITH inserted AS (
            INSERT INTO orc_jobs (id, job_type, status, payload, queue, priority, run_at,
                                  max_attempts, max_retries, job_key, agent_id, trace_id,
                                  timeout_seconds, replay_of, tenant_id, traceparent)
            VALUES (new_id, spec.job_type, p_initial_status, coalesce(spec.payload, 'null'),
                    spec.queue, spec.priority, coalesce(spec.run_at, now()), spec.max_attempts,
                    spec.max_retries, spec.job_key, spec.agent_id, spec.trace_id,
                    spec.timeout_seconds, spec.replay_of, spec.tenant_id, spec.traceparent)
            RETURNING *
        )
        INSERT INTO orc_job_events (job_id, kind, payload)
        SELECT i.id, 'job.created', orc_created_event_v1(i) FROM inserted AS i;
        fresh := fresh || new_id;
        ord := spec.ord; job_id := new_id; outcome := 'created';
        RETURN NEXT;
    END LOOP;

    -- Keyed jobs get their dispatch now (orc_dispatch_v1 also wakes workers for future ones);
    -- keyless jobs scheduled for later wake them here.
    PERFORM orc_dispatch_v1(fresh, p_task_prefix) WHERE cardinality(fresh) > 0;
    PERFORM pg_notify('orc_wakeup', extract(epoch FROM min(s.run_at))::text)
       FROM unnest(specs) AS s
      WHERE s.job_key IS NULL AND s.run_at > now()
     HAVING count(*) > 0;
END;
$$;

DROP FUNCTION orc_claim_v1(uuid, bigint, integer, text, text[], text);
CREATE FUNCTION orc_claim_v1(
    p_job_id uuid, p_procrastinate_job_id bigint, p_run integer, p_worker text,
    p_claimable text[], p_running text
) RETURNS TABLE (
    id uuid, job_type text, payload jsonb, attempt integer, max_attempts integer,
    dispatch_attempt integer, retry_count integer, max_retries integer, lease_token uuid,
    locked_by text, queue text, priority integer, timeout_seconds integer, trace_id text,
    agent_id text, tenant_id text, started_at timestamptz, traceparent text
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
           c.timeout_seconds, c.trace_id, c.agent_id, c.tenant_id, c.started_at, c.traceparent
      FROM claimed AS c;
END;
$$;
