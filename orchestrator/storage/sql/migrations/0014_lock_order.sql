-- 0014_lock_order: the fetch never waits for a job row, and a batch of keyed submits takes its
-- keys' locks in one order (docs/architecture.md, "Lock order").
--
-- Every statement that touches a job and its dispatch locks the job row first, then the
-- dispatch; the fetch cannot: Procrastinate's fetch picks and locks a dispatch before anything
-- knows its job. It then waited for the job row in the claim, while a keyed submit (or a
-- cancel) held that row and waited for the dispatch it was replacing: a deadlock, which
-- PostgreSQL broke by aborting one of them (twenty concurrent replace submits of one key
-- against a busy worker did, in every run).
--
-- Now the fetch only tries the job row (SKIP LOCKED), so it waits for nothing. A job held by
-- another transaction at that instant is not claimed here: the dispatch is returned, doing,
-- marked `claim_later`, and its worker claims it in a statement of its own (claim_dispatch),
-- which waits for the job row alone. By then the holder has committed: a replaced or cancelled
-- job has left this dispatch behind, the claim finds it stale, and the worker ends it.
--
-- Keyed submits took each key's advisory lock in the batch's order, so two batches naming the
-- same two keys the other way round could deadlock; all the batch's keys are now locked first,
-- ordered by lock id. orc_submit_jobs_v1 is otherwise as in 0012.

CREATE OR REPLACE FUNCTION orc_fetch_dispatch_v1(
    p_queues character varying[], p_worker_id bigint, p_task_prefix text, p_worker text,
    p_claimable text[], p_running text
) RETURNS SETOF procrastinate_jobs
LANGUAGE plpgsql AS $$
DECLARE
    fetched procrastinate_jobs;
    job uuid;
    claim jsonb;
BEGIN
    fetched := procrastinate_fetch_job_v2(p_queues, p_worker_id);
    IF fetched.id IS NOT NULL AND starts_with(fetched.task_name, p_task_prefix) THEN
        job := (fetched.args ->> 'job_id')::uuid;
        PERFORM FROM orc_jobs AS j WHERE j.id = job FOR NO KEY UPDATE SKIP LOCKED;
        IF NOT FOUND AND EXISTS (SELECT FROM orc_jobs AS j WHERE j.id = job) THEN
            fetched.args := fetched.args || '{"claim": null, "claim_later": true}';
        ELSE
            SELECT to_jsonb(c) INTO claim
              FROM orc_claim_v1(job, fetched.id, fetched.attempts + 1,
                                p_worker || '/w' || p_worker_id, p_claimable, p_running) AS c;
            fetched.args := fetched.args || jsonb_build_object('claim', claim);
        END IF;
    END IF;
    RETURN NEXT fetched;
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
                              replay_of, procrastinate_job_id)
        SELECT s.id, s.job_type, p_initial_status, coalesce(s.payload, 'null'), s.queue,
               s.priority, coalesce(s.run_at, now()), s.max_attempts, s.max_retries, s.agent_id,
               s.trace_id, s.timeout_seconds, s.replay_of, p.id
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
                                       'revision', existing.revision + 1));
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
                                  timeout_seconds, replay_of)
            VALUES (new_id, spec.job_type, p_initial_status, coalesce(spec.payload, 'null'),
                    spec.queue, spec.priority, coalesce(spec.run_at, now()), spec.max_attempts,
                    spec.max_retries, spec.job_key, spec.agent_id, spec.trace_id,
                    spec.timeout_seconds, spec.replay_of)
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
