-- Submit: jobs created (or, with a job key, replaced or deduplicated) with their job.created
-- events and first dispatches, in one statement.
--
-- In use: orc_submit_jobs_v2, which stores each job's flow (key, limit, cost, share) and hands
-- a batch with keys to orc_submit_jobs_v1 (Graphile Worker's job_key modes, per tenant), which
-- hands its jobs without a key back to orc_submit_jobs_v2.

-- Submit jobs, each with its flow (its key, limit, cost and share; null: no limit), its key
-- rendered here from its limit's template (orc_job_specs_v1); keyed submits go through
-- orc_submit_jobs_v1. A job with parents (depends_on: functions/dependencies.sql) is written
-- BLOCKED, without a dispatch, its parents checked first and its edges written after.
CREATE OR REPLACE FUNCTION orc_submit_jobs_v2(
    p_specs jsonb, p_initial_status text, p_waiting text[], p_task_prefix text
) RETURNS TABLE (ord integer, job_id uuid, outcome text)
LANGUAGE plpgsql AS $$
DECLARE
    graph boolean;
BEGIN
    IF jsonb_path_exists(p_specs, '$[*] ? (@.job_key != null)') THEN
        RETURN QUERY SELECT * FROM orc_submit_jobs_v1(p_specs, p_initial_status, p_waiting,
                                                      p_task_prefix);
        RETURN;
    END IF;
    graph := jsonb_path_exists(p_specs, '$[*] ? (@.depends_on != null)');
    IF graph THEN
        PERFORM orc_dependencies_check_v1(p_specs);
    END IF;

    RETURN QUERY
    WITH spec AS (
        SELECT s.* FROM orc_job_specs_v1(p_specs) AS s
    ), dispatch AS (
        INSERT INTO procrastinate_jobs (queue_name, task_name, priority, lock, args, scheduled_at)
        SELECT s.queue, p_task_prefix || s.job_type, -s.priority, s.id::text,
               jsonb_build_object('job_id', s.id), CASE WHEN s.run_at > now() THEN s.run_at END
          FROM spec AS s
         WHERE s.depends_on IS NULL
         ORDER BY s.ord
        RETURNING procrastinate_jobs.id, procrastinate_jobs.lock
    ), job AS (
        INSERT INTO orc_jobs (id, job_type, status, payload, queue, priority, run_at,
                              max_attempts, max_retries, agent_id, trace_id, timeout_seconds,
                              replay_of, tenant_id, procrastinate_job_id, traceparent,
                              flow_key, flow_limit, flow_cost, flow_share)
        SELECT s.id, s.job_type,
               CASE WHEN s.depends_on IS NULL THEN p_initial_status ELSE 'BLOCKED' END,
               coalesce(s.payload, 'null'), s.queue,
               s.priority, coalesce(s.run_at, now()), s.max_attempts, s.max_retries, s.agent_id,
               s.trace_id, s.timeout_seconds, s.replay_of, s.tenant_id, d.id, s.traceparent,
               s.flow_key, s.flow_limit, s.flow_cost, s.flow_share
          FROM spec AS s LEFT JOIN dispatch AS d ON d.lock = s.id::text
        RETURNING *
    ), created AS (
        INSERT INTO orc_job_events (job_id, kind, payload)
        SELECT j.id, 'job.created', orc_created_event_v1(j) FROM job AS j
    )
    SELECT s.ord, s.id, 'created'::text FROM spec AS s;
    IF graph THEN
        PERFORM orc_dependencies_add_v1(p_specs, p_task_prefix);
    END IF;

    -- Workers waiting for a future time are told, as orc_dispatch_v1 tells them of keyed jobs.
    IF jsonb_path_exists(p_specs, '$[*] ? (@.run_at != null)') THEN
        PERFORM pg_notify('orc_wakeup', extract(epoch FROM min(s.run_at))::text)
           FROM jsonb_populate_recordset(NULL::orc_job_spec_v1, p_specs) AS s
          WHERE s.run_at > now()
         HAVING count(*) > 0;
    END IF;
END;
$$;

-- Submit jobs in one round trip, with Graphile Worker's job_key modes:
--   replace          a waiting job with the key gets the new payload, schedule and options;
--                    a running one loses the key (job.key_revoked) and a new job is created
--   preserve_run_at  as replace, but a waiting job keeps its schedule
--   unsafe_dedupe    any live job with the key is returned unchanged
-- Keys are per tenant (a job without a tenant: the no-tenant scope). Every submit with a key
-- adds one to the revision of the live job holding it; a job that took the key from a running
-- one starts at 0.
-- Returns one row per spec: its ord, the job id, and what happened (created/replaced/deduplicated).
CREATE OR REPLACE FUNCTION orc_submit_jobs_v1(
    p_specs jsonb, p_initial_status text, p_waiting text[], p_task_prefix text
) RETURNS TABLE (ord integer, job_id uuid, outcome text)
LANGUAGE plpgsql AS $$
DECLARE
    specs orc_job_spec_v1[] := ARRAY(
        SELECT s FROM orc_job_specs_v1(p_specs) AS s WHERE s.job_key IS NOT NULL);
    spec orc_job_spec_v1;
    existing orc_jobs;
    fresh uuid[] := '{}';  -- keyed rows that need a dispatch: created and replaced ones
    new_id uuid;
BEGIN
    -- Serialise submits of one key in one scope, so two of them cannot both create a job: every
    -- key's lock is taken first, in the order of the lock ids, so two batches naming the same
    -- keys in other orders take turns rather than deadlock.
    PERFORM pg_advisory_xact_lock(k.lock_id)
       FROM (SELECT DISTINCT orc_job_key_lock_id_v1(s.tenant_id, s.job_key) AS lock_id
               FROM unnest(specs) AS s
              ORDER BY 1) AS k;
    -- Jobs without a key: written set-based, as orc_submit_jobs_v2 writes a batch without keys.
    RETURN QUERY SELECT * FROM orc_submit_jobs_v2(
        (SELECT coalesce(jsonb_agg(e ORDER BY n), '[]')
           FROM jsonb_array_elements(p_specs) WITH ORDINALITY AS a (e, n)
          WHERE e ->> 'job_key' IS NULL),
        p_initial_status, p_waiting, p_task_prefix);

    FOR spec IN SELECT * FROM unnest(specs) AS s ORDER BY s.ord
    LOOP
        SELECT * INTO existing FROM orc_live_job_with_key_v1(spec.job_key, spec.tenant_id) AS k
         WHERE k.id IS NOT NULL;

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
                   timeout_seconds = spec.timeout_seconds,
                   flow_key = spec.flow_key,
                   flow_limit = spec.flow_limit,
                   flow_cost = spec.flow_cost,
                   flow_share = spec.flow_share,
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
                    orc_replaced_event_v1(spec.job_key, spec.job_key_mode,
                                          existing.revision + 1, spec.tenant_id));
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
                    orc_key_revoked_event_v1(spec.job_key, new_id));
        END IF;
        WITH inserted AS (
            INSERT INTO orc_jobs (id, job_type, status, payload, queue, priority, run_at,
                                  max_attempts, max_retries, job_key, agent_id, trace_id,
                                  timeout_seconds, replay_of, tenant_id, traceparent,
                                  flow_key, flow_limit, flow_cost, flow_share)
            VALUES (new_id, spec.job_type, p_initial_status, coalesce(spec.payload, 'null'),
                    spec.queue, spec.priority, coalesce(spec.run_at, now()), spec.max_attempts,
                    spec.max_retries, spec.job_key, spec.agent_id, spec.trace_id,
                    spec.timeout_seconds, spec.replay_of, spec.tenant_id, spec.traceparent,
                    spec.flow_key, spec.flow_limit, spec.flow_cost, spec.flow_share)
            RETURNING *
        )
        INSERT INTO orc_job_events (job_id, kind, payload)
        SELECT i.id, 'job.created', orc_created_event_v1(i) FROM inserted AS i;
        fresh := fresh || new_id;
        ord := spec.ord; job_id := new_id; outcome := 'created';
        RETURN NEXT;
    END LOOP;

    -- Keyed jobs get their dispatch now (orc_dispatch_v1 also wakes workers for future ones).
    PERFORM orc_dispatch_v1(fresh, p_task_prefix) WHERE cardinality(fresh) > 0;
END;
$$;

-- A submit's specs, each job's flow key rendered from its limit's template and its share named
-- by the limit's share_by where the spec names a template (`flow_template`, `flow_share_by`:
-- orc_flow_key_v1 refuses a payload that lacks what the template names, and so the whole
-- submit; orc_flow_share_of_v1); a spec that brings its key keeps it and its share (the release
-- before renders its own; Graphile Worker's named queues).
CREATE OR REPLACE FUNCTION orc_job_specs_v1(p_specs jsonb) RETURNS SETOF orc_job_spec_v1
LANGUAGE sql STABLE AS $$
    SELECT (CASE WHEN s.flow_template IS NULL THEN s
                 ELSE jsonb_populate_record(s, jsonb_build_object(
                          'flow_key', orc_flow_key_v1(s.flow_template, s.job_type, s.tenant_id,
                                                      s.agent_id, s.payload),
                          'flow_share', orc_flow_share_of_v1(s.flow_share_by, s.tenant_id,
                                                             s.agent_id))) END).*
      FROM jsonb_populate_recordset(NULL::orc_job_spec_v1, p_specs) AS s
$$;

-- The id of a job key's advisory lock in a scope (a tenant, or none): every submit naming the
-- key there takes it first (orc_submit_jobs_v1; Graphile Worker's replace, docs/graphile.md).
CREATE OR REPLACE FUNCTION orc_job_key_lock_id_v1(p_tenant text, p_key text) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
    SELECT hashtextextended('orc_job_key:' || jsonb_build_array(p_tenant, p_key)::text, 0)
$$;

-- A time-ordered id (UUIDv7, RFC 9562) for a row written in SQL, as
-- orchestrator.domain.ids.uuid7 makes one in Python: Graphile Worker's jobs, the dead letters
-- of failures no attempt held (orc_fail_unheld_v1).
CREATE OR REPLACE FUNCTION orc_uuid7_v1() RETURNS uuid
LANGUAGE sql VOLATILE AS $$
    SELECT encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid()) PLACING
               substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint)
                         FROM 3) FROM 1 FOR 6), 52, 1), 53, 1), 'hex')::uuid
$$;

-- The live job that holds a job key in a scope (a tenant, or none: the no-tenant scope),
-- locked; none (a row of nulls) if no live job holds it. A key names at most one live job per
-- scope (orc_jobs_live_job_key_per_tenant).
CREATE OR REPLACE FUNCTION orc_live_job_with_key_v1(p_key text, p_tenant text) RETURNS orc_jobs
LANGUAGE sql AS $$
    SELECT * FROM orc_jobs AS j
     WHERE j.job_key = p_key AND coalesce(j.tenant_id, '') = coalesce(p_tenant, '')
       AND j.finished_at IS NULL
       FOR UPDATE
$$;
