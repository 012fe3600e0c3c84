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
        UPDATE orc_flow_keys
           SET window_requests = greatest(0, window_requests - gone_requests),
               window_units = greatest(0, window_units - gone_units)
         WHERE key = k.key
        RETURNING * INTO k;
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
    factor double precision;
    allowed bigint;
    running integer;
    used bigint;
    cost bigint;
    slid_at timestamptz;
    known boolean := true;
BEGIN
    IF lim.tenant_share IS NULL THEN
        RETURN;
    END IF;
    factor := orc_flow_factor_v1(k, lim);
    IF lim.concurrency IS NOT NULL THEN
        allowed := orc_flow_cap_v1(greatest(1, floor(lim.concurrency * factor)), lim.tenant_share);
        SELECT count(*) INTO running
          FROM (SELECT FROM orc_jobs AS j
                 WHERE j.flow_key = k.key AND j.status = 'RUNNING' AND j.flow_key IS NOT NULL
                   AND j.flow_share IS NOT DISTINCT FROM p_share
                 LIMIT allowed) AS r;
        IF running + p_held >= allowed THEN
            blocked := 'share';
            RETURN;
        END IF;
    END IF;
    IF lim.requests IS NOT NULL THEN
        allowed := orc_flow_cap_v1(greatest(1, floor(lim.requests * factor)), lim.tenant_share);
        SELECT coalesce(sum(s.requests), 0) INTO used FROM orc_flow_spends AS s
         WHERE s.key = k.key AND s.share = p_share
           AND s.at > clock_timestamp() - make_interval(secs => lim.interval_seconds);
        IF used + p_held + 1 > allowed THEN
            blocked := 'share';
            SELECT w.at + make_interval(secs => lim.interval_seconds) INTO slid_at
              FROM (SELECT s.at, sum(s.requests) OVER (ORDER BY s.at, s.id) AS slid
                      FROM orc_flow_spends AS s
                     WHERE s.key = k.key AND s.share = p_share
                       AND s.at > clock_timestamp() - make_interval(secs => lim.interval_seconds)) AS w
             WHERE w.slid >= used + p_held + 1 - allowed
             ORDER BY w.at
             LIMIT 1;
            known := slid_at IS NOT NULL;
            wake := slid_at;
        END IF;
    END IF;
    IF lim.units IS NOT NULL THEN
        allowed := orc_flow_cap_v1(greatest(1, floor(lim.units * factor)), lim.tenant_share);
        cost := least(p_cost, allowed);  -- a job dearer than the share's cap runs alone in it
        SELECT coalesce(sum(s.units), 0) INTO used FROM orc_flow_spends AS s
         WHERE s.key = k.key AND s.share = p_share
           AND s.at > clock_timestamp() - make_interval(secs => lim.interval_seconds);
        IF used + p_held_cost + cost > allowed THEN
            blocked := 'share';
            SELECT w.at + make_interval(secs => lim.interval_seconds) INTO slid_at
              FROM (SELECT s.at, sum(s.units) OVER (ORDER BY s.at, s.id) AS slid
                      FROM orc_flow_spends AS s
                     WHERE s.key = k.key AND s.share = p_share
                       AND s.at > clock_timestamp() - make_interval(secs => lim.interval_seconds)) AS w
             WHERE w.slid >= used + p_held_cost + cost - allowed
             ORDER BY w.at
             LIMIT 1;
            known := known AND slid_at IS NOT NULL;
            wake := greatest(wake, slid_at);
        END IF;
    END IF;
    IF NOT known THEN
        wake := NULL;
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

-- A job's spend in its key's window, at `p_at` (now, or a running job's call admitted for the
-- instant its room comes): recorded with the window's sums, and its job's share (whose cap
-- counts it). Its id.
CREATE OR REPLACE FUNCTION orc_flow_record_spend_v2(
    p_key text, p_job_id uuid, p_requests integer, p_units bigint, p_at timestamptz
) RETURNS bigint
LANGUAGE sql AS $$
    UPDATE orc_flow_keys
       SET window_requests = window_requests + p_requests, window_units = window_units + p_units
     WHERE key = p_key;
    INSERT INTO orc_flow_spends (key, job_id, requests, units, share, at)
    VALUES (p_key, p_job_id, p_requests, p_units,
            (SELECT coalesce(j.flow_share, '') FROM orc_jobs AS j WHERE j.id = p_job_id), p_at)
    RETURNING id;
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
    UPDATE orc_flow_keys SET window_units = greatest(0, window_units + p_units - reserved.units)
     WHERE key = p_key;
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
