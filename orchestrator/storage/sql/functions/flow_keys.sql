-- Flow control's keys (docs/flow-control.md): a key from its limit's template, its row, its
-- lock, and what holds it (a provider's throttle, an operator's pause, a resume).
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

-- A key from its limit's template (docs/flow-control.md, "The key"): the one rule every writer
-- of a job's key follows (a submit's statement, orc_job_specs_v1; a claim of a job that came
-- without its key, orc_flow_assign_v1; a call on a fallback model, orc_flow_render_v1).
-- {job_type}; {tenant} and {agent} ('-' for none); {payload.a.b}, a string, number or boolean
-- the payload holds, through objects only; the rest literal. No template: no key. A field
-- missing or not a scalar, or a key over 200 characters, is refused (SQLSTATE ORCFK, its message
-- naming what, the job type its detail): a job never runs under a key other than the one its
-- template names.
CREATE OR REPLACE FUNCTION orc_flow_key_v1(
    p_template text, p_job_type text, p_tenant text, p_agent text, p_payload jsonb
) RETURNS text
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    rendered text := '';
    rest text := p_template;
    close integer;
    open integer;
    name text;
    field text;
    value jsonb;
BEGIN
    IF p_template IS NULL THEN
        RETURN NULL;
    END IF;
    -- Each placeholder: the first '}' and the last '{' before it (string functions, not a
    -- regular expression: half the time, on every submit under a limit).
    LOOP
        close := strpos(rest, '}');
        EXIT WHEN close = 0;
        open := close - strpos(reverse(left(rest, close - 1)), '{');
        IF open = close THEN  -- no '{' before it: literal
            rendered := rendered || left(rest, close);
            rest := substr(rest, close + 1);
            CONTINUE;
        END IF;
        name := substr(rest, open + 1, close - open - 1);
        rendered := rendered || left(rest, open - 1);
        rest := substr(rest, close + 1);
        IF name IN ('job_type', 'tenant', 'agent') THEN
            rendered := rendered || coalesce(nullif(CASE name WHEN 'job_type' THEN p_job_type
                                                              WHEN 'tenant' THEN p_tenant
                                                              ELSE p_agent END, ''), '-');
            CONTINUE;
        END IF;
        value := p_payload;
        FOREACH field IN ARRAY string_to_array(
                CASE WHEN starts_with(name, 'payload.') THEN substr(name, 9) ELSE name END, '.')
        LOOP
            IF jsonb_typeof(value) IS DISTINCT FROM 'object' OR NOT value ? field THEN
                RAISE EXCEPTION 'the flow key ''%'' needs %, which is missing', p_template, name
                      USING ERRCODE = 'ORCFK', DETAIL = p_job_type;
            END IF;
            value := value -> field;
        END LOOP;
        IF jsonb_typeof(value) NOT IN ('string', 'number', 'boolean') THEN
            RAISE EXCEPTION 'the flow key ''%'' needs % to be a string or number', p_template, name
                  USING ERRCODE = 'ORCFK', DETAIL = p_job_type;
        END IF;
        rendered := rendered || (value #>> '{}');
    END LOOP;
    rendered := rendered || rest;
    IF length(rendered) > 200 THEN
        RAISE EXCEPTION 'the flow key is % characters long, over 200', length(rendered)
              USING ERRCODE = 'ORCFK', DETAIL = p_job_type;
    END IF;
    RETURN rendered;
END;
$$;

-- The job's key by the template (orc_flow_key_v1's rule, for a job row).
CREATE OR REPLACE FUNCTION orc_flow_render_v1(p_template text, j orc_jobs) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT orc_flow_key_v1(p_template, j.job_type, j.tenant_id, j.agent_id, j.payload)
$$;

-- A job that came without its key though its type runs under a limit (submitted by the release
-- before, or before its type had a limit; the job row locked by the caller) gets it at its
-- claim, by the submit's rule, with a cost of 1. Its payload lacking what the template names,
-- no key is its template's: the job fails for good (FLOW_KEY_INVALID, the message naming the
-- field: orc_fail_unheld_v1) rather than run under another key. The job as it now stands; a row
-- of nulls when its type has no limit.
CREATE OR REPLACE FUNCTION orc_flow_assign_v1(j orc_jobs) RETURNS orc_jobs
LANGUAGE plpgsql AS $$
DECLARE
    lim orc_flow_limits;
    key text;
BEGIN
    SELECT l.* INTO lim
      FROM orc_flow_job_types AS t JOIN orc_flow_limits AS l ON l.name = t.limit_name
     WHERE t.job_type = j.job_type;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    BEGIN
        key := orc_flow_render_v1(lim.key_template, j);
    EXCEPTION WHEN SQLSTATE 'ORCFK' THEN
        PERFORM orc_fail_unheld_v1(
            ARRAY[j.id],
            jsonb_build_object('message', SQLERRM, 'code', 'FLOW_KEY_INVALID',
                               'classification', 'PERMANENT'),
            'FAILED', ARRAY[j.status]);
        SELECT * INTO j FROM orc_jobs AS o WHERE o.id = j.id;
        RETURN j;
    END;
    UPDATE orc_jobs AS o
       SET flow_key = key, flow_limit = lim.name, flow_cost = 1,
           flow_share = orc_flow_share_of_v1(lim.share_by, j.tenant_id, j.agent_id)
     WHERE o.id = j.id
    RETURNING o.* INTO j;
    RETURN j;
END;
$$;

-- The share a job waits in under a limit (share_by): its tenant, its agent, or none ('').
CREATE OR REPLACE FUNCTION orc_flow_share_of_v1(p_share_by text, p_tenant text, p_agent text)
RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT coalesce(CASE p_share_by WHEN 'tenant' THEN p_tenant WHEN 'agent' THEN p_agent END, '')
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
