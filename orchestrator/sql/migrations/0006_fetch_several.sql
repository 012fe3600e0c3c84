-- 0006_fetch_several: one statement fetches and claims up to p_limit dispatches.
--
-- A worker with several free slots fills them in one round trip and one commit, rather than one
-- each: on a busy worker the fetch loop is the serial part (one fetch at a time), and every
-- statement costs its parse, execution set-up and commit on both sides of the wire, whatever it
-- writes. Each dispatch is fetched and claimed exactly as orc_fetch_dispatch_v1 does (later ones
-- see the earlier ones as doing, so a lock is honoured within the batch too); the rows come back
-- in fetch order, and none when nothing is due.
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
