-- 0031_flow_capacity_ahead: a key's pump hands on the capacity of the coming second ahead of
-- time (docs/flow-control.md, "Handing capacity on").
--
-- compatible-with-older-workers: yes
--
-- Until now a window that was full had one waiter (a "scout") dispatched for the instant the
-- window's oldest spend slid out; the next waiters got their dispatches only when that one
-- ended and its release pumped the key. Each freed request thus waited for a dispatch, a
-- wake-up, a claim and a call before the next one was handed on, and the lag was lost at every
-- slide: about a tenth of a 10 s window's allowance in the storm benchmark.
--
-- Now the pump gives each waiter, in fair order, a dispatch for the time its own capacity
-- frees (the instant enough of the window's spends have slid out to fit it and every waiter
-- dispatched before it), rounded up to the next 50 ms so that waiters freed together wake the
-- workers once, for as long as that time lies within a second (or the interval, if shorter)
-- of the first one it schedules or of the soonest one already scheduled. Every admission of
-- such a waiter pumps again, so the schedule keeps a second ahead while capacity keeps
-- sliding free. Nothing is admitted early: the gate still decides at the claim on the exact
-- window, and a waiter that comes due without room (a pause began, another job took the room)
-- goes back to its old place in line.
--
-- orc_flow_waiters.dispatched_at now says when the waiter's dispatch comes due (the past for
-- one on its way now, the future for one scheduled ahead). A claim counts as held only the
-- waiters due by then, and a job that is not a waiter waits in line behind one scheduled
-- ahead. A paused key's waiters are scheduled for the end of the pause, or later when the
-- window is full then.
--
-- Compatible with older workers: functions replaced with the same signatures (the previous
-- release calls only the fetch and claim functions, which call these), and
-- orc_flow_dispatch_v1, which only the replaced pump called, dropped.

-- Can one more job of `p_cost` start on the key now, beyond the `p_held` jobs (of `p_held_cost`
-- units) that hold a dispatch for it? (NULL, NULL): yes; else what it waits for and, where that
-- is known, the earliest time it can: a pause's end, or when enough of the window has slid out
-- (whichever is later). Not known: for a concurrency limit (its room comes with a release), and
-- when the window's spends cannot make room for the held jobs and this one (its room comes
-- with spends the held jobs have yet to make: their admissions pump the key).
CREATE OR REPLACE FUNCTION orc_flow_capacity_v1(
    k orc_flow_keys, lim orc_flow_limits, p_cost bigint, p_held integer, p_held_cost bigint,
    OUT blocked text, OUT wake timestamptz
)
LANGUAGE plpgsql AS $$
DECLARE
    factor double precision := orc_flow_factor_v1(k, lim);
    allowed bigint;
    running integer;
    cost bigint;
    slid_at timestamptz;
    known boolean := true;
BEGIN
    IF lim.concurrency IS NOT NULL THEN
        allowed := greatest(1, floor(lim.concurrency * factor));
        SELECT count(*) INTO running
          FROM (SELECT FROM orc_jobs AS j
                 WHERE j.flow_key = k.key AND j.status = 'RUNNING' AND j.flow_key IS NOT NULL
                 LIMIT allowed) AS r;
        IF running + p_held >= allowed THEN
            blocked := CASE WHEN k.paused_until > clock_timestamp() THEN 'paused'
                            ELSE 'concurrency' END;
            RETURN;
        END IF;
    END IF;
    IF lim.requests IS NOT NULL THEN
        allowed := greatest(1, floor(lim.requests * factor));
        IF k.window_requests + p_held + 1 > allowed THEN
            blocked := 'requests';
            -- When enough of the window's requests have slid out of it.
            SELECT w.at + make_interval(secs => lim.interval_seconds) INTO slid_at
              FROM (SELECT s.at, sum(s.requests) OVER (ORDER BY s.at, s.id) AS slid
                      FROM orc_flow_spends AS s
                     WHERE s.key = k.key
                       AND s.at > clock_timestamp() - make_interval(secs => lim.interval_seconds)) AS w
             WHERE w.slid >= k.window_requests + p_held + 1 - allowed
             ORDER BY w.at
             LIMIT 1;
            known := slid_at IS NOT NULL OR p_held = 0;
            -- (none with nothing held: the sums overstate the spends; a window from now is safe)
            wake := coalesce(slid_at, clock_timestamp() + make_interval(secs => lim.interval_seconds));
        END IF;
    END IF;
    IF lim.units IS NOT NULL THEN
        allowed := greatest(1, floor(lim.units * factor));
        cost := least(p_cost, allowed);  -- a job dearer than the whole window runs alone in it
        IF k.window_units + p_held_cost + cost > allowed THEN
            blocked := coalesce(blocked, 'units');
            SELECT w.at + make_interval(secs => lim.interval_seconds) INTO slid_at
              FROM (SELECT s.at, sum(s.units) OVER (ORDER BY s.at, s.id) AS slid
                      FROM orc_flow_spends AS s
                     WHERE s.key = k.key
                       AND s.at > clock_timestamp() - make_interval(secs => lim.interval_seconds)) AS w
             WHERE w.slid >= k.window_units + p_held_cost + cost - allowed
             ORDER BY w.at
             LIMIT 1;
            known := known AND (slid_at IS NOT NULL OR p_held = 0);
            wake := greatest(wake, coalesce(slid_at, clock_timestamp()
                                                  + make_interval(secs => lim.interval_seconds)));
        END IF;
    END IF;
    IF k.paused_until > clock_timestamp() THEN
        blocked := 'paused';
        wake := greatest(wake, k.paused_until);
    END IF;
    IF NOT known THEN
        wake := NULL;
    END IF;
END;
$$;

-- Hand the key's capacity to its waiters, in fair order: a waiter that fits now gets a dispatch
-- now; one that fits at a known time (a window sliding, a pause ending) gets a dispatch for
-- then, as long as that time lies within the horizon (a second, or the interval if shorter)
-- of the soonest dispatch scheduled ahead (or of the first it schedules). Returns how many got
-- a dispatch for now.
CREATE OR REPLACE FUNCTION orc_flow_pump_v1(p_key text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    k orc_flow_keys;
    lim orc_flow_limits;
    held integer;
    held_cost bigint;
    waiter orc_flow_waiters;
    pick text;
    blocked text;
    wake timestamptz;
    horizon timestamptz;  -- no dispatch is scheduled later than this
    now_ids uuid[] := '{}';
    later_ids uuid[] := '{}';
    later_at timestamptz[] := '{}';
    busy uuid[] := '{}';  -- waiters another transaction holds (a cancel): left for later
    weight double precision;
    floor_vtime double precision;
BEGIN
    PERFORM orc_flow_lock_v1(p_key);
    SELECT * INTO k FROM orc_flow_keys WHERE key = p_key;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    SELECT * INTO lim FROM orc_flow_limits WHERE name = k.limit_name;
    IF lim.name IS NOT NULL THEN
        k := orc_flow_expire_v1(k, lim);
    END IF;
    SELECT count(*), coalesce(sum(w.cost), 0) INTO held, held_cost
      FROM orc_flow_waiters AS w WHERE w.key = p_key AND w.dispatched_at IS NOT NULL;
    FOR i IN 1 .. 500 LOOP  -- bounded: a later release or the safety net pumps the rest
        SELECT s.share INTO pick
          FROM orc_flow_shares AS s
         WHERE s.key = p_key
           AND EXISTS (SELECT FROM orc_flow_waiters AS w
                        WHERE w.key = p_key AND w.share = s.share AND w.dispatched_at IS NULL
                          AND w.job_id <> ALL (busy))
         ORDER BY s.vtime, s.share
         LIMIT 1;
        EXIT WHEN pick IS NULL;
        SELECT w.* INTO waiter
          FROM orc_flow_waiters AS w
         WHERE w.key = p_key AND w.share = pick AND w.dispatched_at IS NULL
           AND w.job_id <> ALL (busy)
         ORDER BY w.seq
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
        IF lim.name IS NOT NULL THEN  -- (a limit no longer configured holds nothing back)
            SELECT c.blocked, c.wake INTO blocked, wake
              FROM orc_flow_capacity_v1(k, lim, waiter.cost, held, held_cost) AS c;
        END IF;
        IF blocked IS NOT NULL THEN
            EXIT WHEN wake IS NULL;  -- room comes with a release or an admission, which pump
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
        weight := coalesce((lim.weights ->> pick)::double precision, 1);
        UPDATE orc_flow_shares AS s
           SET vtime = s.vtime + CASE WHEN lim.units IS NULL THEN 1 ELSE waiter.cost END / weight
         WHERE s.key = p_key AND s.share = pick;
        UPDATE orc_flow_waiters SET dispatched_at = coalesce(wake, now())
         WHERE job_id = waiter.job_id;
        held := held + 1;
        held_cost := held_cost + waiter.cost;
        IF wake IS NULL THEN
            now_ids := now_ids || waiter.job_id;
        ELSE
            later_ids := later_ids || waiter.job_id;
            later_at := later_at || wake;
        END IF;
    END LOOP;
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

-- May the job (locked by the caller, about to be claimed) start now? As in migration 0029,
-- except that a job which is not a waiter sent ahead also waits behind waiters scheduled ahead,
-- that only the waiters due by now hold capacity, and that a waiter sent ahead which is
-- admitted pumps its key first (counted as held there, as it is not yet RUNNING and its spend
-- is not yet recorded), so the schedule keeps a horizon ahead.
CREATE OR REPLACE FUNCTION orc_flow_admit_v1(j orc_jobs, p_task_prefix text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    k orc_flow_keys := orc_flow_lock_key_v1(j.flow_key, j.flow_limit, p_task_prefix);
    lim orc_flow_limits;
    waiter orc_flow_waiters;
    blocked text;
    wake timestamptz;
    floor_vtime double precision;
BEGIN
    SELECT * INTO lim FROM orc_flow_limits WHERE name = k.limit_name;
    SELECT * INTO waiter FROM orc_flow_waiters WHERE job_id = j.id;
    IF lim.name IS NULL THEN  -- the limit is no longer configured: nothing holds the job back
        DELETE FROM orc_flow_waiters WHERE job_id = j.id;
        RETURN NULL;
    END IF;
    -- The window's sums only ever overstate what is in it until its old spends are expired, so
    -- a claim far from the limit need not expire them (one in fifty does, to keep the table
    -- small); one near it always does, and decides on exact sums.
    IF random() < 0.02
       OR k.window_requests + 1 > 0.9 * lim.requests * orc_flow_factor_v1(k, lim)
       OR k.window_units + coalesce(j.flow_cost, 1) > 0.9 * lim.units * orc_flow_factor_v1(k, lim)
    THEN
        k := orc_flow_expire_v1(k, lim);
    END IF;
    IF k.paused_until > clock_timestamp() THEN
        blocked := 'paused';
    ELSIF waiter.dispatched_at IS NULL
          AND (EXISTS (SELECT FROM orc_flow_waiters AS w
                        WHERE w.key = j.flow_key AND w.dispatched_at IS NULL
                          AND w.job_id <> j.id)
               OR EXISTS (SELECT FROM orc_flow_waiters AS w
                           WHERE w.key = j.flow_key AND w.dispatched_at > clock_timestamp()))
    THEN
        blocked := 'line';  -- others were first
    ELSE
        SELECT c.blocked, c.wake INTO blocked, wake
          FROM (SELECT count(*) AS held, coalesce(sum(w.cost), 0) AS held_cost
                  FROM orc_flow_waiters AS w
                 WHERE w.key = j.flow_key AND w.dispatched_at <= clock_timestamp()
                   AND w.job_id <> j.id) AS h,
               orc_flow_capacity_v1(
                   k, lim, coalesce(j.flow_cost, 1), h.held::integer, h.held_cost::bigint) AS c;
    END IF;
    IF blocked IS NULL THEN
        IF lim.requests IS NOT NULL OR lim.units IS NOT NULL THEN
            IF waiter.dispatched_at IS NOT NULL THEN
                PERFORM orc_flow_pump_v1(j.flow_key);
            END IF;
            PERFORM orc_flow_record_spend_v1(
                j.flow_key, j.id, 1, least(coalesce(j.flow_cost, 1)::bigint, lim.units)
            );
        END IF;
        IF waiter.job_id IS NOT NULL THEN
            DELETE FROM orc_flow_waiters WHERE job_id = j.id;
        END IF;
        RETURN NULL;
    END IF;

    -- Parked. A share that starts waiting starts level with the shares already waiting.
    SELECT min(s.vtime) INTO floor_vtime
      FROM orc_flow_shares AS s
     WHERE s.key = j.flow_key
       AND EXISTS (SELECT FROM orc_flow_waiters AS w
                    WHERE w.key = j.flow_key AND w.share = s.share AND w.dispatched_at IS NULL);
    INSERT INTO orc_flow_shares AS s (key, share, vtime)
    VALUES (j.flow_key, coalesce(j.flow_share, ''), coalesce(floor_vtime, 0))
    ON CONFLICT (key, share) DO UPDATE
       SET vtime = greatest(s.vtime, coalesce(floor_vtime, s.vtime))
     WHERE NOT EXISTS (SELECT FROM orc_flow_waiters AS w
                        WHERE w.key = s.key AND w.share = s.share AND w.dispatched_at IS NULL);
    IF waiter.job_id IS NULL THEN
        INSERT INTO orc_flow_waiters (job_id, key, share, cost, blocked_on)
        VALUES (j.id, j.flow_key, coalesce(j.flow_share, ''), coalesce(j.flow_cost, 1), blocked);
        INSERT INTO orc_job_events (job_id, kind, payload)
        VALUES (j.id, 'job.waiting_for_capacity',
                jsonb_build_object('key', j.flow_key, 'waiting_on', blocked, 'status', j.status));
    ELSE  -- back in line, at its old place
        UPDATE orc_flow_waiters
           SET dispatched_at = NULL, blocked_on = blocked, key = j.flow_key
         WHERE job_id = j.id;
    END IF;
    UPDATE orc_jobs SET procrastinate_job_id = NULL WHERE id = j.id;
    PERFORM orc_flow_pump_v1(j.flow_key);  -- the head of the line may go, or wait for a time
    RETURN blocked;
END;
$$;

-- Give jobs a dispatch each, for its time in `p_ats` (now when null or past), as
-- orc_dispatch_v1 does; the workers hear the soonest later time.
CREATE FUNCTION orc_flow_dispatch_v2(p_job_ids uuid[], p_ats timestamptz[], p_task_prefix text)
RETURNS void
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
    UPDATE orc_jobs AS j SET procrastinate_job_id = p.id
      FROM procrastinate_jobs AS p
     WHERE p.id = ANY (deferred) AND j.id = (p.args ->> 'job_id')::uuid;
    IF soonest IS NOT NULL THEN
        PERFORM pg_notify('orc_wakeup', extract(epoch FROM soonest)::text);
    END IF;
END;
$$;

DROP FUNCTION orc_flow_dispatch_v1(uuid[], timestamptz, text);

-- What an admitted job's call really used (`p_units`), as in migration 0029, and when it was
-- sent: `p_sent_seconds_ago` (measured by the worker, so no clock but the database's is read)
-- dates the spend from the call's sending, not from the claim. The provider counts a request
-- when it arrives, and a claim may come a while before its call (a worker's first call opens
-- its connection): dated from the claim, the spend would leave the key's window before the
-- provider's, and the next claims would meet 429s. Null (the previous release): the claim's
-- time stays. Replaced with the new argument defaulted, so the previous release's calls work.
DROP FUNCTION orc_flow_spend_v1(text, uuid, bigint);
CREATE FUNCTION orc_flow_spend_v1(
    p_key text, p_job_id uuid, p_units bigint, p_sent_seconds_ago double precision DEFAULT NULL
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    reserved orc_flow_spends;
    sent timestamptz := clock_timestamp() - make_interval(secs => p_sent_seconds_ago);
BEGIN
    PERFORM orc_flow_lock_v1(p_key);
    PERFORM FROM orc_flow_keys AS k JOIN orc_flow_limits AS l ON l.name = k.limit_name
      WHERE k.key = p_key AND (l.requests IS NOT NULL OR l.units IS NOT NULL);
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT * INTO reserved FROM orc_flow_spends
     WHERE job_id = p_job_id AND key = p_key AND NOT reconciled
     ORDER BY id DESC LIMIT 1;
    IF reserved.id IS NULL THEN  -- a later call: a request more
        PERFORM orc_flow_record_spend_v1(p_key, p_job_id, 1, p_units);
        UPDATE orc_flow_spends SET reconciled = true, at = least(at, coalesce(sent, at))
         WHERE id = (SELECT max(id) FROM orc_flow_spends WHERE job_id = p_job_id AND key = p_key);
        RETURN;
    END IF;
    UPDATE orc_flow_spends
       SET units = p_units, reconciled = true, at = greatest(at, coalesce(sent, at))
     WHERE id = reserved.id;
    UPDATE orc_flow_keys SET window_units = greatest(0, window_units + p_units - reserved.units)
     WHERE key = p_key;
END;
$$;
