-- Dependencies (docs/workflows.md): a job that waits for other jobs, its parents, is BLOCKED,
-- with no dispatch, its count of parents still to end in orc_job_waits. Each parent's end
-- settles its edges in the transaction that ends it (orc_jobs_dependants_settle), and the last
-- gives the job its dispatch: nothing polls. A parent that failed or was cancelled applies each
-- edge's policy: `cancel` (the job is cancelled, and its own dependants down the graph), `run`
-- (it counts as ended: the job runs and reads the failure) or `wait` (the job stays blocked
-- while the parent's dead letter is open: a requeue hands the edge to the new job, a discard
-- cancels the job; a cancelled parent, which has no letter, cancels it).

-- A submit's edges: each spec's parents (its depends_on, resolved to job ids by the submit), in
-- order, with the policy of each.
CREATE OR REPLACE FUNCTION orc_submitted_edges_v1(p_specs jsonb)
RETURNS TABLE (ord integer, id uuid, tenant_id text, awaited_id uuid, on_failure text, n integer)
LANGUAGE sql IMMUTABLE AS $$
    SELECT s.ord, s.id, s.tenant_id, (d.e ->> 'job_id')::uuid, d.e ->> 'on_failure', d.n::integer
      FROM jsonb_populate_recordset(NULL::orc_job_spec_v1, p_specs) AS s,
           jsonb_array_elements(s.depends_on) WITH ORDINALITY AS d (e, n)
     WHERE s.depends_on IS NOT NULL
$$;

-- A submit's parents checked before anything is written (SQLSTATE ORCDP, the submit's
-- SubmitError): each a job of the dependant's tenant, there already or in the same batch. That
-- a batch's parent comes before its dependant is the submit's rule in Python
-- (orchestrator.domain.dependencies.edges, which resolves a batch index to its job's id: the
-- ids are minted there, so no caller can name a later job of the batch by id). Those already there are locked, in one order, so the end of one cannot pass
-- between this check and the edges' insert unseen.
CREATE OR REPLACE FUNCTION orc_dependencies_check_v1(p_specs jsonb) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    refused record;
BEGIN
    PERFORM FROM orc_jobs AS j
     WHERE j.id IN (SELECT e.awaited_id FROM orc_submitted_edges_v1(p_specs) AS e)
     ORDER BY j.id
       FOR NO KEY UPDATE;
    SELECT e.ord, e.awaited_id INTO refused
      FROM orc_submitted_edges_v1(p_specs) AS e
      LEFT JOIN jsonb_populate_recordset(NULL::orc_job_spec_v1, p_specs) AS b
        ON b.id = e.awaited_id
      LEFT JOIN orc_jobs AS j ON j.id = e.awaited_id
     WHERE CASE WHEN b.id IS NOT NULL
                THEN b.tenant_id IS DISTINCT FROM e.tenant_id
                ELSE j.id IS NULL OR j.tenant_id IS DISTINCT FROM e.tenant_id END
     ORDER BY e.ord, e.n
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'depends_on: no job % of its tenant submitted before it',
            refused.awaited_id
            USING ERRCODE = 'ORCDP', DETAIL = refused.ord::text;
    END IF;
END;
$$;

-- The edges of a submit checked by orc_dependencies_check_v1, its jobs written (those with
-- parents BLOCKED): each dependant's count, its job.blocked, its parents marked as depended on,
-- and the parents that had already ended settled at once (a job whose parents had all
-- completed is released in this statement).
CREATE OR REPLACE FUNCTION orc_dependencies_add_v1(p_specs jsonb, p_task_prefix text)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO orc_job_dependencies (job_id, awaited_id, ord, on_failure)
    SELECT e.id, e.awaited_id, e.n, e.on_failure FROM orc_submitted_edges_v1(p_specs) AS e;
    UPDATE orc_jobs AS j SET has_dependants = true
     WHERE j.id IN (SELECT e.awaited_id FROM orc_submitted_edges_v1(p_specs) AS e)
       AND NOT j.has_dependants;
    INSERT INTO orc_job_waits (job_id, unsettled, task_prefix)
    SELECT e.id, count(*), p_task_prefix FROM orc_submitted_edges_v1(p_specs) AS e GROUP BY e.id;
    INSERT INTO orc_job_events (job_id, kind, payload)
    SELECT e.id, 'job.blocked',
           orc_blocked_event_v1(array_agg(e.awaited_id ORDER BY e.n),
                                count(*) FILTER (WHERE p.finished_at IS NULL))
      FROM orc_submitted_edges_v1(p_specs) AS e
      JOIN orc_jobs AS p ON p.id = e.awaited_id
     GROUP BY e.id;
    PERFORM orc_dependencies_settle_v1(ARRAY(
        SELECT DISTINCT e.awaited_id FROM orc_submitted_edges_v1(p_specs) AS e
          JOIN orc_jobs AS p ON p.id = e.awaited_id
         WHERE p.finished_at IS NOT NULL));
END;
$$;

-- The edges of parents that ended take their end; then, by each edge's policy, the dependants
-- are cancelled (with theirs down the graph), held, or counted down, and those with nothing
-- left to wait for get their dispatch. Dependants are locked in one order (their ids). A
-- `wait` edge of a failed parent whose letter is resolved already follows it at once. Two
-- statements when every parent completed (the edges settled and judged; the counts taken
-- down), then the release: a chain's link is paid for in the transaction that ends its parent
-- (bench/workflows.py).
CREATE OR REPLACE FUNCTION orc_dependencies_settle_v1(p_parents uuid[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    doomed uuid[];
    counted uuid[];
    ended integer[];
    handed uuid[];
    replays uuid[];
    freed uuid[];
    ats timestamptz[];
    prefixes text[];
BEGIN
    IF coalesce(cardinality(p_parents), 0) = 0 THEN
        RETURN;
    END IF;
    WITH settled AS (
        UPDATE orc_job_dependencies AS d SET settled = p.status
          FROM orc_jobs AS p
         WHERE d.awaited_id = ANY (p_parents) AND d.settled IS NULL AND p.id = d.awaited_id
           AND p.finished_at IS NOT NULL
        RETURNING d.job_id, d.awaited_id, d.on_failure, d.settled
    ), lettered AS (
        SELECT s.job_id, s.awaited_id, s.on_failure, s.settled, l.state AS letter,
               l.requeued_job_id AS replay
          FROM settled AS s
          LEFT JOIN LATERAL (SELECT l.state, l.requeued_job_id FROM orc_dead_letters AS l
                              WHERE l.job_id = s.awaited_id AND s.on_failure = 'wait'
                                AND s.settled = 'FAILED'
                              ORDER BY l.created_at DESC LIMIT 1) AS l ON true
    ), judged AS (
        SELECT e.job_id,
               bool_or(e.settled <> 'COMPLETED'
                       AND (e.on_failure = 'cancel'
                            OR (e.on_failure = 'wait' AND e.settled = 'CANCELLED')
                            OR e.letter IS NOT DISTINCT FROM 'discarded')) AS cancel,
               count(*) FILTER (WHERE e.settled = 'COMPLETED' OR e.on_failure = 'run')::integer
                   AS done
          FROM lettered AS e
          JOIN orc_jobs AS c ON c.id = e.job_id AND c.finished_at IS NULL
         GROUP BY e.job_id
    ), handing AS (
        SELECT DISTINCT e.awaited_id, e.replay FROM lettered AS e WHERE e.letter = 'requeued'
    )
    SELECT (SELECT array_agg(v.job_id) FROM judged AS v WHERE v.cancel),
           (SELECT array_agg(v.job_id ORDER BY v.job_id) FROM judged AS v
             WHERE NOT v.cancel AND v.done > 0),
           (SELECT array_agg(v.done ORDER BY v.job_id) FROM judged AS v
             WHERE NOT v.cancel AND v.done > 0),
           (SELECT array_agg(h.awaited_id ORDER BY h.awaited_id) FROM handing AS h),
           (SELECT array_agg(h.replay ORDER BY h.awaited_id) FROM handing AS h)
      INTO doomed, counted, ended, handed, replays;

    IF cardinality(doomed) > 0 THEN
        PERFORM orc_dependencies_cancel_v1(doomed, p_parents);
    END IF;
    IF cardinality(counted) > 0 THEN
        -- Locked first (in one order), so that the statement below reads each count as the
        -- last parent to end left it: two parents ending at once release their child once.
        PERFORM FROM orc_job_waits AS w WHERE w.job_id = ANY (counted) ORDER BY w.job_id
            FOR UPDATE;
        -- Those whose last edges these are leave orc_job_waits, to be released; the others'
        -- counts go down (a count that would go below 0 fails its CHECK).
        WITH freeing AS (
            DELETE FROM orc_job_waits AS w
             USING unnest(counted, ended) AS c (job_id, done), orc_jobs AS j
             WHERE w.job_id = c.job_id AND w.unsettled = c.done AND j.id = w.job_id
               AND j.status = 'BLOCKED'
            RETURNING w.job_id, w.task_prefix, coalesce(j.next_retry_at, j.run_at) AS at
        ), counted_down AS (
            UPDATE orc_job_waits AS w SET unsettled = w.unsettled - c.done
              FROM unnest(counted, ended) AS c (job_id, done)
             WHERE w.job_id = c.job_id AND w.unsettled <> c.done
        )
        SELECT array_agg(f.job_id), array_agg(f.at), array_agg(f.task_prefix)
          INTO freed, ats, prefixes
          FROM freeing AS f;
        PERFORM orc_dependencies_release_v2(freed, ats, prefixes) WHERE freed IS NOT NULL;
    END IF;
    FOR i IN 1 .. coalesce(cardinality(handed), 0) LOOP
        PERFORM orc_dependencies_hand_on_v1(handed[i], replays[i]);
    END LOOP;
END;
$$;

-- A requeued parent's `wait` edges go to the job that replays it (a letter's requeue: the
-- trigger on orc_dead_letters, or a settle that met a letter requeued already); if that job has
-- ended too, they are settled at once.
CREATE OR REPLACE FUNCTION orc_dependencies_hand_on_v1(p_parent uuid, p_replay uuid)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF p_replay IS NULL THEN
        RETURN;
    END IF;
    PERFORM FROM orc_jobs WHERE id = p_replay FOR NO KEY UPDATE;
    UPDATE orc_job_dependencies AS d SET awaited_id = p_replay, settled = NULL
     WHERE d.awaited_id = p_parent AND d.on_failure = 'wait' AND d.settled = 'FAILED'
       AND NOT EXISTS (SELECT FROM orc_job_dependencies AS o
                        WHERE o.job_id = d.job_id AND o.awaited_id = p_replay);
    IF FOUND THEN
        UPDATE orc_jobs SET has_dependants = true WHERE id = p_replay AND NOT has_dependants;
        PERFORM orc_dependencies_settle_v1(ARRAY[p_replay]);
    END IF;
END;
$$;

-- A parent's dead letter resolved: its `wait` dependants follow it (a requeue: to the job
-- that replays it; a discard: cancelled).
CREATE OR REPLACE FUNCTION orc_dependencies_letter_resolved_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    doomed uuid[];
BEGIN
    IF NEW.state = 'requeued' THEN
        PERFORM orc_dependencies_hand_on_v1(NEW.job_id, NEW.requeued_job_id);
    ELSE
        SELECT array_agg(d.job_id) INTO doomed
          FROM orc_job_dependencies AS d JOIN orc_jobs AS c ON c.id = d.job_id
         WHERE d.awaited_id = NEW.job_id AND d.on_failure = 'wait' AND d.settled = 'FAILED'
           AND c.finished_at IS NULL;
        PERFORM orc_dependencies_cancel_v1(doomed, ARRAY[NEW.job_id])
          WHERE cardinality(doomed) > 0;
    END IF;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER orc_dead_letters_dependants
    AFTER UPDATE OF state ON orc_dead_letters
    FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state
                       AND NEW.state IN ('requeued', 'discarded'))
    EXECUTE FUNCTION orc_dependencies_letter_resolved_v1();

-- Cancel the jobs `p_jobs`, whose parents among `p_because` ended badly, and every unfinished
-- job below them that a `cancel` or `wait` edge ties to one of them, in one statement (a chain
-- of any length is one statement, not a trigger per level). Their `run` dependants are settled
-- by the trigger each cancelled job fires.
CREATE OR REPLACE FUNCTION orc_dependencies_cancel_v1(p_jobs uuid[], p_because uuid[])
RETURNS void
LANGUAGE sql AS $$
    WITH RECURSIVE doomed (job_id) AS (
        SELECT unnest(p_jobs)
        UNION
        SELECT d.job_id
          FROM orc_job_dependencies AS d JOIN doomed AS x ON d.awaited_id = x.job_id
         WHERE d.settled IS NULL AND d.on_failure IN ('cancel', 'wait')
    ), cancelled AS (
        UPDATE orc_jobs AS j SET status = 'CANCELLED'
         WHERE j.id IN (SELECT job_id FROM doomed) AND j.status = 'BLOCKED'
        RETURNING j.id
    )
    INSERT INTO orc_job_events (job_id, kind, payload)
    SELECT c.id, 'job.cancelled',
           orc_cancelled_event_v1(
               'a job it depends on ended: ' || array_to_string(p_because, ', '), 'dependencies')
      FROM cancelled AS c
$$;

-- Blocked jobs with nothing left to wait for (their counts deleted by the settle) become
-- PENDING, each with a dispatch (for `p_ats`, under its application's prefix `p_prefixes`) set
-- in the same UPDATE, and their job.unblocked. Set-based: a parent's end releasing 10,000
-- children is one statement of each kind (bench/workflows.py); one application's jobs, the
-- usual case, are deferred in one call.
-- Its plans are generic, made once per connection, and walk the jobs given by their ids
-- (every join here is by a key): planned anew on each call, as plpgsql did (a custom plan
-- looks cheaper for the arrays it is given), they cost a chain's link more than running them
-- (0.2-0.3 ms of a 2.4 ms link: a paired A/B of complete_and_fetch, docs/workflows.md), and a
-- 10,000-child release is no slower walking keys (0.73 s against 0.71).
CREATE OR REPLACE FUNCTION orc_dependencies_release_v2(
    p_jobs uuid[], p_ats timestamptz[], p_prefixes text[]
) RETURNS void
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off
AS $$
DECLARE
    kinds text[] := ARRAY(SELECT DISTINCT p FROM unnest(p_prefixes) AS p);
    prefix text;
    deferred bigint[];
BEGIN
    IF cardinality(kinds) = 1 THEN
        deferred := orc_defer_dispatches_v1(p_jobs, p_ats, kinds[1]);
    ELSE
        deferred := '{}';
        FOREACH prefix IN ARRAY kinds LOOP
            deferred := deferred || orc_defer_dispatches_v1(
                ARRAY(SELECT r.id FROM unnest(p_jobs, p_prefixes) AS r (id, p) WHERE r.p = prefix),
                ARRAY(SELECT r.at FROM unnest(p_ats, p_prefixes) AS r (at, p) WHERE r.p = prefix),
                prefix);
        END LOOP;
    END IF;
    WITH released AS (
        UPDATE orc_jobs AS j SET status = 'PENDING', procrastinate_job_id = p.id
          FROM procrastinate_jobs AS p
         WHERE p.id = ANY (deferred) AND j.id = (p.args ->> 'job_id')::uuid
        RETURNING j.id
    )
    INSERT INTO orc_job_events (job_id, kind, payload)
    SELECT d.job_id, 'job.unblocked',
           orc_unblocked_event_v1(array_agg(d.awaited_id ORDER BY d.ord),
                                  array_agg(d.settled ORDER BY d.ord))
      FROM orc_job_dependencies AS d
     WHERE d.job_id IN (SELECT r.id FROM released AS r)
     GROUP BY d.job_id;
END;
$$;

-- A job depended on ended: its dependants' edges are settled in the same transaction; if it was
-- cancelled, the children it spawned to be cancelled with it are.
CREATE OR REPLACE FUNCTION orc_dependants_settle_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'CANCELLED' THEN
        PERFORM orc_children_cancel_v1(NEW.id);
    END IF;
    PERFORM orc_dependencies_settle_v1(ARRAY[NEW.id]);
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER orc_jobs_dependants_settle
    AFTER UPDATE OF status ON orc_jobs
    FOR EACH ROW WHEN (OLD.has_dependants AND OLD.finished_at IS NULL
                       AND NEW.finished_at IS NOT NULL)
    EXECUTE FUNCTION orc_dependants_settle_v1();

-- A job cancelled while it waited leaves orc_job_waits (a released one left it with its release,
-- set-based: orc_dependencies_settle_v1).
CREATE OR REPLACE FUNCTION orc_job_wait_ended_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM orc_job_waits WHERE job_id = NEW.id;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER orc_jobs_wait_ended
    AFTER UPDATE OF status ON orc_jobs
    FOR EACH ROW WHEN (OLD.status = 'BLOCKED' AND NEW.status = 'CANCELLED')
    EXECUTE FUNCTION orc_job_wait_ended_v1();

-- A parent's wait for children it spawned (a step's wait_for), fenced by its lease: the
-- children are locked (so the end of one cannot pass unseen), and if some have not ended the
-- parent goes from RUNNING to BLOCKED, its lease released, waiting for them by the edges and
-- count dependencies use (kind `child`, policy `run`: it resumes when each has ended, however),
-- with job.waiting_for_children. Returns how many it waits for (0: none, it goes on), or null
-- when the lease is no longer the caller's. A child not spawned by the job is refused (ORCDP).
CREATE OR REPLACE FUNCTION orc_wait_for_children_v1(
    p_job_id uuid, p_lease_token uuid, p_children uuid[], p_task_prefix text
) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    stranger uuid;
    waiting integer;
BEGIN
    PERFORM FROM orc_jobs WHERE id = p_job_id AND status = 'RUNNING'
                            AND lease_token = p_lease_token
       FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    SELECT c INTO stranger FROM unnest(p_children) AS c
     WHERE NOT EXISTS (SELECT FROM orc_job_children AS k
                        WHERE k.parent_id = p_job_id AND k.child_id = c)
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'wait_for: % is not a child this job spawned', stranger
            USING ERRCODE = 'ORCDP', DETAIL = '0';
    END IF;
    PERFORM FROM orc_jobs WHERE id = ANY (p_children) ORDER BY id FOR NO KEY UPDATE;
    INSERT INTO orc_job_dependencies (job_id, awaited_id, kind, ord, on_failure)
    SELECT p_job_id, c.id, 'child', c.n, 'run'
      FROM unnest(p_children) WITH ORDINALITY AS c (id, n)
      JOIN orc_jobs AS j ON j.id = c.id AND j.finished_at IS NULL
    ON CONFLICT (job_id, awaited_id) DO UPDATE SET settled = NULL, ord = EXCLUDED.ord;
    GET DIAGNOSTICS waiting = ROW_COUNT;
    IF waiting = 0 THEN
        RETURN 0;
    END IF;
    UPDATE orc_jobs SET has_dependants = true
     WHERE id = ANY (p_children) AND finished_at IS NULL AND NOT has_dependants;
    INSERT INTO orc_job_waits (job_id, unsettled, task_prefix)
    VALUES (p_job_id, waiting, p_task_prefix);
    UPDATE orc_jobs SET status = 'BLOCKED', lease_token = NULL, locked_by = NULL,
                        heartbeat_at = NULL, deadline_at = NULL
     WHERE id = p_job_id;
    INSERT INTO orc_job_events (job_id, kind, payload)
    VALUES (p_job_id, 'job.waiting_for_children',
            orc_waiting_for_children_event_v1(p_children, waiting));
    RETURN waiting;
END;
$$;

-- The children `p_parent` spawned to be cancelled with it, those not ended, cancelled (their
-- attempts asked to stop, as an operator's cancel does), with job.cancelled.
CREATE OR REPLACE FUNCTION orc_children_cancel_v1(p_parent uuid) RETURNS void
LANGUAGE sql AS $$
    WITH cancelled AS (
        UPDATE orc_jobs AS j
           SET status = 'CANCELLED', next_retry_at = NULL, lease_token = NULL, locked_by = NULL,
               heartbeat_at = NULL
         WHERE j.id IN (SELECT k.child_id FROM orc_job_children AS k
                         WHERE k.parent_id = p_parent AND k.cancel_with_parent)
           AND j.finished_at IS NULL
        RETURNING j.id, j.procrastinate_job_id
    ), event AS (
        INSERT INTO orc_job_events (job_id, kind, payload)
        SELECT c.id, 'job.cancelled',
               orc_cancelled_event_v1('its parent was cancelled: ' || p_parent, 'dependencies')
          FROM cancelled AS c
    )
    SELECT procrastinate_cancel_job_v1(c.procrastinate_job_id, true, false)
      FROM cancelled AS c
     WHERE c.procrastinate_job_id IS NOT NULL
$$;
