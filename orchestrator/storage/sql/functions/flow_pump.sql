-- Flow control's pump (docs/flow-control.md): a key's line of waiters, handed its capacity in
-- fair order when it frees (a release, a waiter leaving, a reschedule), and a running job
-- parked in it.

-- Hand the key's capacity to its waiters, in fair order: a waiter that fits now gets a dispatch
-- now; one that fits at a known time (a window sliding, a pause ending) gets a dispatch for
-- then, as long as that time lies within the horizon (a second, or the interval if shorter)
-- of the soonest dispatch scheduled ahead (or of the first it schedules). Each waiter meets the
-- key as its type does: a provider's pause longer than its fallback threshold does not hold
-- back a job that can move to a fallback model, and while a pause lasts beyond the horizon only
-- those waiters are handed room, but for the head of the others, sent for the pause's end (its
-- admission then hands the rest on; the others wait for it without holding the line). A share at its cap (tenant_share) is passed over for the next share, its own head
-- sent for the time its spends slide out when that is known (even past the horizon: nothing
-- else would pump for it). Each waiter handed room is charged to its share. Returns how many
-- got a dispatch for now.
CREATE OR REPLACE FUNCTION orc_flow_pump_v1(p_key text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    k orc_flow_keys;
    seen orc_flow_keys;
    lim orc_flow_limits;
    held integer;
    held_cost bigint;
    waiter orc_flow_waiters;
    pick text;
    blocked text;
    wake timestamptz;
    capped_by text;
    capped_until timestamptz;
    horizon timestamptz;  -- no dispatch is scheduled later than this (but a capped share's)
    pass_only boolean := false;  -- a provider's pause past the horizon: only who can pass it
    now_ids uuid[] := '{}';
    later_ids uuid[] := '{}';
    later_at timestamptz[] := '{}';
    busy uuid[] := '{}';  -- waiters another transaction holds (a cancel): left for later
    capped text[] := '{}';  -- shares at their cap, with no known time their room frees
    cost bigint;
    floor_vtime double precision;
BEGIN
    PERFORM orc_flow_lock_v1(p_key);
    SELECT * INTO k FROM orc_flow_keys WHERE key = p_key;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    SELECT * INTO lim FROM orc_flow_limits WHERE name = k.limit_name;
    lim := orc_flow_limit_of_v1(k, lim);
    IF lim.name IS NOT NULL THEN
        k := orc_flow_expire_v1(k, lim);
    END IF;
    SELECT count(*), coalesce(sum(w.cost), 0) INTO held, held_cost
      FROM orc_flow_waiters AS w
     WHERE w.key = p_key AND w.dispatched_at IS NOT NULL
       AND NOT (w.blocked_on = 'share' AND w.dispatched_at > clock_timestamp());
    pass_only := lim.name IS NOT NULL
                 AND coalesce(k.paused_until > clock_timestamp()
                                               + make_interval(secs => least(lim.interval_seconds, 1)),
                              false);
    FOR i IN 1 .. 500 LOOP  -- bounded: a later release or the safety net pumps the rest
        SELECT s.share INTO pick
          FROM orc_flow_shares AS s
         WHERE s.key = p_key AND s.share <> ALL (capped)
           AND EXISTS (SELECT FROM orc_flow_waiters AS w
                        WHERE w.key = p_key AND w.share = s.share AND w.dispatched_at IS NULL
                          AND w.job_id <> ALL (busy)
                          AND (NOT pass_only
                               OR orc_flow_passes_pause_v1(k, (SELECT j.job_type FROM orc_jobs AS j
                                                                WHERE j.id = w.job_id))))
         ORDER BY s.vtime, s.share
         LIMIT 1;
        EXIT WHEN pick IS NULL;
        SELECT w.* INTO waiter
          FROM orc_flow_waiters AS w
         WHERE w.key = p_key AND w.share = pick AND w.dispatched_at IS NULL
           AND w.job_id <> ALL (busy)
           AND (NOT pass_only
                OR orc_flow_passes_pause_v1(k, (SELECT j.job_type FROM orc_jobs AS j
                                                 WHERE j.id = w.job_id)))
         ORDER BY w.priority, w.seq  -- within a share: by the jobs' priority, then in turn
         LIMIT 1;
        -- The key is locked before the job here (the gate locks them the other way round), so
        -- a waiter another transaction holds is skipped rather than waited for.
        PERFORM FROM orc_jobs AS j WHERE j.id = waiter.job_id FOR NO KEY UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            busy := busy || waiter.job_id;
            CONTINUE;
        END IF;
        blocked := NULL;
        wake := NULL;
        capped_by := NULL;
        capped_until := NULL;
        seen := k;  -- the key as this waiter meets it: a long pause passed by its fallback
        IF k.paused_until > clock_timestamp()
           AND orc_flow_passes_pause_v1(k, (SELECT j.job_type FROM orc_jobs AS j
                                             WHERE j.id = waiter.job_id)) THEN
            seen.paused_until := NULL;
        END IF;
        cost := waiter.cost;
        IF lim.name IS NOT NULL THEN  -- (a limit no longer configured holds nothing back)
            cost := orc_flow_estimate_v1(waiter.cost, lim);
            SELECT c.blocked, c.wake INTO blocked, wake
              FROM orc_flow_capacity_v1(seen, lim, cost, held, held_cost) AS c;
            EXIT WHEN blocked IS NOT NULL AND wake IS NULL;  -- room comes with a release or
                                                             -- an admission, which pump
            IF lim.tenant_share IS NOT NULL THEN
                SELECT c.blocked, c.wake INTO capped_by, capped_until
                  FROM (SELECT count(*) AS n, coalesce(sum(w.cost), 0) AS units
                          FROM orc_flow_waiters AS w
                         WHERE w.key = p_key AND w.share = pick
                           AND w.dispatched_at IS NOT NULL) AS h,
                       orc_flow_share_capacity_v1(seen, lim, pick, cost, h.n::integer,
                                                  h.units::bigint) AS c;
                IF capped_by IS NOT NULL AND capped_until IS NULL THEN
                    capped := capped || pick;  -- the next share's turn
                    CONTINUE;
                END IF;
            END IF;
        END IF;
        IF blocked IS NOT NULL THEN
            -- Waiters freed within 50 ms of each other share one due time (one wake-up).
            wake := to_timestamp(ceil(extract(epoch FROM wake) * 20) / 20);
            IF horizon IS NULL THEN
                SELECT least(wake, min(w.dispatched_at)) INTO horizon
                  FROM orc_flow_waiters AS w
                 WHERE w.key = p_key AND w.dispatched_at > clock_timestamp();
                horizon := greatest(horizon, clock_timestamp())
                           + make_interval(secs => least(lim.interval_seconds, 1));
            END IF;
            EXIT WHEN wake > horizon;  -- the admission of one sent ahead pumps again
        END IF;
        PERFORM orc_flow_charge_v1(p_key, pick, orc_flow_charged_v1(cost, lim), lim);
        IF capped_by IS NOT NULL THEN
            -- Its share's room frees at a known time: sent for then, holding nothing of the
            -- key's until then (its claim decides on the key as it is at that time).
            wake := greatest(wake, to_timestamp(ceil(extract(epoch FROM capped_until) * 20) / 20));
            capped := capped || pick;  -- (its next ones wait for its admission's pump)
            UPDATE orc_flow_waiters SET dispatched_at = wake, blocked_on = 'share'
             WHERE job_id = waiter.job_id;
        ELSE
            UPDATE orc_flow_waiters SET dispatched_at = coalesce(wake, now())
             WHERE job_id = waiter.job_id;
            held := held + 1;
            held_cost := held_cost + cost;
        END IF;
        IF wake IS NULL THEN
            now_ids := now_ids || waiter.job_id;
        ELSE
            later_ids := later_ids || waiter.job_id;
            later_at := later_at || wake;
        END IF;
    END LOOP;
    -- A pause beyond the horizon: the head of the line of those who cannot pass it is sent for
    -- its end (or for when its room comes after it), beyond the horizon, so that its admission
    -- then pumps the key and hands the rest on: with nothing of the key running, nothing else
    -- would. Only the head: those sent for the pause's end would hold room that the jobs
    -- passing the pause are handed meanwhile. Not when a waiter already goes at or after the
    -- pause's end (its admission pumps).
    IF pass_only AND NOT EXISTS (SELECT FROM orc_flow_waiters AS w
                                  WHERE w.key = p_key AND w.dispatched_at >= k.paused_until) THEN
        FOR waiter IN
            SELECT w.*
              FROM orc_flow_waiters AS w
              LEFT JOIN orc_flow_shares AS s ON s.key = w.key AND s.share = w.share
             WHERE w.key = p_key AND w.dispatched_at IS NULL AND w.job_id <> ALL (busy)
               AND NOT orc_flow_passes_pause_v1(k, (SELECT j.job_type FROM orc_jobs AS j
                                                     WHERE j.id = w.job_id))
             ORDER BY coalesce(s.vtime, 0), w.share, w.priority, w.seq
             LIMIT 10  -- (the first not held by another transaction)
        LOOP
            PERFORM FROM orc_jobs AS j WHERE j.id = waiter.job_id FOR NO KEY UPDATE SKIP LOCKED;
            CONTINUE WHEN NOT FOUND;
            cost := orc_flow_estimate_v1(waiter.cost, lim);
            SELECT c.wake INTO wake FROM orc_flow_capacity_v1(k, lim, cost, held, held_cost) AS c;
            EXIT WHEN wake IS NULL;  -- its room comes with a release or an admission, which pump
            wake := to_timestamp(ceil(extract(epoch FROM wake) * 20) / 20);
            PERFORM orc_flow_charge_v1(p_key, waiter.share, orc_flow_charged_v1(cost, lim), lim);
            UPDATE orc_flow_waiters SET dispatched_at = wake WHERE job_id = waiter.job_id;
            later_ids := later_ids || waiter.job_id;
            later_at := later_at || wake;
            EXIT;
        END LOOP;
    END IF;
    IF cardinality(now_ids) + cardinality(later_ids) > 0 THEN
        PERFORM orc_flow_dispatch_v2(now_ids || later_ids,
                                     array_fill(NULL::timestamptz, ARRAY[cardinality(now_ids)])
                                     || later_at,
                                     k.task_prefix);
    END IF;
    -- A share that waits again starts level with the others, not with credit saved up.
    SELECT min(s.vtime) INTO floor_vtime
      FROM orc_flow_shares AS s
     WHERE s.key = p_key
       AND EXISTS (SELECT FROM orc_flow_waiters AS w
                    WHERE w.key = p_key AND w.share = s.share AND w.dispatched_at IS NULL);
    DELETE FROM orc_flow_shares AS s
     WHERE s.key = p_key AND s.vtime < coalesce(floor_vtime, 'infinity')
       AND NOT EXISTS (SELECT FROM orc_flow_waiters AS w
                        WHERE w.key = p_key AND w.share = s.share);
    RETURN cardinality(now_ids);
END;
$$;

-- A job of a key leaves RUNNING: its capacity goes to the key's waiters, if any wait.
CREATE OR REPLACE FUNCTION orc_flow_release_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT FROM orc_flow_waiters AS w
                WHERE w.key = OLD.flow_key AND w.dispatched_at IS NULL) THEN
        PERFORM orc_flow_pump_v1(OLD.flow_key);
    END IF;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER orc_jobs_flow_release
    AFTER UPDATE OF status ON orc_jobs
    FOR EACH ROW
    WHEN (OLD.flow_key IS NOT NULL AND OLD.status = 'RUNNING' AND NEW.status <> 'RUNNING')
    EXECUTE FUNCTION orc_flow_release_v1();

-- A waiting job that finishes (cancelled; failed by an operator) leaves the line; if it was
-- the one on its way, the next one is sent.
CREATE OR REPLACE FUNCTION orc_flow_leave_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    gone orc_flow_waiters;
BEGIN
    DELETE FROM orc_flow_waiters WHERE job_id = NEW.id RETURNING * INTO gone;
    IF gone.dispatched_at IS NOT NULL THEN
        PERFORM orc_flow_pump_v1(gone.key);
    END IF;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER orc_jobs_flow_leave
    AFTER UPDATE OF status ON orc_jobs
    FOR EACH ROW
    WHEN (OLD.flow_key IS NOT NULL AND NEW.finished_at IS NOT NULL AND OLD.finished_at IS NULL)
    EXECUTE FUNCTION orc_flow_leave_v1();

-- Hand the key's capacity out afresh, as the key stands now: after its pause changed (set,
-- shortened, extended, lifted) or its limit did, and when the safety net's backstop finds a
-- waiter whose time was lost or is later than the key explains. Each waiter sent for a time
-- still to come (its dispatch waiting for that time), or whose dispatch is gone, comes back to
-- its place in line, its share's virtual time given back; one whose dispatch is due, or that a
-- worker is claiming, is left to its claim (which parks it again if it finds no room). Then the
-- key is pumped. Neither a waiter nor its dispatch that another transaction holds is waited
-- for. How many waiters got a dispatch for now.
CREATE OR REPLACE FUNCTION orc_flow_reschedule_v1(p_key text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    lim orc_flow_limits;
    scout record;
    due timestamptz;
BEGIN
    PERFORM orc_flow_lock_v1(p_key);
    SELECT (orc_flow_limit_of_v1(k, l)).* INTO lim
      FROM orc_flow_keys AS k JOIN orc_flow_limits AS l ON l.name = k.limit_name
     WHERE k.key = p_key;
    FOR scout IN
        SELECT w.job_id, w.share, w.cost, j.procrastinate_job_id AS dispatch_id
          FROM orc_flow_waiters AS w JOIN orc_jobs AS j ON j.id = w.job_id
         WHERE w.key = p_key AND w.dispatched_at IS NOT NULL
           FOR NO KEY UPDATE OF j SKIP LOCKED
    LOOP
        SELECT coalesce(p.scheduled_at, '-infinity') INTO due
          FROM procrastinate_jobs AS p
         WHERE p.id = scout.dispatch_id AND p.status = 'todo'
           FOR UPDATE SKIP LOCKED;
        IF FOUND THEN
            CONTINUE WHEN due <= now();  -- due: its claim decides
            PERFORM procrastinate_cancel_job_v1(scout.dispatch_id, false, true);
        ELSIF EXISTS (SELECT FROM procrastinate_jobs AS p
                       WHERE p.id = scout.dispatch_id AND p.status IN ('todo', 'doing')) THEN
            CONTINUE;  -- a worker has it (or is fetching it): its claim decides
        END IF;
        UPDATE orc_flow_waiters SET dispatched_at = NULL WHERE job_id = scout.job_id;
        UPDATE orc_jobs SET procrastinate_job_id = NULL WHERE id = scout.job_id;
        PERFORM orc_flow_charge_v1(
            p_key, scout.share, -orc_flow_charged_v1(orc_flow_estimate_v1(scout.cost, lim), lim),
            lim);
    END LOOP;
    RETURN orc_flow_pump_v1(p_key);
END;
$$;

-- A share of `p_key` that starts waiting starts level with the shares already waiting (the
-- lowest virtual time among them), so time it spent idle buys it no run of turns; a share
-- already waiting keeps its own. Called as a job joins its key's line: at its claim, and as a
-- running job parks.
CREATE OR REPLACE FUNCTION orc_flow_share_waits_v1(p_key text, p_share text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    floor_vtime double precision;
BEGIN
    SELECT min(s.vtime) INTO floor_vtime
      FROM orc_flow_shares AS s
     WHERE s.key = p_key
       AND EXISTS (SELECT FROM orc_flow_waiters AS w
                    WHERE w.key = p_key AND w.share = s.share AND w.dispatched_at IS NULL);
    INSERT INTO orc_flow_shares AS s (key, share, vtime)
    VALUES (p_key, p_share, coalesce(floor_vtime, 0))
    ON CONFLICT (key, share) DO UPDATE
       SET vtime = greatest(s.vtime, coalesce(floor_vtime, s.vtime))
     WHERE NOT EXISTS (SELECT FROM orc_flow_waiters AS w
                        WHERE w.key = s.key AND w.share = s.share AND w.dispatched_at IS NULL);
END;
$$;

-- A running job whose next call would wait long for its room gives its worker slot back
-- (fenced by its lease): PENDING again, no budget used, its cost the call's estimate, a waiter of
-- its key (`p_blocked`: requests, units, share or paused) whom the pump hands a dispatch when
-- its room frees; the claim then admits the call. `p_release`: the claim's reservation, which no
-- call used, leaves the window (and its share's charge). `p_not_before`: seconds from now before
-- which its call cannot go (its room on a fallback model's key); the waiter is sent for then,
-- and, while its own key is paused, for the pause's end at the soonest: a job whose call could
-- not go where its pass through the pause led is not let through it again at once. False: the
-- lease was gone.
CREATE OR REPLACE FUNCTION orc_flow_park_v2(
    p_job_id uuid, p_lease_token uuid, p_sources text[], p_cost bigint, p_blocked text,
    p_release boolean, p_not_before double precision
) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    j orc_jobs;
    k orc_flow_keys;
    lim orc_flow_limits;
    unused orc_flow_spends;
    until timestamptz := clock_timestamp() + make_interval(secs => p_not_before);
BEGIN
    UPDATE orc_jobs
       SET status = 'PENDING', next_retry_at = NULL, lease_token = NULL, locked_by = NULL,
           heartbeat_at = NULL, procrastinate_job_id = NULL,
           flow_cost = greatest(1, least(p_cost, 2147483647))
     WHERE id = p_job_id AND lease_token = p_lease_token AND status = ANY (p_sources)
       AND flow_key IS NOT NULL
    RETURNING * INTO j;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM orc_flow_lock_v1(j.flow_key);
    SELECT * INTO k FROM orc_flow_keys WHERE key = j.flow_key;
    SELECT * INTO lim FROM orc_flow_limits WHERE name = k.limit_name;
    IF p_release THEN
        DELETE FROM orc_flow_spends
         WHERE id = (SELECT max(s.id) FROM orc_flow_spends AS s
                      WHERE s.job_id = j.id AND s.key = j.flow_key AND NOT s.reconciled)
        RETURNING * INTO unused;
        UPDATE orc_flow_keys
           SET window_requests = greatest(0, window_requests - unused.requests),
               window_units = greatest(0, window_units - unused.units)
         WHERE key = j.flow_key AND unused.id IS NOT NULL;
        IF unused.id IS NOT NULL THEN
            PERFORM orc_flow_charge_v1(j.flow_key, j.flow_share,
                                       -orc_flow_charged_v1(unused.units, lim), lim);
        END IF;
    END IF;
    IF k.paused_until > clock_timestamp() THEN
        until := greatest(until, k.paused_until);
    END IF;
    PERFORM orc_flow_share_waits_v1(j.flow_key, coalesce(j.flow_share, ''));
    INSERT INTO orc_flow_waiters (job_id, key, share, cost, blocked_on, dispatched_at, priority)
    VALUES (j.id, j.flow_key, coalesce(j.flow_share, ''), j.flow_cost, p_blocked, until,
            j.priority);
    INSERT INTO orc_job_events (job_id, kind, payload)
    VALUES (j.id, 'job.waiting_for_capacity',
            orc_waiting_for_capacity_event_v1(j, p_blocked));
    IF until IS NOT NULL THEN  -- sent for then, charged as the pump charges whom it sends
        PERFORM orc_flow_charge_v1(j.flow_key, j.flow_share,
                                   orc_flow_charged_v1(orc_flow_estimate_v1(j.flow_cost, lim), lim),
                                   lim);
        PERFORM orc_flow_dispatch_v2(ARRAY[j.id], ARRAY[until], k.task_prefix);
        RETURN true;
    END IF;
    PERFORM orc_flow_pump_v1(j.flow_key);  -- its room may be known: it is sent for then
    RETURN true;
END;
$$;
