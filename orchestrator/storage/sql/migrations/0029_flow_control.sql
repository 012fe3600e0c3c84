-- 0029_flow_control: fleet-wide limits per key, enforced at the claim (docs/flow-control.md).
--
-- compatible-with-older-workers: yes
--
-- (The previous release's workers fetch through orc_fetch_dispatches_v2, which knows nothing
-- of limits: while they still run, the jobs they claim are not held back.)
--
-- A job type under a limit ([limits.<name>] in the retry config, `limit = "<name>"` per type)
-- has its jobs' key, limit, cost and share stored at submit (orc_jobs.flow_*). Each process
-- that applies a config writes its limits into orc_flow_limits. Every claim of such a job
-- first asks orc_flow_admit_v1, under the lock of its key's row (orc_flow_keys): is the key
-- paused, are other jobs of the key already waiting in line, is its concurrency reached (its
-- RUNNING jobs, counted through a partial index), are its requests or units per interval spent
-- (a sliding window over orc_flow_spends)? If any, the job is not claimed: it is *parked*
-- (orc_flow_waiters: its status stays PENDING or RETRY, its attempt and budgets untouched), its
-- dispatch is deleted, and the fetch goes on to the next dispatch, so no worker slot waits for
-- it. Capacity that frees is handed on by orc_flow_pump_v1, which gives the next waiters a
-- dispatch (the insert wakes the workers): when a job of the key leaves RUNNING (a trigger:
-- finished, retried, failed, cancelled, handed back or swept), when an operator lifts a pause,
-- when the limits change, and, for a wait that ends at a known time (a pause, a window that
-- slides), through one waiter dispatched for that time. Waiters are taken in a fair order:
-- the share (tenant, or agent) with the least virtual time goes next, and each dispatch adds
-- its cost over the share's weight to its share's virtual time.

ALTER TABLE orc_jobs
    ADD COLUMN flow_key text,
    ADD COLUMN flow_limit text,
    ADD COLUMN flow_cost integer CHECK (flow_cost >= 0),
    ADD COLUMN flow_share text;

ALTER TYPE orc_job_spec_v1
    ADD ATTRIBUTE flow_key text,
    ADD ATTRIBUTE flow_limit text,
    ADD ATTRIBUTE flow_cost integer,
    ADD ATTRIBUTE flow_share text;

-- The running jobs of a key: what its concurrency counts (at most its limit rows are read).
CREATE INDEX orc_jobs_flow_running ON orc_jobs (flow_key)
    WHERE status = 'RUNNING' AND flow_key IS NOT NULL;

CREATE TABLE orc_flow_limits (
    name text PRIMARY KEY,
    concurrency integer CHECK (concurrency > 0),
    requests integer CHECK (requests > 0),
    units bigint CHECK (units > 0),
    interval_seconds double precision NOT NULL CHECK (interval_seconds > 0),
    weights jsonb NOT NULL DEFAULT '{}',
    key_template text NOT NULL DEFAULT '{job_type}',
    share_by text NOT NULL DEFAULT 'tenant' CHECK (share_by IN ('tenant', 'agent', 'none')),
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- Which job types run under which limit, as the config in effect says: a job submitted without
-- its flow (by a producer on another config, or straight in SQL) gets it at its claim.
CREATE TABLE orc_flow_job_types (
    job_type text PRIMARY KEY,
    limit_name text NOT NULL
);

-- A key from its limit's template, in SQL (orchestrator.domain.flow.render_key's rule, for a job
-- that came without its key): {job_type}, {tenant}, {agent} ('-' for none), {payload.a.b}
-- ('-' when the payload does not hold it); the rest literal.
CREATE FUNCTION orc_flow_render_v1(p_template text, j orc_jobs) RETURNS text
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

CREATE TABLE orc_flow_keys (
    key text PRIMARY KEY,
    limit_name text NOT NULL,
    task_prefix text NOT NULL,
    -- Adaptive rate: a 429 without a hint halves it (to 1/64 at least); it recovers by a tenth
    -- of the limit per interval without one (orc_flow_factor_v1).
    rate_factor double precision NOT NULL DEFAULT 1 CHECK (rate_factor > 0 AND rate_factor <= 1),
    factor_at timestamptz NOT NULL DEFAULT now(),
    paused_until timestamptz,
    pause_reason text,
    paused_by text,
    throttled integer NOT NULL DEFAULT 0,      -- 429s and 529s reported for this key
    -- The sums of its spends still in the window (kept as spends come and go, so a claim reads
    -- two numbers, not the window's rows).
    window_requests bigint NOT NULL DEFAULT 0,
    window_units bigint NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- What each admitted job spent of its key's window (reconciled after its calls).
CREATE TABLE orc_flow_spends (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key text NOT NULL,
    job_id uuid,
    -- The instant of the decision (not of the transaction: a fetch may wait for the key's lock).
    at timestamptz NOT NULL DEFAULT clock_timestamp(),
    requests integer NOT NULL,
    units bigint NOT NULL,
    reconciled boolean NOT NULL DEFAULT false  -- its units are a call's real usage
);
CREATE INDEX orc_flow_spends_key_at ON orc_flow_spends (key, at);
CREATE INDEX orc_flow_spends_job ON orc_flow_spends (job_id) WHERE job_id IS NOT NULL;

CREATE TABLE orc_flow_waiters (
    job_id uuid PRIMARY KEY REFERENCES orc_jobs (id) ON DELETE CASCADE,
    key text NOT NULL,
    share text NOT NULL,
    cost integer NOT NULL,
    seq bigint GENERATED ALWAYS AS IDENTITY,
    blocked_on text NOT NULL
        CHECK (blocked_on IN ('concurrency', 'requests', 'units', 'paused', 'line')),
    parked_at timestamptz NOT NULL DEFAULT now(),
    dispatched_at timestamptz          -- the pump gave it a dispatch: it is on its way to a claim
);
CREATE INDEX orc_flow_waiters_line ON orc_flow_waiters (key, share, seq)
    WHERE dispatched_at IS NULL;
CREATE INDEX orc_flow_waiters_dispatched ON orc_flow_waiters (key)
    WHERE dispatched_at IS NOT NULL;

CREATE TABLE orc_flow_shares (
    key text NOT NULL,
    share text NOT NULL,
    vtime double precision NOT NULL DEFAULT 0,
    PRIMARY KEY (key, share)
);

-- The key's rate factor now: its stored value recovered by a tenth per interval since.
CREATE FUNCTION orc_flow_factor_v1(k orc_flow_keys, lim orc_flow_limits)
RETURNS double precision
LANGUAGE sql STABLE AS $$
    SELECT least(1.0, k.rate_factor
                      + extract(epoch FROM now() - k.factor_at) / (10 * lim.interval_seconds))
$$;

-- Can one more job of `p_cost` start on the key now, beyond the `p_held` jobs (of `p_held_cost`
-- units) that already hold a dispatch for it? (NULL, NULL): yes; else what it waits for and,
-- where that is known, when it can.
CREATE FUNCTION orc_flow_capacity_v1(
    k orc_flow_keys, lim orc_flow_limits, p_cost bigint, p_held integer, p_held_cost bigint,
    OUT blocked text, OUT wake timestamptz
)
LANGUAGE plpgsql AS $$
DECLARE
    factor double precision := orc_flow_factor_v1(k, lim);
    allowed bigint;
    running integer;
    used_requests bigint;
    used_units bigint;
    cost bigint;
BEGIN
    IF k.paused_until > clock_timestamp() THEN
        blocked := 'paused'; wake := k.paused_until;
        RETURN;
    END IF;
    IF lim.concurrency IS NOT NULL THEN
        allowed := greatest(1, floor(lim.concurrency * factor));
        SELECT count(*) INTO running
          FROM (SELECT FROM orc_jobs AS j
                 WHERE j.flow_key = k.key AND j.status = 'RUNNING' AND j.flow_key IS NOT NULL
                 LIMIT allowed) AS r;
        IF running + p_held >= allowed THEN
            blocked := 'concurrency';
            RETURN;
        END IF;
    END IF;
    IF lim.requests IS NULL AND lim.units IS NULL THEN
        RETURN;
    END IF;
    used_requests := k.window_requests;  -- as of the last expiry (orc_flow_expire_v1)
    used_units := k.window_units;
    IF lim.requests IS NOT NULL THEN
        allowed := greatest(1, floor(lim.requests * factor));
        IF used_requests + p_held + 1 > allowed THEN
            blocked := 'requests';
            -- When enough of the window's requests have slid out of it.
            SELECT w.at + make_interval(secs => lim.interval_seconds) INTO wake
              FROM (SELECT s.at, sum(s.requests) OVER (ORDER BY s.at, s.id) AS slid
                      FROM orc_flow_spends AS s
                     WHERE s.key = k.key
                       AND s.at > clock_timestamp() - make_interval(secs => lim.interval_seconds)) AS w
             WHERE w.slid >= used_requests + p_held + 1 - allowed
             ORDER BY w.at
             LIMIT 1;
            wake := coalesce(wake, clock_timestamp() + make_interval(secs => lim.interval_seconds));
            RETURN;
        END IF;
    END IF;
    IF lim.units IS NOT NULL THEN
        allowed := greatest(1, floor(lim.units * factor));
        cost := least(p_cost, allowed);  -- a job dearer than the whole window runs alone in it
        IF used_units + p_held_cost + cost > allowed THEN
            blocked := 'units';
            SELECT w.at + make_interval(secs => lim.interval_seconds) INTO wake
              FROM (SELECT s.at, sum(s.units) OVER (ORDER BY s.at, s.id) AS slid
                      FROM orc_flow_spends AS s
                     WHERE s.key = k.key
                       AND s.at > clock_timestamp() - make_interval(secs => lim.interval_seconds)) AS w
             WHERE w.slid >= used_units + p_held_cost + cost - allowed
             ORDER BY w.at
             LIMIT 1;
            wake := coalesce(wake, clock_timestamp() + make_interval(secs => lim.interval_seconds));
            RETURN;
        END IF;
    END IF;
END;
$$;

-- The key's spends that slid out of its window go, and its window's sums with them. The key
-- is locked by the caller; its row as it is now.
CREATE FUNCTION orc_flow_expire_v1(k orc_flow_keys, lim orc_flow_limits) RETURNS orc_flow_keys
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

-- A job's spend in its key's window: recorded with the window's sums.
CREATE FUNCTION orc_flow_record_spend_v1(
    p_key text, p_job_id uuid, p_requests integer, p_units bigint
) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO orc_flow_spends (key, job_id, requests, units)
    VALUES (p_key, p_job_id, p_requests, p_units);
    UPDATE orc_flow_keys
       SET window_requests = window_requests + p_requests, window_units = window_units + p_units
     WHERE key = p_key;
$$;

-- What an admitted job's call really used (`p_units`): the first call since its admission
-- corrects the reservation made then (and marks it reconciled), a later one (an agent's next
-- turn) adds a request and its units. Nothing for a key without requests or units.
CREATE FUNCTION orc_flow_spend_v1(p_key text, p_job_id uuid, p_units bigint)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    reserved orc_flow_spends;
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
    IF reserved.id IS NULL THEN
        PERFORM orc_flow_record_spend_v1(p_key, p_job_id, 1, p_units);
        UPDATE orc_flow_spends SET reconciled = true
         WHERE id = (SELECT max(id) FROM orc_flow_spends WHERE job_id = p_job_id AND key = p_key);
        RETURN;
    END IF;
    UPDATE orc_flow_spends SET units = p_units, reconciled = true WHERE id = reserved.id;
    UPDATE orc_flow_keys SET window_units = greatest(0, window_units + p_units - reserved.units)
     WHERE key = p_key;
END;
$$;

-- The key's lock: every admission, pump, spend, pause and resume of a key takes it for its
-- transaction, so they take turns per key. An advisory lock, not the row's: a claim that only
-- counts (a concurrency limit) writes nothing, not even a row lock.
CREATE FUNCTION orc_flow_lock_v1(p_key text) RETURNS void
LANGUAGE sql AS $$
    SELECT pg_advisory_xact_lock(hashtextextended('orc_flow_key:' || p_key, 0))
$$;

-- The key's row, under the key's lock (created on first use): two claims can never both take
-- the last unit of capacity.
CREATE FUNCTION orc_flow_lock_key_v1(p_key text, p_limit text, p_task_prefix text)
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

-- Give jobs a dispatch for `p_at` (now when null or past), as orc_dispatch_v1 does.
CREATE FUNCTION orc_flow_dispatch_v1(p_job_ids uuid[], p_at timestamptz, p_task_prefix text)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    deferred bigint[];
BEGIN
    SELECT procrastinate_defer_jobs_v1(array_agg(ROW(
               j.queue, p_task_prefix || j.job_type, -j.priority, j.id::text, NULL,
               jsonb_build_object('job_id', j.id), CASE WHEN p_at > now() THEN p_at END
           )::procrastinate_job_to_defer_v1))
      INTO deferred
      FROM orc_jobs AS j WHERE j.id = ANY (p_job_ids);
    UPDATE orc_jobs AS j SET procrastinate_job_id = p.id
      FROM procrastinate_jobs AS p
     WHERE p.id = ANY (deferred) AND j.id = (p.args ->> 'job_id')::uuid;
    IF p_at > now() THEN
        PERFORM pg_notify('orc_wakeup', extract(epoch FROM p_at)::text);
    END IF;
END;
$$;

-- Hand the key's free capacity to its waiters, in fair order: each one taken gets a dispatch
-- now. When the next one must wait for a known time (a pause, a window sliding) and none is
-- on its way, it alone gets a dispatch for that time. Returns how many were dispatched.
CREATE FUNCTION orc_flow_pump_v1(p_key text) RETURNS integer
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
    now_ids uuid[] := '{}';
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
        IF blocked IS NOT NULL AND (held > 0 OR wake IS NULL) THEN
            EXIT;  -- capacity frees later, and somebody will pump then
        END IF;
        weight := coalesce((lim.weights ->> pick)::double precision, 1);
        UPDATE orc_flow_shares AS s
           SET vtime = s.vtime + CASE WHEN lim.units IS NULL THEN 1 ELSE waiter.cost END / weight
         WHERE s.key = p_key AND s.share = pick;
        UPDATE orc_flow_waiters SET dispatched_at = now() WHERE job_id = waiter.job_id;
        held := held + 1;
        held_cost := held_cost + waiter.cost;
        IF blocked IS NOT NULL THEN  -- it alone goes, at the time capacity frees
            PERFORM orc_flow_dispatch_v1(ARRAY[waiter.job_id], wake, k.task_prefix);
            EXIT;
        END IF;
        now_ids := now_ids || waiter.job_id;
    END LOOP;
    IF cardinality(now_ids) > 0 THEN
        PERFORM orc_flow_dispatch_v1(now_ids, NULL, k.task_prefix);
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

-- May the job (locked by the caller, about to be claimed) start now? NULL: yes, and what it
-- takes of its key's window is recorded. Else it is parked (its waiter row says for what, its
-- dispatch detached from it: the caller deletes it) and the answer is what it waits for.
CREATE FUNCTION orc_flow_admit_v1(j orc_jobs, p_task_prefix text) RETURNS text
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
          AND EXISTS (SELECT FROM orc_flow_waiters AS w
                       WHERE w.key = j.flow_key AND w.dispatched_at IS NULL AND w.job_id <> j.id)
    THEN
        blocked := 'line';  -- others were first
    ELSE
        SELECT c.blocked, c.wake INTO blocked, wake
          FROM orc_flow_capacity_v1(
                   k, lim, coalesce(j.flow_cost, 1),
                   (SELECT count(*)::integer FROM orc_flow_waiters AS w
                     WHERE w.key = j.flow_key AND w.dispatched_at IS NOT NULL
                       AND w.job_id <> j.id),
                   (SELECT coalesce(sum(w.cost), 0)::bigint FROM orc_flow_waiters AS w
                     WHERE w.key = j.flow_key AND w.dispatched_at IS NOT NULL
                       AND w.job_id <> j.id)) AS c;
    END IF;
    IF blocked IS NULL THEN
        IF lim.requests IS NOT NULL OR lim.units IS NOT NULL THEN
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

-- The gate every claim passes (the fetch's, a claim left for later, the replay's): a job under
-- a limit whose key has no room for it now is parked, and the dispatch that brought it is
-- deleted. True: parked. The job row is locked by the caller.
CREATE FUNCTION orc_flow_gate_v1(
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

-- orc_claim_v1 through the gate, naming the job's key: no row when the job was parked (or the
-- dispatch is stale).
CREATE FUNCTION orc_claim_v2(
    p_job_id uuid, p_procrastinate_job_id bigint, p_run integer, p_worker text,
    p_claimable text[], p_running text, p_task_prefix text
) RETURNS TABLE (
    id uuid, job_type text, payload jsonb, attempt integer, max_attempts integer,
    dispatch_attempt integer, retry_count integer, max_retries integer, lease_token uuid,
    locked_by text, queue text, priority integer, timeout_seconds integer, trace_id text,
    agent_id text, tenant_id text, started_at timestamptz, traceparent text, run_at timestamptz,
    flow_key text
)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM FROM orc_jobs AS o WHERE o.id = p_job_id FOR NO KEY UPDATE;
    IF orc_flow_gate_v1(p_job_id, p_procrastinate_job_id, p_claimable, p_task_prefix) THEN
        RETURN;
    END IF;
    RETURN QUERY
    SELECT c.*, (SELECT o.flow_key FROM orc_jobs AS o WHERE o.id = c.id)
      FROM orc_claim_v1(p_job_id, p_procrastinate_job_id, p_run, p_worker, p_claimable,
                        p_running) AS c;
END;
$$;

-- Procrastinate's fetch, leaving the `p_excluded` queues alone: the fetch half of
-- orc_fetch_dispatch_v2 (migration 0019), unchanged.
CREATE FUNCTION orc_take_dispatch_v1(
    p_queues character varying[], p_excluded character varying[], p_worker_id bigint
) RETURNS procrastinate_jobs
LANGUAGE plpgsql AS $$
DECLARE
    fetched procrastinate_jobs;
BEGIN
    IF coalesce(cardinality(p_excluded), 0) = 0 THEN
        RETURN procrastinate_fetch_job_v2(p_queues, p_worker_id);
    END IF;
    WITH candidate AS (
        SELECT jobs.*
          FROM procrastinate_jobs AS jobs
         WHERE NOT EXISTS (
                   SELECT 1
                     FROM procrastinate_jobs AS other_jobs
                    WHERE jobs.lock IS NOT NULL
                      AND other_jobs.lock = jobs.lock
                      AND (other_jobs.status = 'doing'
                           OR (other_jobs.status = 'todo'
                               AND (other_jobs.priority > jobs.priority
                                    OR (other_jobs.priority = jobs.priority
                                        AND other_jobs.id < jobs.id)))))
           AND jobs.status = 'todo'
           AND (p_queues IS NULL OR jobs.queue_name = ANY (p_queues))
           AND jobs.queue_name <> ALL (p_excluded)
           AND (jobs.scheduled_at IS NULL OR jobs.scheduled_at <= now())
         ORDER BY jobs.priority DESC, jobs.id ASC
         LIMIT 1
           FOR UPDATE OF jobs SKIP LOCKED
    )
    UPDATE procrastinate_jobs
       SET status = 'doing', worker_id = p_worker_id
      FROM candidate
     WHERE procrastinate_jobs.id = candidate.id
    RETURNING procrastinate_jobs.* INTO fetched;
    RETURN fetched;
END;
$$;

-- The fetch of orc_fetch_dispatch_v2 (migration 0019), its claim through the gate: a
-- dispatch whose job is parked instead is deleted and the next one fetched in its place.
-- Past 100 parked in one call, the last one comes back without a claim (a stale dispatch),
-- so its worker fetches again at once rather than this statement running on.
CREATE FUNCTION orc_fetch_dispatch_v3(
    p_queues character varying[], p_excluded character varying[], p_worker_id bigint,
    p_task_prefix text, p_worker text, p_claimable text[], p_running text
) RETURNS SETOF procrastinate_jobs
LANGUAGE plpgsql AS $$
DECLARE
    fetched procrastinate_jobs;
    job uuid;
    claim jsonb;
BEGIN
    FOR parked IN 0 .. 100 LOOP
        fetched := orc_take_dispatch_v1(p_queues, p_excluded, p_worker_id);
        IF fetched.id IS NULL OR NOT starts_with(fetched.task_name, p_task_prefix) THEN
            RETURN NEXT fetched;
            RETURN;
        END IF;
        job := (fetched.args ->> 'job_id')::uuid;
        PERFORM FROM orc_jobs AS j WHERE j.id = job FOR NO KEY UPDATE SKIP LOCKED;
        IF NOT FOUND AND EXISTS (SELECT FROM orc_jobs AS j WHERE j.id = job) THEN
            fetched.args := fetched.args || '{"claim": null, "claim_later": true}';
            RETURN NEXT fetched;
            RETURN;
        END IF;
        IF NOT orc_flow_gate_v1(job, fetched.id, p_claimable, p_task_prefix) THEN
            SELECT to_jsonb(c) || jsonb_build_object('flow_key', o.flow_key) INTO claim
              FROM orc_claim_v1(job, fetched.id, fetched.attempts + 1,
                                p_worker || '/w' || p_worker_id, p_claimable, p_running) AS c
              JOIN orc_jobs AS o ON o.id = c.id;
            fetched.args := fetched.args || jsonb_build_object('claim', claim);
            RETURN NEXT fetched;
            RETURN;
        END IF;
    END LOOP;
    fetched.args := fetched.args || '{"claim": null}';  -- parked, and gone: the worker ends it
    RETURN NEXT fetched;
END;
$$;

CREATE FUNCTION orc_fetch_dispatches_v3(
    p_limit integer, p_queues character varying[], p_excluded character varying[],
    p_worker_id bigint, p_task_prefix text, p_worker text, p_claimable text[], p_running text
) RETURNS SETOF procrastinate_jobs
LANGUAGE plpgsql AS $$
DECLARE
    fetched procrastinate_jobs;
BEGIN
    FOR i IN 1 .. p_limit LOOP
        SELECT * INTO fetched
          FROM orc_fetch_dispatch_v3(p_queues, p_excluded, p_worker_id, p_task_prefix, p_worker,
                                     p_claimable, p_running);
        EXIT WHEN fetched.id IS NULL;
        RETURN NEXT fetched;
    END LOOP;
END;
$$;

-- A job of a key leaves RUNNING: its capacity goes to the key's waiters, if any wait.
CREATE FUNCTION orc_flow_release_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT FROM orc_flow_waiters AS w
                WHERE w.key = OLD.flow_key AND w.dispatched_at IS NULL) THEN
        PERFORM orc_flow_pump_v1(OLD.flow_key);
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER orc_jobs_flow_release
    AFTER UPDATE OF status ON orc_jobs
    FOR EACH ROW
    WHEN (OLD.flow_key IS NOT NULL AND OLD.status = 'RUNNING' AND NEW.status <> 'RUNNING')
    EXECUTE FUNCTION orc_flow_release_v1();

-- A waiting job that finishes (cancelled; failed by an operator) leaves the line; if it was
-- the one on its way, the next one is sent.
CREATE FUNCTION orc_flow_leave_v1() RETURNS trigger
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

CREATE TRIGGER orc_jobs_flow_leave
    AFTER UPDATE OF status ON orc_jobs
    FOR EACH ROW
    WHEN (OLD.flow_key IS NOT NULL AND NEW.finished_at IS NOT NULL AND OLD.finished_at IS NULL)
    EXECUTE FUNCTION orc_flow_leave_v1();

-- An operator lifts a key's pause (and its adaptive slow-down). The waiter sent for the end of
-- the pause comes back to the line (its future dispatch deleted), and the line goes now.
-- NULL: no such key; else how many waiters got a dispatch.
CREATE FUNCTION orc_flow_resume_v1(p_key text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    scout record;
BEGIN
    PERFORM orc_flow_lock_v1(p_key);
    UPDATE orc_flow_keys
       SET paused_until = NULL, pause_reason = NULL, paused_by = NULL,
           rate_factor = 1, factor_at = now()
     WHERE key = p_key;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    FOR scout IN
        SELECT j.id, j.procrastinate_job_id
          FROM orc_flow_waiters AS w JOIN orc_jobs AS j ON j.id = w.job_id
         WHERE w.key = p_key AND w.dispatched_at IS NOT NULL
           FOR NO KEY UPDATE OF j SKIP LOCKED
    LOOP
        IF procrastinate_cancel_job_v1(scout.procrastinate_job_id, false, true) IS NOT NULL THEN
            UPDATE orc_flow_waiters SET dispatched_at = NULL WHERE job_id = scout.id;
            UPDATE orc_jobs SET procrastinate_job_id = NULL WHERE id = scout.id;
        END IF;
    END LOOP;
    RETURN orc_flow_pump_v1(p_key);
END;
$$;

-- A 429 or 529 from the provider behind a key. With the server's hint, the key pauses for the
-- whole fleet until then; without one, its rate factor halves.
CREATE FUNCTION orc_flow_throttled_v1(p_key text, p_until timestamptz, p_reason text)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    k orc_flow_keys;
    lim orc_flow_limits;
BEGIN
    PERFORM orc_flow_lock_v1(p_key);
    SELECT * INTO k FROM orc_flow_keys WHERE key = p_key;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT * INTO lim FROM orc_flow_limits WHERE name = k.limit_name;
    IF p_until IS NOT NULL THEN
        UPDATE orc_flow_keys
           SET paused_until = greatest(paused_until, p_until),
               pause_reason = CASE WHEN paused_until >= p_until THEN pause_reason ELSE p_reason END,
               paused_by = CASE WHEN paused_until >= p_until THEN paused_by ELSE 'provider' END,
               throttled = throttled + 1
         WHERE key = p_key;
    ELSE
        UPDATE orc_flow_keys
           SET rate_factor = greatest(1.0 / 64,
                                      coalesce(orc_flow_factor_v1(k, lim), rate_factor) / 2),
               factor_at = now(),
               throttled = throttled + 1
         WHERE key = p_key;
    END IF;
END;
$$;

-- Submits store each job's flow (its key, limit, cost and share; null: no limit), as shaped by
-- orchestrator.domain.flow. Otherwise as in migrations 0017 and 0021.
CREATE OR REPLACE FUNCTION orc_submit_jobs_v2(
    p_specs jsonb, p_initial_status text, p_waiting text[], p_task_prefix text
) RETURNS TABLE (ord integer, job_id uuid, outcome text)
LANGUAGE plpgsql AS $$
BEGIN
    IF jsonb_path_exists(p_specs, '$[*] ? (@.job_key != null)') THEN
        RETURN QUERY SELECT * FROM orc_submit_jobs_v1(p_specs, p_initial_status, p_waiting,
                                                      p_task_prefix);
        RETURN;
    END IF;

    RETURN QUERY
    WITH spec AS (
        SELECT s.* FROM jsonb_populate_recordset(NULL::orc_job_spec_v1, p_specs) AS s
    ), dispatch AS (
        INSERT INTO procrastinate_jobs (queue_name, task_name, priority, lock, args, scheduled_at)
        SELECT s.queue, p_task_prefix || s.job_type, -s.priority, s.id::text,
               jsonb_build_object('job_id', s.id), CASE WHEN s.run_at > now() THEN s.run_at END
          FROM spec AS s
         ORDER BY s.ord
        RETURNING procrastinate_jobs.id, procrastinate_jobs.lock
    ), job AS (
        INSERT INTO orc_jobs (id, job_type, status, payload, queue, priority, run_at,
                              max_attempts, max_retries, agent_id, trace_id, timeout_seconds,
                              replay_of, tenant_id, procrastinate_job_id, traceparent,
                              flow_key, flow_limit, flow_cost, flow_share)
        SELECT s.id, s.job_type, p_initial_status, coalesce(s.payload, 'null'), s.queue,
               s.priority, coalesce(s.run_at, now()), s.max_attempts, s.max_retries, s.agent_id,
               s.trace_id, s.timeout_seconds, s.replay_of, s.tenant_id, d.id, s.traceparent,
               s.flow_key, s.flow_limit, s.flow_cost, s.flow_share
          FROM spec AS s JOIN dispatch AS d ON d.lock = s.id::text
        RETURNING *
    ), created AS (
        INSERT INTO orc_job_events (job_id, kind, payload)
        SELECT j.id, 'job.created', orc_created_event_v1(j) FROM job AS j
    )
    SELECT s.ord, s.id, 'created'::text FROM spec AS s;

    -- Workers waiting for a future time are told, as orc_submit_jobs_v1 tells them.
    IF jsonb_path_exists(p_specs, '$[*] ? (@.run_at != null)') THEN
        PERFORM pg_notify('orc_wakeup', extract(epoch FROM min(s.run_at))::text)
           FROM jsonb_populate_recordset(NULL::orc_job_spec_v1, p_specs) AS s
          WHERE s.run_at > now()
         HAVING count(*) > 0;
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION orc_submit_jobs_v1(
    p_specs jsonb, p_initial_status text, p_waiting text[], p_task_prefix text
) RETURNS TABLE (ord integer, job_id uuid, outcome text)
LANGUAGE plpgsql AS $$
DECLARE
    specs orc_job_spec_v1[] := ARRAY(
        SELECT s FROM jsonb_populate_recordset(NULL::orc_job_spec_v1, p_specs) AS s);
    spec orc_job_spec_v1;
    existing orc_jobs;
    deferred bigint[];
    fresh uuid[] := '{}';  -- keyed rows that need a dispatch: created and replaced ones
    new_id uuid;
BEGIN
    -- Serialise submits of one key in one scope, so two of them cannot both create a job: every
    -- key's lock is taken first, in the order of the lock ids, so two batches naming the same
    -- keys in other orders take turns rather than deadlock.
    PERFORM pg_advisory_xact_lock(k.lock_id)
       FROM (SELECT DISTINCT hashtextextended(
                 'orc_job_key:' || jsonb_build_array(s.tenant_id, s.job_key)::text, 0) AS lock_id
               FROM unnest(specs) AS s
              WHERE s.job_key IS NOT NULL
              ORDER BY 1) AS k;
    -- Jobs without a key, set-based: their dispatches first, then the rows that point at them
    -- (matched by the dispatch's lock, which is the job id), so each row is written once.
    deferred := procrastinate_defer_jobs_v1(ARRAY(
        SELECT ROW(s.queue, p_task_prefix || s.job_type, -s.priority, s.id::text, NULL,
                   jsonb_build_object('job_id', s.id),
                   CASE WHEN s.run_at > now() THEN s.run_at END)::procrastinate_job_to_defer_v1
          FROM unnest(specs) AS s
         WHERE s.job_key IS NULL
         ORDER BY s.ord));
    WITH inserted AS (
        INSERT INTO orc_jobs (id, job_type, status, payload, queue, priority, run_at,
                              max_attempts, max_retries, agent_id, trace_id, timeout_seconds,
                              replay_of, tenant_id, procrastinate_job_id, traceparent,
                              flow_key, flow_limit, flow_cost, flow_share)
        SELECT s.id, s.job_type, p_initial_status, coalesce(s.payload, 'null'), s.queue,
               s.priority, coalesce(s.run_at, now()), s.max_attempts, s.max_retries, s.agent_id,
               s.trace_id, s.timeout_seconds, s.replay_of, s.tenant_id, p.id, s.traceparent,
               s.flow_key, s.flow_limit, s.flow_cost, s.flow_share
          FROM unnest(specs) AS s
          JOIN procrastinate_jobs AS p  -- a lookup in orc_procrastinate_jobs_live_lock
            ON p.lock = s.id::text AND p.status = 'todo' AND p.id = ANY (deferred)
         WHERE s.job_key IS NULL
        RETURNING *
    )
    INSERT INTO orc_job_events (job_id, kind, payload)
    SELECT i.id, 'job.created', orc_created_event_v1(i) FROM inserted AS i;

    RETURN QUERY SELECT s.ord, s.id, 'created'::text FROM unnest(specs) AS s
                  WHERE s.job_key IS NULL;

    FOR spec IN SELECT * FROM unnest(specs) AS s WHERE s.job_key IS NOT NULL ORDER BY s.ord
    LOOP
        -- The live job with this key in the submit's own scope: its tenant, or no tenant.
        SELECT * INTO existing FROM orc_jobs AS j
         WHERE j.job_key = spec.job_key
           AND coalesce(j.tenant_id, '') = coalesce(spec.tenant_id, '')
           AND j.finished_at IS NULL
           FOR UPDATE;

        IF FOUND AND spec.job_key_mode = 'unsafe_dedupe' THEN
            UPDATE orc_jobs AS j SET revision = j.revision + 1 WHERE j.id = existing.id;
            ord := spec.ord; job_id := existing.id; outcome := 'deduplicated';
            RETURN NEXT;
            CONTINUE;
        END IF;

        IF FOUND AND existing.status = ANY (p_waiting) THEN
            UPDATE orc_jobs AS j
               SET payload = coalesce(spec.payload, 'null'),
                   queue = spec.queue,
                   priority = spec.priority,
                   max_attempts = spec.max_attempts,
                   max_retries = spec.max_retries,
                   agent_id = spec.agent_id,
                   timeout_seconds = spec.timeout_seconds,
                   flow_key = spec.flow_key,
                   flow_limit = spec.flow_limit,
                   flow_cost = spec.flow_cost,
                   flow_share = spec.flow_share,
                   run_at = CASE WHEN spec.job_key_mode = 'preserve_run_at' THEN j.run_at
                                 ELSE coalesce(spec.run_at, now()) END,
                   next_retry_at = CASE
                       WHEN j.next_retry_at IS NULL OR spec.job_key_mode = 'preserve_run_at'
                       THEN j.next_retry_at
                       ELSE coalesce(spec.run_at, now()) END,
                   revision = j.revision + 1
             WHERE j.id = existing.id;
            -- The waiting dispatch is replaced; one already fetched finds itself stale.
            PERFORM procrastinate_cancel_job_v1(existing.procrastinate_job_id, false, true)
               WHERE existing.procrastinate_job_id IS NOT NULL;
            INSERT INTO orc_job_events (job_id, kind, payload)
            VALUES (existing.id, 'job.replaced',
                    jsonb_build_object('job_key', spec.job_key, 'mode', spec.job_key_mode,
                                       'revision', existing.revision + 1,
                                       'tenant_id', spec.tenant_id));
            fresh := fresh || existing.id;
            ord := spec.ord; job_id := existing.id; outcome := 'replaced';
            RETURN NEXT;
            CONTINUE;
        END IF;

        new_id := spec.id;
        IF FOUND THEN
            UPDATE orc_jobs SET job_key = NULL WHERE id = existing.id;
            INSERT INTO orc_job_events (job_id, kind, payload)
            VALUES (existing.id, 'job.key_revoked',
                    jsonb_build_object('job_key', spec.job_key, 'replaced_by', new_id));
        END IF;
        WITH inserted AS (
            INSERT INTO orc_jobs (id, job_type, status, payload, queue, priority, run_at,
                                  max_attempts, max_retries, job_key, agent_id, trace_id,
                                  timeout_seconds, replay_of, tenant_id, traceparent,
                                  flow_key, flow_limit, flow_cost, flow_share)
            VALUES (new_id, spec.job_type, p_initial_status, coalesce(spec.payload, 'null'),
                    spec.queue, spec.priority, coalesce(spec.run_at, now()), spec.max_attempts,
                    spec.max_retries, spec.job_key, spec.agent_id, spec.trace_id,
                    spec.timeout_seconds, spec.replay_of, spec.tenant_id, spec.traceparent,
                    spec.flow_key, spec.flow_limit, spec.flow_cost, spec.flow_share)
            RETURNING *
        )
        INSERT INTO orc_job_events (job_id, kind, payload)
        SELECT i.id, 'job.created', orc_created_event_v1(i) FROM inserted AS i;
        fresh := fresh || new_id;
        ord := spec.ord; job_id := new_id; outcome := 'created';
        RETURN NEXT;
    END LOOP;

    -- Keyed jobs get their dispatch now (orc_dispatch_v1 also wakes workers for future ones);
    -- keyless jobs scheduled for later wake them here.
    PERFORM orc_dispatch_v1(fresh, p_task_prefix) WHERE cardinality(fresh) > 0;
    PERFORM pg_notify('orc_wakeup', extract(epoch FROM min(s.run_at))::text)
       FROM unnest(specs) AS s
      WHERE s.job_key IS NULL AND s.run_at > now()
     HAVING count(*) > 0;
END;
$$;
