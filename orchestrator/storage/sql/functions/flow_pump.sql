-- Flow control's pump (docs/flow-control.md): a key's line of waiters, handed its capacity in
-- fair order when it frees (a release, a waiter leaving, a reschedule). The pump (orc_flow_pump_v1) is a sequence of steps, each a function of its
-- own below it: the next waiter in fair order, the room it meets, the horizon, the waiter
-- handed room now or for later, the head of a long pause's line, the shares' bookkeeping.

-- A time rounded up to the pump's tick of 50 ms: waiters freed within 50 ms of each other
-- share one due time, so the workers wake once for them.
CREATE OR REPLACE FUNCTION orc_flow_tick_v1(p_at timestamptz) RETURNS timestamptz
LANGUAGE sql STABLE AS $$
    SELECT to_timestamp(ceil(extract(epoch FROM p_at) * 20) / 20)
$$;

-- How far ahead of the soonest dispatch scheduled the pump schedules: a second, or the key's
-- interval if shorter. A pause that lasts longer than this is past the pump's horizon.
CREATE OR REPLACE FUNCTION orc_flow_lookahead_v1(lim orc_flow_limits) RETURNS interval
LANGUAGE sql IMMUTABLE AS $$
    SELECT make_interval(secs => least(lim.interval_seconds, 1))
$$;

-- The pump's horizon, fixed at the first waiter it sends for later (at `p_wake`): no waiter is
-- sent for a time past it (but one whose share's room comes later, and a long pause's head).
-- The lookahead past the soonest dispatch scheduled ahead, or past `p_wake` if sooner, and
-- never from a time already gone: the schedule keeps only so far ahead, and each admission of
-- a waiter sent ahead pumps again.
CREATE OR REPLACE FUNCTION orc_flow_horizon_v1(p_key text, p_wake timestamptz, lim orc_flow_limits)
RETURNS timestamptz
LANGUAGE sql STABLE AS $$
    SELECT greatest(least(p_wake, min(w.dispatched_at)), clock_timestamp())
           + orc_flow_lookahead_v1(lim)
      FROM orc_flow_waiters AS w
     WHERE w.key = p_key AND w.dispatched_at > clock_timestamp()
$$;

-- The next waiter of the key's line the pump considers, in fair order: the head (by its job's
-- priority, then in turn) of the share with the lowest virtual time that has one, among the
-- shares not `p_capped` (at their cap: passed over for the next share) and the waiters not
-- `p_busy` (held by another transaction: left for later). With `p_pass_only` (a provider's
-- pause past the horizon), among the waiters whose type can pass the pause only. Null: none.
-- (PL/pgSQL, so that its plan is kept for the pump's every turn.)
CREATE OR REPLACE FUNCTION orc_flow_next_waiter_v1(
    k orc_flow_keys, p_pass_only boolean, p_capped text[], p_busy uuid[]
) RETURNS orc_flow_waiters
LANGUAGE plpgsql STABLE AS $$
DECLARE
    head orc_flow_waiters;
BEGIN
    SELECT h.* INTO head
      FROM orc_flow_shares AS s
     CROSS JOIN LATERAL (
            SELECT w.*
              FROM orc_flow_waiters AS w
             WHERE w.key = s.key AND w.share = s.share AND w.dispatched_at IS NULL
               AND w.job_id <> ALL (p_busy)
               AND (NOT p_pass_only
                    OR orc_flow_passes_pause_v1(k, (SELECT j.job_type FROM orc_jobs AS j
                                                     WHERE j.id = w.job_id)))
             ORDER BY w.priority, w.seq
             LIMIT 1) AS h
     WHERE s.key = k.key AND s.share <> ALL (p_capped)
     ORDER BY s.vtime, s.share
     LIMIT 1;
    RETURN head;
END;
$$;

-- The room the waiter `w` meets on the key (`k` under `lim`, expired), beside the `p_held`
-- waiters (of `p_held_cost` units) that hold a dispatch: `cost`, its estimate under the limit;
-- `blocked` and `wake`, the key's answer (orc_flow_capacity_v1) as the waiter's type meets it
-- (a provider's pause longer than its fallback threshold does not hold back a job that can move
-- to a fallback model); under a limit that caps shares, `capped_by` and `capped_until`, its
-- share's answer (orc_flow_share_capacity_v1), beside the share's waiters that hold a dispatch.
-- Times on the pump's tick. The share is not asked when the key's room comes only with a
-- release or an admission (no `wake`): the pump stops there. Nothing holds a waiter back under a
-- limit no longer configured.
CREATE OR REPLACE FUNCTION orc_flow_waiter_room_v1(
    k orc_flow_keys, lim orc_flow_limits, w orc_flow_waiters, p_held integer, p_held_cost bigint,
    OUT cost bigint, OUT blocked text, OUT wake timestamptz, OUT capped_by text,
    OUT capped_until timestamptz
)
LANGUAGE plpgsql AS $$
DECLARE
    seen orc_flow_keys := k;  -- the key as this waiter meets it: a long pause passed by its fallback
BEGIN
    cost := w.cost;
    IF lim.name IS NULL THEN
        RETURN;
    END IF;
    IF k.paused_until > clock_timestamp()
       AND orc_flow_passes_pause_v1(k, (SELECT j.job_type FROM orc_jobs AS j WHERE j.id = w.job_id))
    THEN
        seen.paused_until := NULL;
    END IF;
    cost := orc_flow_estimate_v1(w.cost, lim);
    SELECT c.blocked, orc_flow_tick_v1(c.wake) INTO blocked, wake
      FROM orc_flow_capacity_v1(seen, lim, cost, p_held, p_held_cost) AS c;
    IF lim.tenant_share IS NOT NULL AND (blocked IS NULL OR wake IS NOT NULL) THEN
        SELECT c.blocked, orc_flow_tick_v1(c.wake) INTO capped_by, capped_until
          FROM (SELECT count(*) AS n, coalesce(sum(o.cost), 0) AS units
                  FROM orc_flow_waiters AS o
                 WHERE o.key = k.key AND o.share = w.share AND o.dispatched_at IS NOT NULL) AS h,
               orc_flow_share_capacity_v1(seen, lim, w.share, cost, h.n::integer,
                                          h.units::bigint) AS c;
    END IF;
END;
$$;

-- The waiter `w` handed room: charged `p_cost` to its share (as every start is), and sent for
-- `p_at` (null: now). With `p_share_until` (its share's room frees only then: orc_flow_waiter_room_v1's
-- `capped_until`), sent for then (or for `p_at`, if later), holding nothing of the key's until
-- then (its claim decides on the key as it is at that time). When it was sent for (null: now).
CREATE OR REPLACE FUNCTION orc_flow_hand_v1(
    w orc_flow_waiters, lim orc_flow_limits, p_cost bigint, p_at timestamptz,
    p_share_until timestamptz
) RETURNS timestamptz
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM orc_flow_charge_v1(w.key, w.share, orc_flow_charged_v1(p_cost, lim), lim);
    IF p_share_until IS NOT NULL THEN
        p_at := greatest(p_at, p_share_until);
        UPDATE orc_flow_waiters SET dispatched_at = p_at, blocked_on = 'share'
         WHERE job_id = w.job_id;
    ELSE
        UPDATE orc_flow_waiters SET dispatched_at = coalesce(p_at, now()) WHERE job_id = w.job_id;
    END IF;
    RETURN p_at;
END;
$$;

-- A pause past the horizon, during which the pump hands room only to the waiters that can pass
-- it: the head of the line of those who cannot is sent for its end (or for when its room comes
-- after it), however far off, so that its admission then pumps the key and hands the rest on:
-- with nothing of the key running, nothing else would. Only the head: those sent for the
-- pause's end would hold room that the jobs passing the pause are handed meanwhile. Nobody when
-- a waiter already goes at or after the pause's end (its admission pumps), when the head's room
-- comes only with a release or an admission, or when the first ten are held by other
-- transactions. The waiter sent (`sent`, its job) and its time (`sent_at`).
CREATE OR REPLACE FUNCTION orc_flow_pause_head_v1(
    k orc_flow_keys, lim orc_flow_limits, p_held integer, p_held_cost bigint, p_busy uuid[],
    OUT sent uuid, OUT sent_at timestamptz
)
LANGUAGE plpgsql AS $$
DECLARE
    waiter orc_flow_waiters;
    cost bigint;
    wake timestamptz;
BEGIN
    IF EXISTS (SELECT FROM orc_flow_waiters AS w
                WHERE w.key = k.key AND w.dispatched_at >= k.paused_until) THEN
        RETURN;
    END IF;
    FOR waiter IN
        SELECT w.*
          FROM orc_flow_waiters AS w
          LEFT JOIN orc_flow_shares AS s ON s.key = w.key AND s.share = w.share
         WHERE w.key = k.key AND w.dispatched_at IS NULL AND w.job_id <> ALL (p_busy)
           AND NOT orc_flow_passes_pause_v1(k, (SELECT j.job_type FROM orc_jobs AS j
                                                 WHERE j.id = w.job_id))
         ORDER BY coalesce(s.vtime, 0), w.share, w.priority, w.seq
         LIMIT 10  -- (the first not held by another transaction)
    LOOP
        PERFORM FROM orc_jobs AS j WHERE j.id = waiter.job_id FOR NO KEY UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;
        cost := orc_flow_estimate_v1(waiter.cost, lim);
        SELECT c.wake INTO wake FROM orc_flow_capacity_v1(k, lim, cost, p_held, p_held_cost) AS c;
        IF wake IS NOT NULL THEN  -- (else its room comes with a release or an admission, which pump)
            sent := waiter.job_id;
            sent_at := orc_flow_hand_v1(waiter, lim, cost, orc_flow_tick_v1(wake), NULL);
        END IF;
        RETURN;
    END LOOP;
END;
$$;

-- The lowest virtual time among the key's shares with waiters in line (null: none waits):
-- where a share that starts waiting starts (orc_flow_share_waits_v1).
CREATE OR REPLACE FUNCTION orc_flow_floor_vtime_v1(p_key text) RETURNS double precision
LANGUAGE sql STABLE AS $$
    SELECT min(s.vtime)
      FROM orc_flow_shares AS s
     WHERE s.key = p_key
       AND EXISTS (SELECT FROM orc_flow_waiters AS w
                    WHERE w.key = p_key AND w.share = s.share AND w.dispatched_at IS NULL)
$$;

-- The shares' bookkeeping after a pump: a share with no waiter left whose virtual time is
-- behind the floor of those still waiting loses its row, so that when it waits again it starts
-- level with the others (orc_flow_share_waits_v1), not with credit saved up.
CREATE OR REPLACE FUNCTION orc_flow_shares_settle_v1(p_key text) RETURNS void
LANGUAGE sql AS $$
    DELETE FROM orc_flow_shares AS s
     USING (SELECT orc_flow_floor_vtime_v1(p_key) AS vtime) AS f
     WHERE s.key = p_key AND s.vtime < coalesce(f.vtime, 'infinity')
       AND NOT EXISTS (SELECT FROM orc_flow_waiters AS w
                        WHERE w.key = p_key AND w.share = s.share)
$$;

-- Hand the key's capacity to its waiters, in fair order: a waiter that fits now gets a dispatch
-- now; one that fits at a known time (a window sliding, a pause ending) gets a dispatch for
-- then, as long as that time lies within the horizon (orc_flow_horizon_v1). Each waiter meets
-- the key as its type does, and while a provider's pause lasts beyond the horizon only the
-- waiters that can pass it are handed room, but for the head of the others, sent for the
-- pause's end (orc_flow_pause_head_v1). A share at its cap (tenant_share) is passed over for the
-- next share, its own head sent for the time its spends slide out when that is known (even past
-- the horizon: nothing else would pump for it). Each waiter handed room is charged to its share.
-- Returns how many got a dispatch for now.
CREATE OR REPLACE FUNCTION orc_flow_pump_v1(p_key text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    k orc_flow_keys;
    lim orc_flow_limits;
    held integer;  -- the waiters that hold a dispatch, and their units
    held_cost bigint;
    pass_only boolean;  -- a provider's pause past the horizon: only who can pass it
    waiter orc_flow_waiters;
    room record;
    wake timestamptz;
    horizon timestamptz;  -- fixed at the first waiter sent for later
    head record;
    now_ids uuid[] := '{}';
    later_ids uuid[] := '{}';
    later_at timestamptz[] := '{}';
    busy uuid[] := '{}';  -- waiters another transaction holds (a cancel): left for later
    capped text[] := '{}';  -- shares at their cap, or whose next waits for their head's admission
BEGIN
    -- 1. The key as it stands, under its lock: its limit as it meets it, its window expired.
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
    -- 2. What the waiters sent already hold (but those sent for their share's room).
    SELECT count(*), coalesce(sum(w.cost), 0) INTO held, held_cost
      FROM orc_flow_waiters AS w
     WHERE w.key = p_key AND w.dispatched_at IS NOT NULL
       AND NOT (w.blocked_on = 'share' AND w.dispatched_at > clock_timestamp());
    pass_only := lim.name IS NOT NULL
                 AND coalesce(k.paused_until > clock_timestamp() + orc_flow_lookahead_v1(lim), false);
    -- 3. Each next waiter in fair order, handed room now or for later, until one finds none
    -- within the horizon (bounded: a later release or the safety net pumps the rest).
    FOR i IN 1 .. 500 LOOP
        waiter := orc_flow_next_waiter_v1(k, pass_only, capped, busy);
        EXIT WHEN waiter.job_id IS NULL;
        -- The key is locked before the job here (the gate locks them the other way round), so
        -- a waiter another transaction holds is skipped rather than waited for.
        PERFORM FROM orc_jobs AS j WHERE j.id = waiter.job_id FOR NO KEY UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            busy := busy || waiter.job_id;
            CONTINUE;
        END IF;
        room := orc_flow_waiter_room_v1(k, lim, waiter, held, held_cost);
        EXIT WHEN room.blocked IS NOT NULL AND room.wake IS NULL;  -- room comes with a release
                                                                   -- or an admission, which pump
        IF room.capped_by IS NOT NULL AND room.capped_until IS NULL THEN
            capped := capped || waiter.share;  -- the next share's turn
            CONTINUE;
        END IF;
        IF room.blocked IS NOT NULL THEN
            horizon := coalesce(horizon, orc_flow_horizon_v1(p_key, room.wake, lim));
            EXIT WHEN room.wake > horizon;  -- the admission of one sent ahead pumps again
        END IF;
        wake := orc_flow_hand_v1(waiter, lim, room.cost, room.wake, room.capped_until);
        IF room.capped_until IS NOT NULL THEN
            capped := capped || waiter.share;  -- (its next ones wait for its admission's pump)
        ELSE
            held := held + 1;
            held_cost := held_cost + room.cost;
        END IF;
        IF wake IS NULL THEN
            now_ids := now_ids || waiter.job_id;
        ELSE
            later_ids := later_ids || waiter.job_id;
            later_at := later_at || wake;
        END IF;
    END LOOP;
    -- 4. A pause past the horizon: the head of the line of those who cannot pass it.
    IF pass_only THEN
        head := orc_flow_pause_head_v1(k, lim, held, held_cost, busy);
        IF head.sent IS NOT NULL THEN
            later_ids := later_ids || head.sent;
            later_at := later_at || head.sent_at;
        END IF;
    END IF;
    -- 5. Their dispatches, for now and for later; 6. the shares' bookkeeping.
    IF cardinality(now_ids) + cardinality(later_ids) > 0 THEN
        PERFORM orc_flow_dispatch_v2(now_ids || later_ids,
                                     array_fill(NULL::timestamptz, ARRAY[cardinality(now_ids)])
                                     || later_at,
                                     k.task_prefix);
    END IF;
    PERFORM orc_flow_shares_settle_v1(p_key);
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
