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
    own orc_flow_keys;
    call_key text;
    job_share text;
    k orc_flow_keys;
    lim orc_flow_limits;
    factor double precision;
    unused orc_flow_spends;
BEGIN
    SELECT * INTO j FROM orc_jobs AS o WHERE o.id = p_job_id;
    SELECT * INTO own FROM orc_flow_keys AS f WHERE f.key = j.flow_key;
    IF own.key IS NULL THEN
        RETURN;
    END IF;
    call_key := orc_flow_model_key_v1(j, p_model);
    job_share := coalesce(j.flow_share, '');
    k := orc_flow_lock_key_v1(call_key, own.limit_name, own.task_prefix);
    SELECT * INTO lim FROM orc_flow_limits AS l WHERE l.name = k.limit_name;
    lim := orc_flow_limit_of_v1(k, lim);
    IF lim.name IS NULL OR (lim.requests IS NULL AND lim.units IS NULL) THEN
        RETURN;
    END IF;
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

-- A running job's call admitted (after orc_flow_call_window_v2, in its transaction) on the key
-- it named, `p_after` seconds from now (0: at once; else the instant its room comes, which it
-- waits for in place): a request and its estimate recorded in the key's window at that instant,
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
