-- 0015_lock_freed_wakes_the_fleet: a dispatch waiting for its job's lock starts as soon as the
-- lock is free, on whichever worker has a slot.
--
-- Every dispatch is locked on its job id, and Procrastinate's fetch skips a dispatch whose lock
-- another dispatch holds (doing). A dispatch can be inserted while the one before it still
-- holds the lock: an approval decided before the attempt that asked for it has ended its
-- dispatch, a duplicate dispatch ending after its job's real one was queued. Procrastinate
-- announces the insert, every worker's fetch skips the dispatch, and nothing announces the lock
-- coming free: only the worker that ended the dispatch fetches again (and not while it drains),
-- the others wait for their poll. Now the end of a dispatch that frees a lock some waiting
-- dispatch needs sends that dispatch's due time on orc_wakeup, which every worker hears.
--
-- The probe is one lookup in orc_procrastinate_jobs_live_lock; nothing is sent when no dispatch
-- waits for the lock (a job's normal end).
CREATE FUNCTION orc_notify_lock_freed_v1() RETURNS trigger
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

CREATE TRIGGER orc_lock_freed_v1
    AFTER UPDATE OF status ON procrastinate_jobs
    FOR EACH ROW WHEN (OLD.status = 'doing' AND NEW.status <> 'doing' AND OLD.lock IS NOT NULL)
    EXECUTE FUNCTION orc_notify_lock_freed_v1();

CREATE TRIGGER orc_lock_freed_on_delete_v1
    AFTER DELETE ON procrastinate_jobs
    FOR EACH ROW WHEN (OLD.status = 'doing' AND OLD.lock IS NOT NULL)
    EXECUTE FUNCTION orc_notify_lock_freed_v1();
