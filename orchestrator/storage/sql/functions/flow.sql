-- Flow control (docs/flow-control.md): fleet-wide limits per key (concurrency, requests and
-- units per interval, pauses), enforced at the claim. A job whose key has no room is parked as
-- a waiter; the pump hands freed capacity to waiters in fair order, with a dispatch for now or
-- for the time their room frees. Every admission, pump, spend, pause and resume of a key takes
-- the key's lock.
--
-- Key locks are deadlock-free by construction (docs/flow-control.md, "Key locks in one order"):
-- a transaction waits for one key's lock at most, or takes all the keys it may need at once,
-- in one global order. A statement whose rows may lead to several keys (a batch of completions
-- or failures, a sweep of zombies: each job leaving RUNNING pumps its key, each waiter leaving
-- the line its key) locks its jobs first, then every key they may lead to, in the order of the
-- keys' lock ids (orc_flow_lock_keys_of_v1), before any per-row work; a fetch waits for its
-- first key only and tries any other (orc_flow_try_lock_v1); every other writer takes one key
-- per transaction. A key's lock is always taken after the jobs that lead to it, and a
-- transaction holding a key only tries the jobs and dispatches it meets after (SKIP LOCKED).

-- A key from its limit's template, in SQL (orchestrator.domain.flow.render_key's rule, for a job
-- that came without its key): {job_type}, {tenant}, {agent} ('-' for none), {payload.a.b}
-- ('-' when the payload does not hold it); the rest literal.
CREATE OR REPLACE FUNCTION orc_flow_render_v1(p_template text, j orc_jobs) RETURNS text
LANGUAGE plpgsql STABLE AS $$
DECLARE
    rendered text := '';
    rest text := p_template;
    part text[];
BEGIN
    LOOP
        part := regexp_match(rest, '^(.*?)\{([^{}]*)\}(.*)$');
        EXIT WHEN part IS NULL;
        rendered := rendered || part[1] || CASE part[2]
            WHEN 'job_type' THEN j.job_type
            WHEN 'tenant' THEN coalesce(j.tenant_id, '-')
            WHEN 'agent' THEN coalesce(j.agent_id, '-')
            ELSE coalesce(j.payload #>> string_to_array(substr(part[2], 9), '.'), '-')
        END;
        rest := part[3];
    END LOOP;
    RETURN left(rendered || rest, 200);
END;
$$;

-- The id of the key's advisory lock: the one global order in which a transaction takes several
-- keys' locks (orc_flow_lock_keys_of_v1).
CREATE OR REPLACE FUNCTION orc_flow_lock_id_v1(p_key text) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
    SELECT hashtextextended('orc_flow_key:' || p_key, 0)
$$;

-- The key's lock: every admission, pump, spend, pause and resume of a key takes it for its
-- transaction, so they take turns per key. An advisory lock, not the row's: a claim that only
-- counts (a concurrency limit) writes nothing, not even a row lock.
CREATE OR REPLACE FUNCTION orc_flow_lock_v1(p_key text) RETURNS void
LANGUAGE sql AS $$
    SELECT pg_advisory_xact_lock(orc_flow_lock_id_v1(p_key))
$$;

-- The key's lock if no other transaction holds it, without waiting: whether this one holds it
-- now. The fetch's way to a second key: a transaction waits for one key's lock at most, so key
-- locks cannot deadlock (claim.sql, orc_fetch_dispatch_v3).
CREATE OR REPLACE FUNCTION orc_flow_try_lock_v1(p_key text) RETURNS boolean
LANGUAGE sql AS $$
    SELECT pg_try_advisory_xact_lock(orc_flow_lock_id_v1(p_key))
$$;

-- Every key the jobs' writes may lock, locked now, in the order of their lock ids: the key of
-- each job still RUNNING (its release pumps it: orc_flow_release_v1) and of each waiter among
-- them (its leaving the line pumps it: orc_flow_leave_v1). For a statement that writes several
-- jobs, called once its jobs are locked and before it writes any: the triggers then take only
-- keys it holds, so two such statements meeting keys A, B and B, A take turns rather than
-- deadlock. Nothing when they lead to one key at most: a transaction that waits for one key
-- only cannot close a cycle of key locks.
CREATE OR REPLACE FUNCTION orc_flow_lock_keys_of_v1(p_job_ids uuid[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    ids bigint[] := ARRAY(
        SELECT DISTINCT orc_flow_lock_id_v1(k.key)
          FROM (SELECT j.flow_key AS key FROM orc_jobs AS j
                 WHERE j.id = ANY (p_job_ids) AND j.status = 'RUNNING'
                UNION
                SELECT w.key FROM orc_flow_waiters AS w WHERE w.job_id = ANY (p_job_ids)) AS k
         WHERE k.key IS NOT NULL
         ORDER BY 1);
    lock_id bigint;
BEGIN
    IF cardinality(ids) > 1 THEN
        FOREACH lock_id IN ARRAY ids LOOP
            PERFORM pg_advisory_xact_lock(lock_id);
        END LOOP;
    END IF;
END;
$$;

-- The key's row, under the key's lock (created on first use): two claims can never both take
-- the last unit of capacity.
CREATE OR REPLACE FUNCTION orc_flow_lock_key_v1(p_key text, p_limit text, p_task_prefix text)
RETURNS orc_flow_keys
LANGUAGE plpgsql AS $$
DECLARE
    k orc_flow_keys;
BEGIN
    PERFORM orc_flow_lock_v1(p_key);
    SELECT * INTO k FROM orc_flow_keys WHERE key = p_key;
    IF NOT FOUND THEN
        INSERT INTO orc_flow_keys (key, limit_name, task_prefix)
        VALUES (p_key, p_limit, p_task_prefix)
        ON CONFLICT (key) DO NOTHING;
        SELECT * INTO k FROM orc_flow_keys WHERE key = p_key;
    END IF;
    IF p_limit IS NOT NULL AND k.limit_name <> p_limit THEN  -- the job type's limit changed
        UPDATE orc_flow_keys SET limit_name = p_limit WHERE key = p_key RETURNING * INTO k;
    END IF;
    RETURN k;
END;
$$;

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

-- May the job (locked by the caller, about to be claimed) start now? NULL: yes, and what it
-- takes of its key's window is recorded. Else it is parked (its waiter row says for what, its
-- dispatch detached from it: the caller deletes it) and the answer is what it waits for. A job
-- that is not a waiter sent ahead also waits behind waiters scheduled ahead; only the waiters
-- due by now hold capacity; a waiter sent ahead that is admitted pumps its key first, so the
-- schedule keeps a horizon ahead. A job whose type can move to a fallback model passes a
-- provider's pause longer than its threshold (its call goes to another model's key: it
-- reserves nothing in this key's window), and waits in line only behind the waiters that can
-- pass it too. Within the key, the job's share holds no more than its cap (tenant_share). A
-- job admitted that no pump handed room is charged to its share here.
CREATE OR REPLACE FUNCTION orc_flow_admit_v1(j orc_jobs, p_task_prefix text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    k orc_flow_keys := orc_flow_lock_key_v1(j.flow_key, j.flow_limit, p_task_prefix);
    paused orc_flow_keys;
    lim orc_flow_limits;
    waiter orc_flow_waiters;
    blocked text;
    wake timestamptz;
    passes boolean;
    cost bigint;
BEGIN
    SELECT * INTO lim FROM orc_flow_limits WHERE name = k.limit_name;
    lim := orc_flow_limit_of_v1(k, lim);  -- as the key meets it: lowered to what it learned
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
    cost := orc_flow_estimate_v1(j.flow_cost, lim);  -- whatever was declared: 1 to a cap
    paused := k;
    passes := false;
    IF k.paused_until > clock_timestamp() THEN  -- (the type is read only for a paused key)
        passes := orc_flow_passes_pause_v1(k, j.job_type);
    END IF;
    IF passes THEN  -- (this copy of the key only: its task makes its call on a fallback model)
        k.paused_until := NULL;
    END IF;
    IF k.paused_until > clock_timestamp() THEN
        blocked := 'paused';
    ELSIF waiter.dispatched_at IS NULL
          AND EXISTS (SELECT FROM orc_flow_waiters AS w
                       WHERE w.key = j.flow_key AND w.job_id <> j.id
                         AND (w.dispatched_at IS NULL
                              OR (w.dispatched_at > clock_timestamp() AND w.blocked_on <> 'share'))
                         AND (NOT passes
                              OR orc_flow_passes_pause_v1(paused, (SELECT o.job_type FROM orc_jobs AS o
                                                                    WHERE o.id = w.job_id))))
    THEN
        blocked := 'line';  -- others were first (those that can go as it can)
    ELSE
        SELECT c.blocked, c.wake INTO blocked, wake
          FROM (SELECT count(*) AS held, coalesce(sum(w.cost), 0) AS held_cost
                  FROM orc_flow_waiters AS w
                 WHERE w.key = j.flow_key AND w.dispatched_at <= clock_timestamp()
                   AND w.job_id <> j.id) AS h,
               orc_flow_capacity_v1(k, lim, cost, h.held::integer, h.held_cost::bigint) AS c;
        IF blocked IS NULL AND lim.tenant_share IS NOT NULL THEN
            SELECT c.blocked, c.wake INTO blocked, wake
              FROM (SELECT count(*) AS held, coalesce(sum(w.cost), 0) AS held_cost
                      FROM orc_flow_waiters AS w
                     WHERE w.key = j.flow_key AND w.dispatched_at <= clock_timestamp()
                       AND w.share = coalesce(j.flow_share, '') AND w.job_id <> j.id) AS h,
                   orc_flow_share_capacity_v1(k, lim, coalesce(j.flow_share, ''), cost,
                                              h.held::integer, h.held_cost::bigint) AS c;
        END IF;
    END IF;
    IF blocked IS NULL THEN
        IF waiter.dispatched_at IS NULL THEN  -- (a pump charged the waiters it handed room)
            PERFORM orc_flow_charge_v1(j.flow_key, j.flow_share, orc_flow_charged_v1(cost, lim),
                                       lim);
        END IF;
        IF (lim.requests IS NOT NULL OR lim.units IS NOT NULL) AND NOT passes THEN
            IF waiter.dispatched_at IS NOT NULL THEN
                PERFORM orc_flow_pump_v1(j.flow_key);
            END IF;
            PERFORM orc_flow_record_spend_v2(j.flow_key, j.id, 1, cost, clock_timestamp());
        END IF;
        IF waiter.job_id IS NOT NULL THEN
            DELETE FROM orc_flow_waiters WHERE job_id = j.id;
        END IF;
        RETURN NULL;
    END IF;

    -- Parked.
    PERFORM orc_flow_share_waits_v1(j.flow_key, coalesce(j.flow_share, ''));
    IF waiter.job_id IS NULL THEN
        INSERT INTO orc_flow_waiters (job_id, key, share, cost, blocked_on, priority)
        VALUES (j.id, j.flow_key, coalesce(j.flow_share, ''), cost::integer, blocked, j.priority);
        INSERT INTO orc_job_events (job_id, kind, payload)
        VALUES (j.id, 'job.waiting_for_capacity',
                jsonb_build_object('key', j.flow_key, 'waiting_on', blocked, 'status', j.status));
    ELSE  -- back in line, at its old place, its charge given back
        UPDATE orc_flow_waiters
           SET dispatched_at = NULL, blocked_on = blocked, key = j.flow_key
         WHERE job_id = j.id;
        IF waiter.dispatched_at IS NOT NULL THEN
            PERFORM orc_flow_charge_v1(j.flow_key, waiter.share,
                                       -orc_flow_charged_v1(orc_flow_estimate_v1(waiter.cost, lim),
                                                            lim),
                                       lim);
        END IF;
    END IF;
    UPDATE orc_jobs SET procrastinate_job_id = NULL WHERE id = j.id;
    PERFORM orc_flow_pump_v1(j.flow_key);  -- the head of the line may go, or wait for a time
    RETURN blocked;
END;
$$;

-- The gate every claim passes (the fetch's, a claim left for later, the replay's): a job under
-- a limit whose key has no room for it now is parked, and the dispatch that brought it is
-- deleted. True: parked. The job row is locked by the caller.
CREATE OR REPLACE FUNCTION orc_flow_gate_v1(
    p_job_id uuid, p_dispatch_id bigint, p_claimable text[], p_task_prefix text
) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    j orc_jobs;
BEGIN
    SELECT * INTO j FROM orc_jobs AS o WHERE o.id = p_job_id;
    IF j.flow_key IS NULL AND j.status = ANY (p_claimable) THEN
        -- Submitted without its flow, though its type runs under a limit: it gets it now.
        UPDATE orc_jobs AS o
           SET flow_key = orc_flow_render_v1(l.key_template, j), flow_limit = l.name,
               flow_cost = 1,
               flow_share = coalesce(CASE l.share_by WHEN 'tenant' THEN j.tenant_id
                                                     WHEN 'agent' THEN j.agent_id END, '')
          FROM orc_flow_job_types AS t JOIN orc_flow_limits AS l ON l.name = t.limit_name
         WHERE t.job_type = j.job_type AND o.id = j.id
        RETURNING o.* INTO j;
        IF j.id IS NULL THEN
            RETURN false;  -- no limit for its type
        END IF;
    END IF;
    IF j.flow_key IS NULL OR NOT (j.status = ANY (p_claimable))
       OR j.procrastinate_job_id IS DISTINCT FROM p_dispatch_id
       OR orc_flow_admit_v1(j, p_task_prefix) IS NULL THEN
        RETURN false;
    END IF;
    PERFORM procrastinate_finish_job_v1(p_dispatch_id, 'succeeded', true);
    RETURN true;
END;
$$;

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

-- A 429 or 529 from the provider behind a key. With the server's hint (`p_seconds` from now,
-- by the database's clock), the key pauses for the whole fleet until then, its waiters sent
-- ahead rescheduled when that moves its end; without one, its rate factor halves.
CREATE OR REPLACE FUNCTION orc_flow_throttled_v2(p_key text, p_seconds double precision, p_reason text)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    k orc_flow_keys;
    lim orc_flow_limits;
    until timestamptz := clock_timestamp() + make_interval(secs => p_seconds);
BEGIN
    PERFORM orc_flow_lock_v1(p_key);
    SELECT * INTO k FROM orc_flow_keys WHERE key = p_key;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT * INTO lim FROM orc_flow_limits WHERE name = k.limit_name;
    IF until IS NULL THEN
        UPDATE orc_flow_keys
           SET rate_factor = greatest(1.0 / 64,
                                      coalesce(orc_flow_factor_v1(k, lim), rate_factor) / 2),
               factor_at = now(),
               throttled = throttled + 1
         WHERE key = p_key;
        RETURN;
    END IF;
    -- An operator's pause stays the operator's (no type passes it) when a hint extends it.
    UPDATE orc_flow_keys
       SET paused_until = greatest(paused_until, until),
           pause_reason = CASE WHEN paused_until >= until
                                    OR (paused_until > clock_timestamp() AND paused_by <> 'provider')
                               THEN pause_reason ELSE p_reason END,
           paused_by = CASE WHEN paused_until >= until
                                 OR (paused_until > clock_timestamp() AND paused_by <> 'provider')
                            THEN paused_by ELSE 'provider' END,
           throttled = throttled + 1
     WHERE key = p_key;
    IF k.paused_until IS NULL OR k.paused_until < until THEN
        PERFORM orc_flow_reschedule_v1(p_key);
    END IF;
END;
$$;

-- orc_flow_throttled_v2 with the pause's end as a time of the caller's clock (the release
-- before calls it).
CREATE OR REPLACE FUNCTION orc_flow_throttled_v1(p_key text, p_until timestamptz, p_reason text)
RETURNS void
LANGUAGE sql AS $$
    SELECT orc_flow_throttled_v2(p_key, extract(epoch FROM p_until - clock_timestamp()), p_reason)
$$;

-- An operator pauses a key for `p_seconds` from now, by the database's clock: no job of it
-- starts before then. Its waiters sent ahead are rescheduled for the new end, whether it comes
-- sooner or later than the one they had. False: no such key.
CREATE OR REPLACE FUNCTION orc_flow_pause_v1(
    p_key text, p_seconds double precision, p_reason text, p_by text
) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM orc_flow_lock_v1(p_key);
    UPDATE orc_flow_keys
       SET paused_until = clock_timestamp() + make_interval(secs => p_seconds),
           pause_reason = p_reason, paused_by = p_by
     WHERE key = p_key;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM orc_flow_reschedule_v1(p_key);
    RETURN true;
END;
$$;

-- An operator lifts a key's pause (and its adaptive slow-down): its line goes now.
-- NULL: no such key; else how many waiters got a dispatch.
CREATE OR REPLACE FUNCTION orc_flow_resume_v1(p_key text) RETURNS integer
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM orc_flow_lock_v1(p_key);
    UPDATE orc_flow_keys
       SET paused_until = NULL, pause_reason = NULL, paused_by = NULL,
           rate_factor = 1, factor_at = now()
     WHERE key = p_key;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    RETURN orc_flow_reschedule_v1(p_key);
END;
$$;

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
            jsonb_build_object('key', j.flow_key, 'waiting_on', p_blocked, 'status', j.status));
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

-- The key's limit as the key meets it (docs/flow-control.md, "Limits learned from the
-- provider"): for a limit that learns, its requests and units each lowered to what the key's
-- provider allows (never raised: a configured one is a ceiling), or what it allows where the
-- limit configures none (orchestrator.domain.flow_learned.allowances, the same rule). Every
-- reader of a key's window reads its limit through this.
CREATE OR REPLACE FUNCTION orc_flow_limit_of_v1(k orc_flow_keys, lim orc_flow_limits)
RETURNS orc_flow_limits
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF lim.learn THEN
        lim.requests := least(lim.requests, k.learned_requests);  -- (least skips a null)
        lim.units := least(lim.units, k.learned_units);
    END IF;
    RETURN lim;
END;
$$;

-- What a reply of the key's provider said of its limits (its rate-limit headers, parsed by
-- orchestrator.domain.flow_learned), for a key whose limit learns; nothing for another. The
-- key keeps the provider's limits of requests and units per its period, the latest said (a
-- null: not said, the one kept stays). A limit with nothing remaining holds the key for
-- `p_hold` seconds, until its reset: the key is paused until then, by the database's clock,
-- unless its own window already holds it that long (within the pump's 50 ms), so a key in step
-- with its provider is not paused at every reply. Its waiters are rescheduled when its
-- allowances or its pause changed.
CREATE OR REPLACE FUNCTION orc_flow_learn_v1(
    p_key text, p_requests bigint, p_units bigint, p_hold double precision, p_reason text
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    k orc_flow_keys;
    lim orc_flow_limits;
    before orc_flow_limits;
    after orc_flow_limits;
    blocked text;
    wake timestamptz;
    until timestamptz;
    changed boolean;
BEGIN
    PERFORM orc_flow_lock_v1(p_key);
    SELECT * INTO k FROM orc_flow_keys WHERE key = p_key;
    SELECT * INTO lim FROM orc_flow_limits WHERE name = k.limit_name;
    IF k.key IS NULL OR lim.name IS NULL OR NOT lim.learn THEN
        RETURN;
    END IF;
    before := orc_flow_limit_of_v1(k, lim);
    IF (k.learned_requests, k.learned_units)
       IS DISTINCT FROM (coalesce(p_requests, k.learned_requests), coalesce(p_units, k.learned_units))
    THEN
        UPDATE orc_flow_keys
           SET learned_requests = coalesce(p_requests, learned_requests),
               learned_units = coalesce(p_units, learned_units), learned_at = now()
         WHERE key = p_key
        RETURNING * INTO k;
    END IF;
    after := orc_flow_limit_of_v1(k, lim);
    changed := (before.requests, before.units) IS DISTINCT FROM (after.requests, after.units);
    IF p_hold > 0 THEN
        until := clock_timestamp() + make_interval(secs => p_hold);
        IF after.requests IS NOT NULL OR after.units IS NOT NULL THEN
            k := orc_flow_expire_v1(k, after);
            SELECT c.blocked, c.wake INTO blocked, wake
              FROM orc_flow_capacity_v1(k, after, 1, 0, 0) AS c;
        END IF;
        IF until > coalesce(CASE WHEN blocked IS NOT NULL THEN wake END, clock_timestamp())
                   + interval '50 milliseconds'
           AND (k.paused_until IS NULL OR k.paused_until < until) THEN
            UPDATE orc_flow_keys
               SET paused_until = until, pause_reason = p_reason, paused_by = 'provider'
             WHERE key = p_key;
            changed := true;
        END IF;
    END IF;
    IF changed THEN
        PERFORM orc_flow_reschedule_v1(p_key);
    END IF;
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
