-- Flow control of a running job's calls (docs/flow-control.md, "Every call admitted"): the key
-- a call is admitted against, its window read, its spend recorded, and a call admitted ahead
-- sent once its room comes.

-- The key a job's call to `p_model` is admitted against: the job's own for the model it asked
-- for (its payload's `model`; or no model named), else the key its limit's template renders for
-- the job with that model (a fallback model's key, with its own window and pauses). Rendered by
-- the fleet's template, as the claim renders a key (orc_flow_render_v1).
CREATE OR REPLACE FUNCTION orc_flow_model_key_v1(j orc_jobs, p_model text) RETURNS text
LANGUAGE plpgsql STABLE AS $$
DECLARE
    template text;
BEGIN
    IF p_model IS NULL OR jsonb_typeof(j.payload) IS DISTINCT FROM 'object'
       OR j.payload ->> 'model' IS NOT DISTINCT FROM p_model THEN
        RETURN j.flow_key;
    END IF;
    SELECT l.key_template INTO template
      FROM orc_flow_keys AS k JOIN orc_flow_limits AS l ON l.name = k.limit_name
     WHERE k.key = j.flow_key;
    IF template IS NULL THEN
        RETURN j.flow_key;
    END IF;
    j.payload := j.payload || jsonb_build_object('model', p_model);
    RETURN orc_flow_render_v1(template, j);
END;
$$;

-- The key a running job's call to `p_model` is admitted against (orc_flow_model_key_v1), its row
-- under the key's lock, held until the caller's transaction ends (created on first use, under
-- the limit of the job's own key). Null: the job has no key.
CREATE OR REPLACE FUNCTION orc_flow_call_key_v1(j orc_jobs, p_model text) RETURNS orc_flow_keys
LANGUAGE plpgsql AS $$
DECLARE
    own orc_flow_keys;
BEGIN
    SELECT * INTO own FROM orc_flow_keys AS f WHERE f.key = j.flow_key;
    IF own.key IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN orc_flow_lock_key_v1(orc_flow_model_key_v1(j, p_model), own.limit_name, own.task_prefix);
END;
$$;

-- The limit a call meets on the key `k` (orc_flow_call_key_v1): its own, its allowances as
-- learned (orc_flow_limit_of_v1). Null when nothing limits the key's calls (no key, its limit
-- gone, or a limit of concurrency alone).
CREATE OR REPLACE FUNCTION orc_flow_call_limit_v1(k orc_flow_keys) RETURNS orc_flow_limits
LANGUAGE plpgsql STABLE AS $$
DECLARE
    lim orc_flow_limits;
BEGIN
    SELECT * INTO lim FROM orc_flow_limits AS l WHERE l.name = k.limit_name;
    lim := orc_flow_limit_of_v1(k, lim);
    IF lim.name IS NULL OR (lim.requests IS NULL AND lim.units IS NULL) THEN
        RETURN NULL;
    END IF;
    RETURN lim;
END;
$$;

-- A running job's next call, before it is sent (docs/flow-control.md, "Every call admitted"), on
-- `p_model` (null: the model its key is for): the key it is admitted against
-- (orc_flow_model_key_v1) and that key's window as the call meets it, read under the key's lock,
-- which the caller's transaction keeps while it decides (orchestrator.domain.flow_window) and
-- records the call (orc_flow_call_spend_v3). The window's spends by age in seconds, oldest first,
-- `mine` marking those of the job's share, but, for the job's first call since its claim
-- (`p_first`), the claim's reservation on that key (its units: `reserved`, null for none);
-- `paused_for` null when the key is not paused (a call is never let through a pause: a job
-- that passes its own key's provider pause calls a fallback model, on that model's key);
-- `tenant_share` the limit's cap of one share, with the share's waiters handed room. No row:
-- nothing limits the key's calls (no key, its limit gone, or a limit of concurrency alone).
-- The release before's first step of a call's admission, kept for its workers (migration 0064):
-- this release admits a call in one statement (orc_flow_admit_call_v1); it goes to retired.sql
-- once no worker of that release runs.
CREATE OR REPLACE FUNCTION orc_flow_call_window_v2(p_job_id uuid, p_model text, p_first boolean)
RETURNS TABLE (
    key text, allowed_requests bigint, allowed_units bigint, window_seconds double precision,
    paused_for double precision, held integer, held_cost bigint, reserved bigint,
    ages double precision[], spent_requests integer[], spent_units bigint[], mine boolean[],
    tenant_share double precision, share_held integer, share_held_cost bigint
)
LANGUAGE plpgsql AS $$
DECLARE
    j orc_jobs;
    call_key text;
    job_share text;
    k orc_flow_keys;
    lim orc_flow_limits;
    factor double precision;
    unused orc_flow_spends;
BEGIN
    SELECT * INTO j FROM orc_jobs AS o WHERE o.id = p_job_id;
    k := orc_flow_call_key_v1(j, p_model);
    lim := orc_flow_call_limit_v1(k);
    IF lim.name IS NULL THEN
        RETURN;
    END IF;
    call_key := k.key;
    job_share := coalesce(j.flow_share, '');
    k := orc_flow_expire_v1(k, lim);
    factor := orc_flow_factor_v1(k, lim);
    IF p_first THEN
        SELECT * INTO unused FROM orc_flow_spends AS s
         WHERE s.job_id = p_job_id AND s.key = call_key AND NOT s.reconciled
         ORDER BY s.id DESC LIMIT 1;
    END IF;
    RETURN QUERY
    SELECT call_key,
           CASE WHEN lim.requests IS NOT NULL
                THEN greatest(1, floor(lim.requests * factor))::bigint END,
           CASE WHEN lim.units IS NOT NULL THEN greatest(1, floor(lim.units * factor))::bigint END,
           lim.interval_seconds,
           CASE WHEN k.paused_until > clock_timestamp()
                THEN extract(epoch FROM k.paused_until - clock_timestamp())::float8 END,
           h.n::integer, h.cost::bigint, unused.units,
           coalesce(w.ages, '{}'), coalesce(w.requests, '{}'), coalesce(w.units, '{}'),
           coalesce(w.mine, '{}'), lim.tenant_share, h.share_n::integer, h.share_cost::bigint
      FROM (SELECT count(*) AS n, coalesce(sum(o.cost), 0) AS cost,
                   count(*) FILTER (WHERE o.share = job_share) AS share_n,
                   coalesce(sum(o.cost) FILTER (WHERE o.share = job_share), 0) AS share_cost
              FROM orc_flow_waiters AS o
             WHERE o.key = call_key AND o.dispatched_at <= clock_timestamp()) AS h,
           (SELECT array_agg(extract(epoch FROM clock_timestamp() - s.at)::float8
                             ORDER BY s.at, s.id) AS ages,
                   array_agg(s.requests ORDER BY s.at, s.id) AS requests,
                   array_agg(s.units ORDER BY s.at, s.id) AS units,
                   array_agg(s.share IS NOT DISTINCT FROM job_share ORDER BY s.at, s.id) AS mine
              FROM orc_flow_spends AS s
             WHERE s.key = call_key
               AND s.at > clock_timestamp() - make_interval(secs => lim.interval_seconds)
               AND s.id IS DISTINCT FROM unused.id) AS w;
END;
$$;

-- A running job's call admitted (by orc_flow_admit_call_v1; the release before: after
-- orc_flow_call_window_v2, in its transaction) on the key it named, `p_after` seconds from now
-- (0: at once; else the instant its room comes, which it waits for in place): a request and its estimate recorded in the key's window at that instant,
-- so that the calls and claims decided after it meet its room taken, and charged to the job's
-- share; `p_reuse`: the job's first call since its claim, whose reservation moves there and
-- takes the call's estimate instead (its charge corrected). The spend's id (see
-- orc_flow_call_go_v1). A call admitted ahead that is never sent (its job cancelled, timed out,
-- its worker gone) is counted as one that was: its spend slides out of the window an interval
-- after its instant, as every spend does (orc_flow_expire_v1).
CREATE OR REPLACE FUNCTION orc_flow_call_spend_v3(
    p_key text, p_job_id uuid, p_units bigint, p_reuse boolean, p_after double precision
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    unused orc_flow_spends;
    lim orc_flow_limits;
    job_share text := (SELECT j.flow_share FROM orc_jobs AS j WHERE j.id = p_job_id);
    placed timestamptz := clock_timestamp() + make_interval(secs => greatest(p_after, 0));
BEGIN
    SELECT l.* INTO lim FROM orc_flow_keys AS k JOIN orc_flow_limits AS l ON l.name = k.limit_name
     WHERE k.key = p_key;
    IF NOT p_reuse THEN
        PERFORM orc_flow_charge_v1(p_key, job_share, orc_flow_charged_v1(p_units, lim), lim);
        RETURN orc_flow_record_spend_v2(p_key, p_job_id, 1, p_units, placed);
    END IF;
    SELECT * INTO unused FROM orc_flow_spends AS s
     WHERE s.job_id = p_job_id AND s.key = p_key AND NOT s.reconciled
     ORDER BY s.id DESC LIMIT 1;
    UPDATE orc_flow_spends SET at = placed, units = p_units WHERE id = unused.id;
    UPDATE orc_flow_keys SET window_units = greatest(0, window_units + p_units - unused.units)
     WHERE key = p_key;
    PERFORM orc_flow_charge_v1(
        p_key, job_share, orc_flow_charged_v1(p_units, lim) - orc_flow_charged_v1(unused.units, lim),
        lim);
    RETURN unused.id;
END;
$$;

-- A running job's call admitted ahead (orc_flow_call_spend_v3), at the instant its room came:
-- may it go? NULL: yes, its spend stays where it was placed (and is corrected to the reply's
-- usage after, as every call's). Else the key was paused meanwhile (a provider's 429, an
-- operator): its spend `p_spend` leaves the window (and its share's charge), and the answer is
-- the seconds the pause lasts from now: the job parks, as a call that meets a pause does. Under
-- the key's lock, so a pause is never passed.
CREATE OR REPLACE FUNCTION orc_flow_call_go_v1(p_key text, p_spend bigint)
RETURNS double precision
LANGUAGE plpgsql AS $$
DECLARE
    k orc_flow_keys;
    lim orc_flow_limits;
    gone orc_flow_spends;
BEGIN
    PERFORM orc_flow_lock_v1(p_key);
    SELECT * INTO k FROM orc_flow_keys WHERE key = p_key;
    IF NOT coalesce(k.paused_until > clock_timestamp(), false) THEN
        RETURN NULL;
    END IF;
    SELECT * INTO lim FROM orc_flow_limits WHERE name = k.limit_name;
    DELETE FROM orc_flow_spends WHERE id = p_spend AND key = p_key RETURNING * INTO gone;
    IF gone.id IS NOT NULL THEN
        UPDATE orc_flow_keys
           SET window_requests = greatest(0, window_requests - gone.requests),
               window_units = greatest(0, window_units - gone.units)
         WHERE key = p_key;
        PERFORM orc_flow_charge_v1(p_key, gone.share, -orc_flow_charged_v1(gone.units, lim), lim);
    END IF;
    RETURN extract(epoch FROM k.paused_until - clock_timestamp())::float8;
END;
$$;

-- Does one more call of one request and `p_units` fit the key's window that ends at `p_now`
-- (its spends but `p_except`, the job's reservation; of the share `p_share` alone, under its
-- cap, when given), beside `p_held` waiters (of `p_held_cost` units) handed room already?
-- (NULL, NULL): yes; else what it waits for, requests before units, and the seconds from
-- `p_now` until the window's own spends have slid out enough ('Infinity': they never free
-- enough, its room comes with spends not made yet). A call dearer than the whole window
-- counts as the whole window: it runs alone in one. The call's fit rule, its one production
-- home (tests/flow_model.py's `room` is its model).
CREATE OR REPLACE FUNCTION orc_flow_call_room_v1(
    p_key text, p_share text, p_except bigint, p_now timestamptz, p_requests bigint,
    p_units_allowed bigint, p_interval double precision, p_units bigint, p_held bigint,
    p_held_cost bigint, OUT blocked text, OUT wait double precision
)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    used_requests bigint;
    used_units bigint;
    excess bigint;
    frees timestamptz;
BEGIN
    SELECT coalesce(sum(s.requests), 0), coalesce(sum(s.units), 0)
      INTO used_requests, used_units
      FROM orc_flow_spends AS s
     WHERE s.key = p_key AND s.at > p_now - make_interval(secs => p_interval)
       AND s.id IS DISTINCT FROM p_except AND (p_share IS NULL OR s.share = p_share);
    wait := 0;
    FOR kind IN 1..2 LOOP
        CONTINUE WHEN (kind = 1 AND p_requests IS NULL)
                   OR (kind = 2 AND (p_units_allowed IS NULL OR p_units <= 0));
        excess := CASE kind WHEN 1 THEN used_requests + p_held + 1 - p_requests
                  ELSE used_units + p_held_cost + least(p_units, p_units_allowed) - p_units_allowed
                  END;
        CONTINUE WHEN excess <= 0;
        blocked := coalesce(blocked, CASE kind WHEN 1 THEN 'requests' ELSE 'units' END);
        SELECT min(w.at) + make_interval(secs => p_interval) INTO frees
          FROM (SELECT s.at, sum(CASE kind WHEN 1 THEN s.requests ELSE s.units END)
                             OVER (ORDER BY s.at, s.id) AS slid
                  FROM orc_flow_spends AS s
                 WHERE s.key = p_key AND s.at > p_now - make_interval(secs => p_interval)
                   AND s.id IS DISTINCT FROM p_except
                   AND (p_share IS NULL OR s.share = p_share)) AS w
         WHERE w.slid >= excess;
        wait := greatest(wait, coalesce(extract(epoch FROM frees - p_now)::float8, 'Infinity'));
    END LOOP;
    IF blocked IS NULL THEN
        wait := NULL;
    END IF;
END;
$$;

-- A running job's next call, before it is sent (docs/flow-control.md, "Every call admitted"),
-- to `p_model` (null: the model its key is for), estimated at `p_units`, admitted in one
-- statement under the lock of the key it is admitted against (orc_flow_model_key_v1), held for
-- this statement only: the window read, the share's cap (the limit's tenant_share) and the
-- learned allowances applied, the verdict decided, and the call's spend recorded when it goes
-- (orc_flow_call_spend_v3). `go`: at once (`after` 0), or `after` seconds from now, when its
-- room comes within orc_flow_wait_in_place_v1 (its spend placed there at once: the call waits
-- for it in place); else it parks: `blocked` (requests, units, share or paused), `at` the
-- seconds until its room comes ('Infinity': not known), `reserved` whether it would have taken
-- its claim's reservation (which, its job parked, leaves the window). `p_first`: the job's
-- first call since its claim, which takes the claim's reservation on that key if it still has
-- one, instead of a request more (its held waiters' room is then its own).
-- An external worker's call names its attempt (`p_attempt`, `p_lease_token`): taken only from
-- the attempt that holds the job's lease (`stale` true, and nothing recorded, for another),
-- whose row stays locked (before the key's: the lock order) until the call is decided; the
-- database knows whether a call of it was admitted (its first call, marked when admitted), and
-- a call named `p_call_id` that was admitted is answered again as it was (`go`, its spend
-- where it was placed: `after` what remains of its wait) without counting it twice. A call
-- that parks is not kept: asked again, it is decided again (its attempt over once its job
-- parked: stale). `key` null: nothing limits the job's calls (no key, its limit gone, or a
-- limit of concurrency alone); it goes. orchestrator.domain.flow_window is the model of this
-- rule (tests/test_flow_admission_model.py holds them to the same answers).
CREATE OR REPLACE FUNCTION orc_flow_admit_call_v1(
    p_job_id uuid, p_model text, p_units bigint, p_first boolean, p_attempt integer,
    p_lease_token uuid, p_call_id text
) RETURNS TABLE (
    key text, go boolean, units bigint, reuse boolean, after double precision, blocked text,
    at double precision, reserved boolean, spend bigint, stale boolean
)
LANGUAGE plpgsql AS $$
DECLARE
    j orc_jobs;
    k orc_flow_keys;
    lim orc_flow_limits;
    call_key text;
    job_share text;
    is_first boolean := p_first;
    clock timestamptz;
    factor double precision;
    allowed_requests bigint;
    allowed_units bigint;
    unused orc_flow_spends;
    held bigint;
    held_cost bigint;
    share_held bigint;
    share_held_cost bigint;
    ask bigint;
    blocked_by text;
    wait double precision;
    capped_by text;
    capped_wait double precision;
    placed bigint;
    answered orc_flow_admitted_calls;
BEGIN
    IF p_lease_token IS NOT NULL THEN
        SELECT * INTO j FROM orc_jobs AS o
         WHERE o.id = p_job_id AND o.attempt = p_attempt AND o.lease_token = p_lease_token
           AND o.status = 'RUNNING'
           FOR SHARE OF o;
        IF j.id IS NULL THEN
            RETURN QUERY SELECT NULL::text, false, p_units, false, 0::float8, NULL::text,
                                0::float8, false, NULL::bigint, true;
            RETURN;
        END IF;
        SELECT * INTO answered FROM orc_flow_admitted_calls AS a
         WHERE a.job_id = p_job_id AND a.attempt = p_attempt AND a.call_id = p_call_id;
        IF answered.job_id IS NOT NULL THEN  -- asked again: its answer lost on the way
            RETURN QUERY
            SELECT answered.key, true, coalesce(s.units, p_units), false,
                   greatest(0, coalesce(extract(epoch FROM s.at - clock_timestamp())::float8, 0)),
                   NULL::text, 0::float8, false, answered.spend, false
              FROM (SELECT NULL) AS one
              LEFT JOIN orc_flow_spends AS s ON s.id = answered.spend;
            RETURN;
        END IF;
        is_first := NOT EXISTS (SELECT FROM orc_flow_spent_calls AS c
                              WHERE c.job_id = j.id AND c.call_id = 'first call of ' || j.lease_token);
    ELSE
        SELECT * INTO j FROM orc_jobs AS o WHERE o.id = p_job_id;
    END IF;
    k := orc_flow_call_key_v1(j, p_model);
    lim := orc_flow_call_limit_v1(k);
    IF lim.name IS NULL THEN  -- nothing limits its calls: it goes
        RETURN QUERY SELECT NULL::text, true, p_units, false, 0::float8, NULL::text, 0::float8,
                            false, NULL::bigint, false;
        RETURN;
    END IF;
    call_key := k.key;
    job_share := coalesce(j.flow_share, '');
    k := orc_flow_expire_v1(k, lim);
    clock := clock_timestamp();
    factor := orc_flow_factor_v1(k, lim);
    allowed_requests := CASE WHEN lim.requests IS NOT NULL
                             THEN greatest(1, floor(lim.requests * factor)) END;
    allowed_units := CASE WHEN lim.units IS NOT NULL THEN greatest(1, floor(lim.units * factor)) END;
    IF is_first THEN
        SELECT * INTO unused FROM orc_flow_spends AS s
         WHERE s.job_id = p_job_id AND s.key = call_key AND NOT s.reconciled
         ORDER BY s.id DESC LIMIT 1;
    END IF;
    SELECT count(*), coalesce(sum(o.cost), 0), count(*) FILTER (WHERE o.share = job_share),
           coalesce(sum(o.cost) FILTER (WHERE o.share = job_share), 0)
      INTO held, held_cost, share_held, share_held_cost
      FROM orc_flow_waiters AS o
     WHERE o.key = call_key AND o.dispatched_at <= clock;
    IF unused.id IS NOT NULL THEN  -- the room its claim was handed is its own
        held := 0; held_cost := 0; share_held := 0; share_held_cost := 0;
    END IF;
    ask := CASE WHEN allowed_units IS NULL THEN p_units
                ELSE least(p_units, orc_flow_cap_v1(allowed_units, lim.tenant_share)) END;
    SELECT r.blocked, r.wait INTO blocked_by, wait
      FROM orc_flow_call_room_v1(call_key, NULL, unused.id, clock, allowed_requests,
                                 allowed_units, lim.interval_seconds, ask, held, held_cost) AS r;
    IF lim.tenant_share IS NOT NULL THEN
        SELECT r.blocked, r.wait INTO capped_by, capped_wait
          FROM orc_flow_call_room_v1(
                   call_key, job_share, unused.id, clock,
                   CASE WHEN allowed_requests IS NOT NULL  -- (a cap of none is none)
                        THEN orc_flow_cap_v1(allowed_requests, lim.tenant_share) END,
                   CASE WHEN allowed_units IS NOT NULL
                        THEN orc_flow_cap_v1(allowed_units, lim.tenant_share) END,
                   lim.interval_seconds, ask,
                   share_held, share_held_cost) AS r;
        IF capped_by IS NOT NULL THEN
            blocked_by := 'share';
            wait := greatest(capped_wait, coalesce(wait, 0));
        END IF;
    END IF;
    IF k.paused_until > clock THEN
        blocked_by := 'paused';
        wait := greatest(extract(epoch FROM k.paused_until - clock)::float8, coalesce(wait, 0));
    END IF;
    IF blocked_by IS NOT NULL AND wait > orc_flow_wait_in_place_v1() THEN
        RETURN QUERY SELECT call_key, false, ask, unused.id IS NOT NULL, 0::float8, blocked_by,
                            wait, unused.id IS NOT NULL, NULL::bigint, false;
        RETURN;
    END IF;
    placed := orc_flow_call_spend_v3(call_key, p_job_id, ask, unused.id IS NOT NULL,
                                     coalesce(wait, 0));
    IF p_lease_token IS NOT NULL AND is_first THEN
        INSERT INTO orc_flow_spent_calls (job_id, call_id)
        VALUES (p_job_id, 'first call of ' || p_lease_token::text) ON CONFLICT DO NOTHING;
    END IF;
    IF p_lease_token IS NOT NULL AND p_call_id IS NOT NULL THEN
        INSERT INTO orc_flow_admitted_calls (job_id, attempt, call_id, key, spend)
        VALUES (p_job_id, p_attempt, p_call_id, call_key, placed);
    END IF;
    RETURN QUERY SELECT call_key, true, ask, unused.id IS NOT NULL, coalesce(wait, 0),
                        NULL::text, 0::float8, false, placed, false;
END;
$$;

-- A call whose room comes within this many seconds waits for it in place, its room reserved;
-- one that would wait longer parks its job (orchestrator.domain.flow_window's
-- WAIT_IN_PLACE_SECONDS, the model's, which a test holds equal).
CREATE OR REPLACE FUNCTION orc_flow_wait_in_place_v1() RETURNS double precision
LANGUAGE sql IMMUTABLE AS $$ SELECT 0.25::float8 $$;
