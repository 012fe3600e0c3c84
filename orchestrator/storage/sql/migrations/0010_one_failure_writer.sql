-- 0010_one_failure_writer: every terminal failure is written by one function, and every
-- attempt's outcome ends the dispatch that ran it in the same transaction.
--
-- A terminal failure was written by two statements (fail_job for an attempt or an approval,
-- sweep_to_failed for a zombie), with different dead-letter ids and event payloads that had
-- drifted apart. orc_fail_jobs_v1 takes a batch (one failure is a batch of one), each item
-- shaped by orchestrator/domain/failures.py:
--
--   {ord, job_id, lease_token, dead_letter_id, error, failed, before, degraded,
--    dispatch_id, dispatch_status}
--
-- For each, in the order of docs/contracts.md's dead-letter flow: the job FAILED (fenced by its
-- lease; a null lease fails a job that no attempt holds), the explaining events (`before`: a
-- zombie detected, an approval rejected), the dead letter and job.dead_lettered, job.failed,
-- job.degraded (each of these three names the dead letter); then the dispatch that ran the attempt, if any, is ended. The job row is locked
-- before the dispatch row, as every statement that touches both does (docs/architecture.md).
-- Returns, per item, the dead letter's id, or null when the job was not failed (refused).

CREATE FUNCTION orc_end_dispatch_v1(p_dispatch_id bigint, p_status text) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    -- Only a dispatch still doing is ended: a sweep may have settled it already.
    PERFORM FROM procrastinate_jobs WHERE id = p_dispatch_id AND status = 'doing' FOR UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM procrastinate_finish_job_v1(p_dispatch_id, p_status::procrastinate_job_status, false);
    RETURN true;
END;
$$;

CREATE FUNCTION orc_fail_jobs_v1(p_items jsonb, p_target text, p_sources text[])
RETURNS TABLE (ord integer, dead_letter_id uuid)
LANGUAGE plpgsql AS $$
DECLARE
    item record;
    failed_job record;
BEGIN
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
           SET status = p_target, last_error = item.error, next_retry_at = NULL,
               lease_token = NULL, locked_by = NULL, heartbeat_at = NULL
         WHERE j.id = item.job_id AND j.lease_token IS NOT DISTINCT FROM item.lease_token
           AND j.status = ANY (p_sources)
        RETURNING j.id, j.job_type, j.payload INTO failed_job;
        IF FOUND THEN
            INSERT INTO orc_job_events (job_id, kind, payload)
            SELECT item.job_id, b.event ->> 'kind', b.event -> 'payload'
              FROM jsonb_array_elements(coalesce(item.before, '[]')) WITH ORDINALITY
                   AS b (event, n)
             ORDER BY b.n;
            INSERT INTO orc_dead_letters (id, job_id, job_type, payload, error)
            VALUES (item.dead_letter_id, item.job_id, failed_job.job_type, failed_job.payload,
                    item.error);
            INSERT INTO orc_job_events (job_id, kind, payload)
            SELECT item.job_id, e.kind,
                   e.payload || jsonb_build_object('dead_letter_id', item.dead_letter_id)
              FROM (VALUES (1, 'job.dead_lettered', '{}'::jsonb),
                           (2, 'job.failed', item.failed),
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
