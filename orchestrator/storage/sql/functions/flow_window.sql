-- Flow control's window and capacity (docs/flow-control.md): what a key's window holds now,
-- what a share may hold of it, whether one more spend fits and when it will, and a spend
-- recorded in it.

-- The key's rate factor now: its stored value recovered by a tenth per interval since.
CREATE OR REPLACE FUNCTION orc_flow_factor_v1(k orc_flow_keys, lim orc_flow_limits)
RETURNS double precision
LANGUAGE sql STABLE AS $$
    SELECT least(1.0, k.rate_factor
                      + extract(epoch FROM now() - k.factor_at) / (10 * lim.interval_seconds))
$$;

-- The key's window sums moved by what entered its window (`p_requests` and `p_units` positive)
-- or left it (negative), never below 0 (what left may have been counted out already). The key
-- is locked by the caller; its row as it is now.
CREATE OR REPLACE FUNCTION orc_flow_window_moved_v1(p_key text, p_requests bigint, p_units bigint)
RETURNS orc_flow_keys
LANGUAGE sql AS $$
    UPDATE orc_flow_keys
       SET window_requests = greatest(0, window_requests + p_requests),
           window_units = greatest(0, window_units + p_units)
     WHERE key = p_key
    RETURNING *
$$;

-- The key's spends that slid out of its window go, and its window's sums with them. The key
-- is locked by the caller; its row as it is now.
CREATE OR REPLACE FUNCTION orc_flow_expire_v1(k orc_flow_keys, lim orc_flow_limits) RETURNS orc_flow_keys
LANGUAGE plpgsql AS $$
DECLARE
    gone_requests bigint;
    gone_units bigint;
BEGIN
    IF lim.requests IS NULL AND lim.units IS NULL THEN
        RETURN k;
    END IF;
    WITH gone AS (
        DELETE FROM orc_flow_spends AS s
         WHERE s.key = k.key
           AND s.at <= clock_timestamp() - make_interval(secs => lim.interval_seconds)
        RETURNING s.requests, s.units
    )
    SELECT sum(g.requests), sum(g.units) INTO gone_requests, gone_units FROM gone AS g;
    IF gone_requests IS NOT NULL THEN
        k := orc_flow_window_moved_v1(k.key, -gone_requests, -gone_units);
    END IF;
    RETURN k;
END;
$$;

-- May a job of `p_job_type` pass the key's pause, its call moving to a fallback model? Only a
-- provider's pause (a 429's hint), and only one longer than the type's fallback threshold: the
-- fleet's, as the last config applied wrote it (orc_flow_job_types), the one place both the
-- claim and the worker read it (docs/flow-control.md, "Model fallback"). An operator's pause
-- stops every type. False for a type without fallback models, or a key not paused.
CREATE OR REPLACE FUNCTION orc_flow_passes_pause_v1(k orc_flow_keys, p_job_type text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT coalesce(k.paused_by = 'provider', false) AND coalesce(
        (SELECT k.paused_until > clock_timestamp() + make_interval(secs => t.fallback_after_seconds)
           FROM orc_flow_job_types AS t WHERE t.job_type = p_job_type),
        false)
$$;

-- A fraction of an allowance: the most one share may hold of it (the limit's tenant_share; at
-- least 1), or the whole allowance without a cap (orchestrator.domain.flow_share.cap).
CREATE OR REPLACE FUNCTION orc_flow_cap_v1(p_allowed double precision, p_share double precision)
RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN p_share IS NULL THEN floor(p_allowed)
                ELSE greatest(1, floor(p_allowed * p_share)) END::bigint
$$;

-- A job's (or a call's) declared or estimated cost as the key takes it: at least 1, at most the
-- units one share may hold (the whole window's without a cap), whatever was declared
-- (orchestrator.domain.flow_share.estimate).
CREATE OR REPLACE FUNCTION orc_flow_estimate_v1(p_cost bigint, lim orc_flow_limits) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
    SELECT greatest(1, least(coalesce(p_cost, 1), orc_flow_cap_v1(lim.units, lim.tenant_share)))
$$;

-- What `p_units` spent (or reserved) counts for its share's fairness: its units, at least 1,
-- under a limit with units; else 1, a start or a call (orchestrator.domain.flow_share.charge).
CREATE OR REPLACE FUNCTION orc_flow_charged_v1(p_units bigint, lim orc_flow_limits) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN lim.units IS NULL THEN 1 ELSE greatest(1, coalesce(p_units, 1)) END
$$;

-- A share's virtual time moves by `p_amount` over its weight: a start or call charged, a
-- reservation corrected to what its call really spent, or given back. Only a share with a row
-- (one that waited lately) has a virtual time: idle time is not saved up as credit.
CREATE OR REPLACE FUNCTION orc_flow_charge_v1(
    p_key text, p_share text, p_amount double precision, lim orc_flow_limits
) RETURNS void
LANGUAGE sql AS $$
    UPDATE orc_flow_shares AS s
       SET vtime = s.vtime + p_amount / coalesce((lim.weights ->> p_share)::double precision, 1)
     WHERE s.key = p_key AND s.share = coalesce(p_share, '') AND p_amount <> 0
       AND lim.name IS NOT NULL
$$;

-- What one measure of the key's window (`p_measure`: 'requests' or 'units') holds now: its
-- spends of the last `p_interval` seconds, of the share `p_share` alone when one is given. (The
-- key's own sums, window_requests and window_units, hold the same once orc_flow_expire_v1 has
-- taken out what slid out.)
CREATE OR REPLACE FUNCTION orc_flow_used_v1(
    p_key text, p_share text, p_measure text, p_interval double precision
) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT coalesce(sum(CASE p_measure WHEN 'requests' THEN s.requests ELSE s.units END), 0)::bigint
      FROM orc_flow_spends AS s
     WHERE s.key = p_key AND (p_share IS NULL OR s.share = p_share)
       AND s.at > clock_timestamp() - make_interval(secs => p_interval)
$$;

-- One measure of the key's sliding window (`p_measure`: 'requests' or 'units') as one more
-- spend meets it (a request, of `p_cost` units), beside the `p_held` jobs (of `p_held_cost`
-- units) that hold a dispatch: the key's whole window (its sums, lowered by its rate factor),
-- or with `p_share` that share's part of it (the limit's tenant_share of it). `exceeded`: it
-- does not fit (false under a limit without that measure); then `slid_at`, when enough of the
-- window's spends, oldest first, will have slid out for it to fit. Null when the window holds
-- too few: its room comes with spends the held jobs have yet to make, or, with nothing held,
-- the key's sums overstate its spends (until expired), and an interval from now is safe. A
-- spend dearer than the whole allowance runs alone in it.
CREATE OR REPLACE FUNCTION orc_flow_measure_v1(
    k orc_flow_keys, lim orc_flow_limits, p_measure text, p_share text, p_cost bigint,
    p_held integer, p_held_cost bigint, OUT exceeded boolean, OUT slid_at timestamptz
)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    of_requests boolean := p_measure = 'requests';
    allowed bigint := CASE WHEN of_requests THEN lim.requests ELSE lim.units END;
    used bigint := CASE WHEN of_requests THEN k.window_requests ELSE k.window_units END;
    held bigint := CASE WHEN of_requests THEN p_held ELSE p_held_cost END;
    cost bigint;
BEGIN
    exceeded := false;
    IF allowed IS NULL THEN
        RETURN;
    END IF;
    allowed := greatest(1, floor(allowed * orc_flow_factor_v1(k, lim)));
    IF p_share IS NOT NULL THEN
        allowed := orc_flow_cap_v1(allowed, lim.tenant_share);
        used := orc_flow_used_v1(k.key, p_share, p_measure, lim.interval_seconds);
    END IF;
    cost := CASE WHEN of_requests THEN 1 ELSE least(p_cost, allowed) END;
    exceeded := coalesce(used + held + cost > allowed, false);
    IF exceeded THEN
        SELECT w.at + make_interval(secs => lim.interval_seconds) INTO slid_at
          FROM (SELECT s.at, sum(CASE WHEN of_requests THEN s.requests ELSE s.units END)
                             OVER (ORDER BY s.at, s.id) AS slid
                  FROM orc_flow_spends AS s
                 WHERE s.key = k.key AND (p_share IS NULL OR s.share = p_share)
                   AND s.at > clock_timestamp() - make_interval(secs => lim.interval_seconds)) AS w
         WHERE w.slid >= used + held + cost - allowed
         ORDER BY w.at
         LIMIT 1;
        IF slid_at IS NULL AND p_held = 0 THEN
            slid_at := clock_timestamp() + make_interval(secs => lim.interval_seconds);
        END IF;
    END IF;
END;
$$;

-- The key's sliding window (or, with `p_share`, that share's part of it) as one more spend of
-- `p_cost` units meets it, beside the `p_held` jobs (of `p_held_cost` units) that hold a
-- dispatch, both its measures (orc_flow_measure_v1): (NULL, NULL), it fits; else the first that
-- does not ('requests', else 'units') and, when known for each that does not, the latest time
-- it will. The window's rule for the key (orc_flow_capacity_v1) and its share
-- (orc_flow_share_capacity_v1) alike.
CREATE OR REPLACE FUNCTION orc_flow_window_room_v1(
    k orc_flow_keys, lim orc_flow_limits, p_share text, p_cost bigint, p_held integer,
    p_held_cost bigint, OUT blocked text, OUT wake timestamptz
)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    measure text;
    m record;
    known boolean := true;
BEGIN
    FOREACH measure IN ARRAY ARRAY['requests', 'units'] LOOP
        m := orc_flow_measure_v1(k, lim, measure, p_share, p_cost, p_held, p_held_cost);
        CONTINUE WHEN NOT m.exceeded;
        blocked := coalesce(blocked, measure);
        known := known AND m.slid_at IS NOT NULL;
        wake := greatest(wake, m.slid_at);
    END LOOP;
    IF NOT known THEN
        wake := NULL;
    END IF;
END;
$$;

-- Are the key's slots full (or, with `p_share`, that share's: the limit's tenant_share of
-- them): do its jobs running and the `p_held` that hold a dispatch for it reach its concurrency,
-- lowered by its rate factor? False under a limit without one. (The running are counted only
-- so far: counting further would change nothing.)
CREATE OR REPLACE FUNCTION orc_flow_slots_full_v1(
    k orc_flow_keys, lim orc_flow_limits, p_share text, p_held integer
) RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
DECLARE
    allowed bigint := greatest(1, floor(lim.concurrency * orc_flow_factor_v1(k, lim)));
BEGIN
    IF lim.concurrency IS NULL THEN
        RETURN false;
    END IF;
    IF p_share IS NOT NULL THEN
        allowed := orc_flow_cap_v1(allowed, lim.tenant_share);
    END IF;
    RETURN (SELECT count(*)
              FROM (SELECT FROM orc_jobs AS j
                     WHERE j.flow_key = k.key AND j.status = 'RUNNING' AND j.flow_key IS NOT NULL
                       AND (p_share IS NULL OR j.flow_share IS NOT DISTINCT FROM p_share)
                     LIMIT allowed) AS r) + p_held >= allowed;
END;
$$;

-- Can one more job of the share `p_share`, of `p_cost`, start on the key now within the share's
-- cap (the limit's tenant_share of its concurrency, requests and units), beside the share's
-- `p_held` jobs (of `p_held_cost` units) that hold a dispatch? (NULL, NULL): yes, or the limit
-- caps no share; else 'share' and, when known, the time the share's own spends have slid out
-- enough (its room under a concurrency cap comes with a release, which pumps).
CREATE OR REPLACE FUNCTION orc_flow_share_capacity_v1(
    k orc_flow_keys, lim orc_flow_limits, p_share text, p_cost bigint, p_held integer,
    p_held_cost bigint, OUT blocked text, OUT wake timestamptz
)
LANGUAGE plpgsql AS $$
DECLARE
    w record;
BEGIN
    IF lim.tenant_share IS NULL THEN
        RETURN;
    ELSIF orc_flow_slots_full_v1(k, lim, p_share, p_held) THEN
        blocked := 'share';
        RETURN;
    END IF;
    w := orc_flow_window_room_v1(k, lim, p_share, p_cost, p_held, p_held_cost);
    IF w.blocked IS NOT NULL THEN
        blocked := 'share';
        wake := w.wake;
    END IF;
END;
$$;

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
    w record;
BEGIN
    IF orc_flow_slots_full_v1(k, lim, NULL, p_held) THEN
        blocked := CASE WHEN k.paused_until > clock_timestamp() THEN 'paused'
                        ELSE 'concurrency' END;
        RETURN;
    END IF;
    w := orc_flow_window_room_v1(k, lim, NULL, p_cost, p_held, p_held_cost);
    blocked := w.blocked;
    wake := w.wake;
    IF k.paused_until > clock_timestamp() THEN  -- (a window's room not known stays not known)
        wake := CASE WHEN blocked IS NULL OR wake IS NOT NULL
                     THEN greatest(wake, k.paused_until) END;
        blocked := 'paused';
    END IF;
END;
$$;

-- A job's spend in its key's window, at `p_at` (now, or a running job's call admitted for the
-- instant its room comes): recorded with the window's sums, and its job's share (whose cap
-- counts it). Its id.
CREATE OR REPLACE FUNCTION orc_flow_record_spend_v2(
    p_key text, p_job_id uuid, p_requests integer, p_units bigint, p_at timestamptz
) RETURNS bigint
LANGUAGE sql AS $$
    SELECT orc_flow_window_moved_v1(p_key, p_requests, p_units);
    INSERT INTO orc_flow_spends (key, job_id, requests, units, share, at)
    VALUES (p_key, p_job_id, p_requests, p_units,
            (SELECT coalesce(j.flow_share, '') FROM orc_jobs AS j WHERE j.id = p_job_id), p_at)
    RETURNING id;
$$;

-- A spend taken back (a claim's reservation that no call used, a call admitted ahead that a
-- pause stopped): it leaves the key's window, the window's sums and its share's charge. The
-- spend, null when there was none (`p_spend` null, or gone already). The key is locked by the
-- caller.
CREATE OR REPLACE FUNCTION orc_flow_unspend_v1(p_spend bigint, lim orc_flow_limits)
RETURNS orc_flow_spends
LANGUAGE plpgsql AS $$
DECLARE
    gone orc_flow_spends;
BEGIN
    DELETE FROM orc_flow_spends WHERE id = p_spend RETURNING * INTO gone;
    IF gone.id IS NOT NULL THEN
        PERFORM orc_flow_window_moved_v1(gone.key, -gone.requests, -gone.units);
        PERFORM orc_flow_charge_v1(gone.key, gone.share, -orc_flow_charged_v1(gone.units, lim), lim);
    END IF;
    RETURN gone;
END;
$$;

-- What an admitted job's call really used (`p_units`): the first call since its admission
-- corrects the reservation made then (and marks it reconciled), a later one (an agent's next
-- turn) adds a request and its units. Nothing for a key whose limit has neither requests nor
-- units, nor learns them. Written once per call (`p_call_id`, the id its usage is recorded
-- under): a try repeated after a lost acknowledgement changes nothing (orc_flow_spent_calls).
-- The job's share is charged what the call really spent (at least 1), its estimate's charge
-- corrected.
CREATE OR REPLACE FUNCTION orc_flow_spend_v2(
    p_key text, p_job_id uuid, p_units bigint, p_sent_seconds_ago double precision,
    p_call_id text
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    reserved orc_flow_spends;
    lim orc_flow_limits;
    job_share text := (SELECT j.flow_share FROM orc_jobs AS j WHERE j.id = p_job_id);
    sent timestamptz := clock_timestamp() - make_interval(secs => p_sent_seconds_ago);
BEGIN
    PERFORM orc_flow_lock_v1(p_key);
    SELECT l.* INTO lim FROM orc_flow_keys AS k JOIN orc_flow_limits AS l ON l.name = k.limit_name
      WHERE k.key = p_key AND (l.requests IS NOT NULL OR l.units IS NOT NULL OR l.learn);
    IF lim.name IS NULL THEN
        RETURN;
    END IF;
    IF p_call_id IS NOT NULL THEN
        INSERT INTO orc_flow_spent_calls (job_id, call_id) VALUES (p_job_id, p_call_id)
        ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            RETURN;  -- written already
        END IF;
    END IF;
    SELECT * INTO reserved FROM orc_flow_spends
     WHERE job_id = p_job_id AND key = p_key AND NOT reconciled
     ORDER BY id DESC LIMIT 1;
    IF reserved.id IS NULL THEN  -- a later call: a request more
        PERFORM orc_flow_record_spend_v2(p_key, p_job_id, 1, p_units, clock_timestamp());
        UPDATE orc_flow_spends SET reconciled = true, at = least(at, coalesce(sent, at))
         WHERE id = (SELECT max(id) FROM orc_flow_spends WHERE job_id = p_job_id AND key = p_key);
        PERFORM orc_flow_charge_v1(p_key, job_share, orc_flow_charged_v1(p_units, lim), lim);
        RETURN;
    END IF;
    PERFORM orc_flow_charge_v1(
        p_key, job_share, orc_flow_charged_v1(p_units, lim) - orc_flow_charged_v1(reserved.units, lim),
        lim);
    UPDATE orc_flow_spends
       SET units = p_units, reconciled = true, at = greatest(at, coalesce(sent, at))
     WHERE id = reserved.id;
    PERFORM orc_flow_window_moved_v1(p_key, 0, p_units - reserved.units);
END;
$$;

-- orc_flow_spend_v2 without a call id (the release before calls it): not protected against a
-- repeated try.
CREATE OR REPLACE FUNCTION orc_flow_spend_v1(
    p_key text, p_job_id uuid, p_units bigint, p_sent_seconds_ago double precision DEFAULT NULL
) RETURNS void
LANGUAGE sql AS $$
    SELECT orc_flow_spend_v2(p_key, p_job_id, p_units, p_sent_seconds_ago, NULL)
$$;
