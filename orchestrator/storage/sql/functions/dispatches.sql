-- Dispatches: the Procrastinate jobs that run a job's attempts, each locked on its job's id;
-- and the wake-up when a dispatch's end frees a lock another dispatch waits for.

-- Give each listed job a new Procrastinate job (its next dispatch): queued at the job's
-- availability (next_retry_at for a retry, run_at otherwise). Returns how many.
CREATE OR REPLACE FUNCTION orc_dispatch_v1(p_job_ids uuid[], p_task_prefix text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    ids uuid[];
    ats timestamptz[];
BEGIN
    SELECT array_agg(id), array_agg(coalesce(next_retry_at, run_at)) INTO ids, ats
      FROM orc_jobs WHERE id = ANY (p_job_ids);
    PERFORM orc_flow_dispatch_v2(ids, ats, p_task_prefix);
    RETURN coalesce(cardinality(ids), 0);
END;
$$;

-- Give jobs a dispatch each, for its time in `p_ats` (now when null or past), locked on the
-- job's id so two dispatches of one job never overlap; the workers waiting for a future time
-- hear the soonest (NOTIFY orc_wakeup). Flow control's pump sends waiters ahead with it.
CREATE OR REPLACE FUNCTION orc_flow_dispatch_v2(
    p_job_ids uuid[], p_ats timestamptz[], p_task_prefix text
)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    deferred bigint[] := orc_defer_dispatches_v1(p_job_ids, p_ats, p_task_prefix);
BEGIN
    UPDATE orc_jobs AS j SET procrastinate_job_id = p.id
      FROM procrastinate_jobs AS p
     WHERE p.id = ANY (deferred) AND j.id = (p.args ->> 'job_id')::uuid;
END;
$$;

-- The dispatches of orc_flow_dispatch_v2, inserted (their ids), the soonest future time told
-- on orc_wakeup; the caller points each job at its own (a released job's UPDATE does it with
-- its status: orc_dependencies_release_v2).
CREATE OR REPLACE FUNCTION orc_defer_dispatches_v1(
    p_job_ids uuid[], p_ats timestamptz[], p_task_prefix text
)
RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    deferred bigint[];
    soonest timestamptz;
BEGIN
    SELECT procrastinate_defer_jobs_v1(array_agg(ROW(
               j.queue, p_task_prefix || j.job_type, -j.priority, j.id::text, NULL,
               jsonb_build_object('job_id', j.id), CASE WHEN d.at > now() THEN d.at END
           )::procrastinate_job_to_defer_v1)),
           min(d.at) FILTER (WHERE d.at > now())
      INTO deferred, soonest
      FROM unnest(p_job_ids, p_ats) AS d (job_id, at)
      JOIN orc_jobs AS j ON j.id = d.job_id;
    IF soonest IS NOT NULL THEN
        PERFORM pg_notify('orc_wakeup', extract(epoch FROM soonest)::text);
    END IF;
    RETURN deferred;
END;
$$;

-- End a dispatch with `p_status`, if it is still doing (Procrastinate's finish); whether it
-- was.
CREATE OR REPLACE FUNCTION orc_end_dispatch_v1(p_dispatch_id bigint, p_status text) RETURNS boolean
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

-- A dispatch waiting for its job's lock starts as soon as the lock is free, on whichever
-- worker has a slot.
--
-- Every dispatch is locked on its job id, and Procrastinate's fetch skips a dispatch whose lock
-- another dispatch holds (doing). A dispatch can be inserted while the one before it still
-- holds the lock: an approval decided before the attempt that asked for it has ended its
-- dispatch, a duplicate dispatch ending after its job's real one was queued. Procrastinate
-- announces the insert, every worker's fetch skips the dispatch, and nothing announces the lock
-- coming free: only the worker that ended the dispatch fetches again (and not while it drains),
-- the others would wait for their poll. So the end of a dispatch that frees a lock some
-- waiting dispatch needs sends that dispatch's due time on orc_wakeup, which every worker
-- hears.
--
-- The probe is one lookup in orc_procrastinate_jobs_live_lock; nothing is sent when no dispatch
-- waits for the lock (a job's normal end).
CREATE OR REPLACE FUNCTION orc_notify_lock_freed_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    due timestamptz;
BEGIN
    SELECT min(greatest(coalesce(p.scheduled_at, now()), now())) INTO due
      FROM procrastinate_jobs AS p
     WHERE p.lock = OLD.lock AND p.status = 'todo';
    IF due IS NOT NULL THEN
        PERFORM pg_notify('orc_wakeup', extract(epoch FROM due)::text);
    END IF;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER orc_lock_freed_v1
    AFTER UPDATE OF status ON procrastinate_jobs
    FOR EACH ROW WHEN (OLD.status = 'doing' AND NEW.status <> 'doing' AND OLD.lock IS NOT NULL)
    EXECUTE FUNCTION orc_notify_lock_freed_v1();

CREATE OR REPLACE TRIGGER orc_lock_freed_on_delete_v1
    AFTER DELETE ON procrastinate_jobs
    FOR EACH ROW WHEN (OLD.status = 'doing' AND OLD.lock IS NOT NULL)
    EXECUTE FUNCTION orc_notify_lock_freed_v1();
