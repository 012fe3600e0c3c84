-- 0006_batched_fetch_and_completion: a busy worker fetches, and completes, several jobs per
-- statement.
--
-- Every statement costs its parse, execution set-up and commit on both sides of the wire,
-- whatever it writes; on a busy worker that cost was paid once per fetch and once per
-- completion. The rows each job writes are the same as before.

-- Fetch and claim up to p_limit dispatches (the worker's free slots), each exactly as
-- orc_fetch_dispatch_v1 does: later ones see the earlier ones as doing, so a lock is honoured
-- within the batch too. Rows come back in fetch order; none when nothing is due.
CREATE FUNCTION orc_fetch_dispatches_v1(
    p_limit integer, p_queues character varying[], p_worker_id bigint, p_task_prefix text,
    p_worker text, p_claimable text[], p_running text
) RETURNS SETOF procrastinate_jobs
LANGUAGE plpgsql AS $$
DECLARE
    fetched procrastinate_jobs;
BEGIN
    FOR i IN 1 .. p_limit LOOP
        SELECT * INTO fetched
          FROM orc_fetch_dispatch_v1(p_queues, p_worker_id, p_task_prefix, p_worker, p_claimable,
                                     p_running);
        EXIT WHEN fetched.id IS NULL;
        RETURN NEXT fetched;
    END LOOP;
END;
$$;

-- Complete several attempts: p_items is [{ord, job_id, lease_token, result, event,
-- procrastinate_job_id, delete_dispatch}]. For each, as for one before: COMPLETED with its
-- result and job.completed, fenced by the lease, and its dispatch (when given) finished
-- (succeeded) in the same transaction, so a job is never COMPLETED while its dispatch still
-- shows as running, nor the other way round. The dispatch is finished even when the completion
-- is refused. A dispatch no longer doing (a sweep settled it and took the job) is left alone
-- and its job is not written. Returns, per item, whether its job was COMPLETED.
CREATE FUNCTION orc_complete_jobs_v1(p_items jsonb, p_target text, p_sources text[])
RETURNS TABLE (ord integer, completed boolean)
LANGUAGE plpgsql AS $$
DECLARE
    item record;
BEGIN
    FOR item IN
        SELECT * FROM jsonb_to_recordset(p_items)
            AS i (ord integer, job_id uuid, lease_token uuid, result jsonb, event jsonb,
                  procrastinate_job_id bigint, delete_dispatch boolean)
    LOOP
        ord := item.ord;
        completed := false;
        IF item.procrastinate_job_id IS NOT NULL THEN
            -- Locked, so that no sweep settles it between this check and the finish below; the
            -- job first, as the sweeps lock them (a sweep settles dispatches after their jobs).
            PERFORM FROM orc_jobs AS j WHERE j.id = item.job_id FOR UPDATE;
            PERFORM FROM procrastinate_jobs AS p
              WHERE p.id = item.procrastinate_job_id AND p.status = 'doing'
                FOR UPDATE;
            IF NOT FOUND THEN
                RETURN NEXT;
                CONTINUE;
            END IF;
        END IF;
        UPDATE orc_jobs AS j
           SET status = p_target, result = item.result,
               lease_token = NULL, locked_by = NULL, heartbeat_at = NULL
         WHERE j.id = item.job_id AND j.lease_token = item.lease_token
           AND j.status = ANY (p_sources);
        IF FOUND THEN
            INSERT INTO orc_job_events (job_id, kind, payload)
            VALUES (item.job_id, 'job.completed', item.event);
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
