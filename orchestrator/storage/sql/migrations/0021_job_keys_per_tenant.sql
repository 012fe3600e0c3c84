-- 0021_job_keys_per_tenant: a job key is unique within its tenant, not across tenants.
--
-- compatible-with-older-workers: yes
--
-- Until now a key named at most one live job whoever submitted it, so a submit in tenant B with
-- a key held by tenant A's unfinished job replaced A's job (making it B's, with B's payload) or,
-- with unsafe_dedupe, was dropped and answered with A's job. Now each tenant has its own keys,
-- and so do jobs without a tenant: the "no tenant" scope is one scope of its own, sharing no key
-- with any tenant (docs/contracts.md, "Tenants").
--
-- * orc_jobs_live_job_key_per_tenant replaces orc_jobs_live_job_key: a (key, scope) names at
--   most one live job. The scope is coalesce(tenant_id, ''): a tenant has 1 to 200 characters
--   (0016), so '' is no tenant's. Every key stays on its job: the live keys were unique across
--   tenants, so they are unique within each one, and the new index is built over them as they
--   are before the old one goes. Building it reads the whole table while writes to orc_jobs
--   wait, as building each of 0016's indexes did (0016 has the measurements); it holds an
--   entry for live keyed jobs only.
-- * orc_submit_jobs_v1 (from 0017) looks a key up, and takes its advisory lock, in the submit's
--   scope. A replace no longer sets the job's tenant: it is the submit's by construction.
--   job.replaced keeps its tenant_id.
--
-- Redefined rather than versioned: orc_submit_jobs_v2 (the submit_jobs query; the previous
-- release, 532b0c2, calls it too) hands keyed submits to orc_submit_jobs_v1, whose signature
-- and answer are unchanged. A caller that passes no tenant (every caller of that release) gets
-- the keys of the no-tenant scope, which are all the keys it could ever have made; a caller
-- that passes one gets its tenant's. Global keys are the unsafe behaviour for every caller, so
-- no version keeps them.

CREATE UNIQUE INDEX orc_jobs_live_job_key_per_tenant
    ON orc_jobs (job_key, (coalesce(tenant_id, '')))
    WHERE job_key IS NOT NULL AND finished_at IS NULL;
DROP INDEX orc_jobs_live_job_key;

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
    -- Serialise submits of one key in one scope, so two of them cannot both create a job: every
    -- key's lock is taken first, in the order of the lock ids, so two batches naming the same
    -- keys in other orders take turns rather than deadlock.
    PERFORM pg_advisory_xact_lock(k.lock_id)
       FROM (SELECT DISTINCT hashtextextended(
                 'orc_job_key:' || jsonb_build_array(s.tenant_id, s.job_key)::text, 0) AS lock_id
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
        -- The live job with this key in the submit's own scope: its tenant, or no tenant.
        SELECT * INTO existing FROM orc_jobs AS j
         WHERE j.job_key = spec.job_key
           AND coalesce(j.tenant_id, '') = coalesce(spec.tenant_id, '')
           AND j.finished_at IS NULL
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
