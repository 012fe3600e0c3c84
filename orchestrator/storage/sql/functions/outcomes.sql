-- Outcomes: an attempt's end written with its dispatch's end, in one transaction. The
-- completions of a worker's group commit; every terminal failure (the one writer of failures:
-- the worker's, the sweep's, an operator's).

-- Complete several attempts: p_items is [{ord, job_id, lease_token, result, attempt, run,
-- worker, duration_ms, procrastinate_job_id, delete_dispatch}], in job-id order. For each, as
-- for one before: COMPLETED with its result and job.completed (orc_completed_event_v1 shapes
-- it from the item's attempt, run, lease, worker and duration; an item of the release before
-- brings its own, as `event`), fenced by the lease (a null lease completes a
-- job no attempt holds: Graphile Worker's complete_jobs, docs/graphile.md), and its dispatch
-- (when given) finished (succeeded) in the same transaction, so a job is never COMPLETED while
-- its dispatch still shows as running, nor the other way round. The dispatch is finished even
-- when the completion is refused. A dispatch no longer doing (a sweep settled it and took the
-- job) is left alone and its job is not written. Every job and dispatch is locked first, then
-- every flow key the writes may pump, in one order (orc_flow_lock_keys_of_v1), then the jobs
-- are written: a batch never holds one key while it waits for another. Returns, per item,
-- whether its job was COMPLETED.
CREATE OR REPLACE FUNCTION orc_complete_jobs_v1(p_items jsonb, p_target text, p_sources text[])
RETURNS TABLE (ord integer, completed boolean)
LANGUAGE plpgsql AS $$
DECLARE
    item record;
    settled bigint[] := '{}';  -- dispatches no longer doing: their jobs are left alone
BEGIN
    FOR item IN
        SELECT * FROM jsonb_to_recordset(p_items) AS i (job_id uuid, procrastinate_job_id bigint)
    LOOP
        -- Locked, so that no sweep settles it between this check and the finish below; the
        -- job first, as the sweeps lock them (a sweep settles dispatches after their jobs).
        PERFORM FROM orc_jobs AS j WHERE j.id = item.job_id FOR UPDATE;
        IF item.procrastinate_job_id IS NOT NULL THEN
            PERFORM FROM procrastinate_jobs AS p
              WHERE p.id = item.procrastinate_job_id AND p.status = 'doing'
                FOR UPDATE;
            IF NOT FOUND THEN
                settled := settled || item.procrastinate_job_id;
            END IF;
        END IF;
    END LOOP;
    IF jsonb_array_length(p_items) > 1 THEN
        PERFORM orc_flow_lock_keys_of_v1(
            ARRAY(SELECT i.job_id FROM jsonb_to_recordset(p_items) AS i (job_id uuid)));
    END IF;
    FOR item IN
        SELECT * FROM jsonb_to_recordset(p_items)
            AS i (ord integer, job_id uuid, lease_token uuid, result jsonb, attempt integer,
                  run integer, worker text, duration_ms numeric, event jsonb,
                  procrastinate_job_id bigint, delete_dispatch boolean)
    LOOP
        ord := item.ord;
        completed := false;
        IF item.procrastinate_job_id = ANY (settled) THEN
            RETURN NEXT;
            CONTINUE;
        END IF;
        UPDATE orc_jobs AS j
           SET status = p_target, result = item.result,
               lease_token = NULL, locked_by = NULL, heartbeat_at = NULL
         WHERE j.id = item.job_id AND j.lease_token IS NOT DISTINCT FROM item.lease_token
           AND j.status = ANY (p_sources);
        IF FOUND THEN
            INSERT INTO orc_job_events (job_id, kind, payload)
            VALUES (item.job_id, 'job.completed',
                    coalesce(item.event,
                             orc_completed_event_v1(item.attempt, item.run, item.lease_token,
                                                    item.worker, item.duration_ms)));
            completed := true;
        END IF;
        IF item.procrastinate_job_id IS NOT NULL THEN
            PERFORM procrastinate_finish_job_v1(item.procrastinate_job_id, 'succeeded',
                                                item.delete_dispatch);
        END IF;
        RETURN NEXT;
    END LOOP;
END;
$$;

-- Fail jobs for good: p_items is [{ord, job_id, lease_token, dead_letter_id, error, failed,
-- before, degraded, dispatch_id, dispatch_status}], each shaped by
-- orchestrator/domain/failures.py. For each, in the order of docs/contracts.md's dead-letter
-- flow: the job FAILED (fenced by its lease; a null lease fails a job no attempt holds), the
-- explaining events (`before`: a zombie detected, an approval rejected), the dead letter and
-- job.dead_lettered, job.failed, job.degraded; then the dispatch that ran the attempt, if
-- any, is ended. Several jobs are locked first, in job-id order (as a batch of completions
-- locks them), then every flow key their writes may pump, in one order
-- (orc_flow_lock_keys_of_v1), before any is written. Returns, per item, the dead letter's id,
-- or null when the job was not failed. last_error, the dead letter's error and job.failed get
-- their max_attempts here, the attempt (orc_max_attempts_after_v1): an item of the release
-- before brings its own, the same value, which this one replaces.
CREATE OR REPLACE FUNCTION orc_fail_jobs_v1(p_items jsonb, p_target text, p_sources text[])
RETURNS TABLE (ord integer, dead_letter_id uuid)
LANGUAGE plpgsql AS $$
DECLARE
    item record;
    failed_job record;
    ids uuid[] := ARRAY(SELECT i.job_id FROM jsonb_to_recordset(p_items) AS i (job_id uuid));
BEGIN
    IF cardinality(ids) > 1 THEN
        PERFORM FROM orc_jobs AS j WHERE j.id = ANY (ids) ORDER BY j.id FOR UPDATE;
        PERFORM orc_flow_lock_keys_of_v1(ids);
    END IF;
    FOR item IN
        SELECT * FROM jsonb_to_recordset(p_items)
            AS i (ord integer, job_id uuid, lease_token uuid, dead_letter_id uuid, error jsonb,
                  failed jsonb, before jsonb, degraded jsonb, dispatch_id bigint,
                  dispatch_status text)
        ORDER BY i.ord
    LOOP
        ord := item.ord;
        dead_letter_id := NULL;
        UPDATE orc_jobs AS j
           SET status = p_target,
               last_error = item.error
                   || jsonb_build_object('max_attempts', orc_max_attempts_after_v1(
                          j.attempt, j.dispatch_attempt, j.max_attempts, j.retry_count,
                          j.max_retries, NULL)),
               next_retry_at = NULL, lease_token = NULL, locked_by = NULL, heartbeat_at = NULL
         WHERE j.id = item.job_id AND j.lease_token IS NOT DISTINCT FROM item.lease_token
           AND j.status = ANY (p_sources)
        RETURNING j.id, j.job_type, j.payload, j.tenant_id, j.last_error INTO failed_job;
        IF FOUND THEN
            INSERT INTO orc_job_events (job_id, kind, payload)
            SELECT item.job_id, b.event ->> 'kind', b.event -> 'payload'
              FROM jsonb_array_elements(coalesce(item.before, '[]')) WITH ORDINALITY
                   AS b (event, n)
             ORDER BY b.n;
            INSERT INTO orc_dead_letters (id, job_id, job_type, payload, error, tenant_id)
            VALUES (item.dead_letter_id, item.job_id, failed_job.job_type, failed_job.payload,
                    failed_job.last_error, failed_job.tenant_id);
            INSERT INTO orc_job_events (job_id, kind, payload)
            SELECT item.job_id, e.kind,
                   e.payload || jsonb_build_object('dead_letter_id', item.dead_letter_id)
              FROM (VALUES (1, 'job.dead_lettered', '{}'::jsonb),
                           (2, 'job.failed', item.failed || jsonb_build_object(
                                   'max_attempts', failed_job.last_error -> 'max_attempts')),
                           (3, 'job.degraded', item.degraded)) AS e (n, kind, payload)
             WHERE e.payload IS NOT NULL
             ORDER BY e.n;
            dead_letter_id := item.dead_letter_id;
        END IF;
        IF item.dispatch_id IS NOT NULL THEN
            PERFORM orc_end_dispatch_v1(item.dispatch_id, item.dispatch_status);
        END IF;
        RETURN NEXT;
    END LOOP;
END;
$$;

-- Fail for good jobs no attempt holds (Graphile Worker's permanently_fail_jobs; a claim that
-- finds a job's flow key cannot be rendered, orc_flow_assign_v1), through the one failure
-- writer: `p_error` ({message, code, classification}) becomes last_error and job.failed's
-- error, shaped as orchestrator.domain.events shapes a terminal failure no attempt held (its
-- max_attempts, the attempt, stamped by orc_fail_jobs_v1), each job dead-lettered under a new id;
-- nobody is notified. The ids of the jobs failed, in the order given.
CREATE OR REPLACE FUNCTION orc_fail_unheld_v1(
    p_ids uuid[], p_error jsonb, p_target text, p_sources text[]
) RETURNS TABLE (job_id uuid)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
    SELECT p_ids[f.ord]
      FROM orc_fail_jobs_v1(
               (SELECT coalesce(jsonb_agg(jsonb_build_object(
                           'ord', i.n, 'job_id', j.id, 'lease_token', NULL,
                           'dead_letter_id', orc_uuid7_v1(),
                           'error', p_error || c.counters
                               || jsonb_build_object(
                                      'ts', to_char(now() AT TIME ZONE 'UTC',
                                                    'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'),
                                      'stack', NULL, 'terminal', true, 'backoff_ms', NULL,
                                      'next_available_at', NULL, 'output', NULL),
                           'failed', c.counters
                               || jsonb_build_object(
                                      'terminal', true, 'run_id', NULL, 'worker', NULL,
                                      'layer', NULL, 'backoff_ms', NULL, 'error', p_error,
                                      'dead_letter_id', NULL),
                           'before', '[]'::jsonb, 'degraded', NULL,
                           'dispatch_id', NULL, 'dispatch_status', NULL)
                           ORDER BY i.n), '[]')
                  FROM unnest(p_ids) WITH ORDINALITY AS i (id, n)
                  JOIN orc_jobs AS j ON j.id = i.id,
                  LATERAL (SELECT jsonb_build_object(
                                      'attempt', j.attempt,
                                      'run', j.dispatch_attempt, 'max_runs', j.max_attempts,
                                      'retry_count', j.retry_count,
                                      'max_retries', j.max_retries) AS counters) AS c),
               p_target, p_sources) AS f
     WHERE f.dead_letter_id IS NOT NULL
     ORDER BY f.ord;
END;
$$;
