-- 0032_flow_fallback: a job whose type can move to a fallback model does not wait out a long
-- pause of its key (docs/flow-control.md, "Model fallback").
--
-- compatible-with-older-workers: yes
--
-- orc_flow_job_types.fallback_after_seconds: the type's fallback_after_seconds when it names
-- fallback_models (null: it names none), written with the limits by each process that applies
-- a config. While a key is paused for longer than that from now, a claim of such a job passes
-- the pause (orc_flow_passes_pause_v1): it is held back only by the key's capacity, and it does
-- not wait in line behind the jobs that wait for the pause. Its task finds the key paused and
-- makes its call on the next model (tasks/llm.py, a `job.model_fallback` event with reason
-- `key_paused`). The pump hands such waiters their room likewise.
--
-- Compatible with older workers: a new nullable column, which the previous release's sync
-- leaves null (its processes' types then wait out pauses, as they did), and functions replaced
-- with the same signatures.

ALTER TABLE orc_flow_job_types ADD COLUMN fallback_after_seconds double precision
    CHECK (fallback_after_seconds >= 0);

-- Is the key paused for longer than the fallback threshold of `p_job_type` (false for a type
-- without fallback models, or a key not paused)?
CREATE FUNCTION orc_flow_passes_pause_v1(k orc_flow_keys, p_job_type text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT coalesce(
        (SELECT k.paused_until > clock_timestamp() + make_interval(secs => t.fallback_after_seconds)
           FROM orc_flow_job_types AS t WHERE t.job_type = p_job_type),
        false)
$$;

-- As in migration 0031, but a job whose type can move to a fallback model passes a pause longer
-- than its threshold, and does not wait in line behind the jobs that wait for the pause.
CREATE OR REPLACE FUNCTION orc_flow_admit_v1(j orc_jobs, p_task_prefix text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    k orc_flow_keys := orc_flow_lock_key_v1(j.flow_key, j.flow_limit, p_task_prefix);
    lim orc_flow_limits;
    waiter orc_flow_waiters;
    blocked text;
    wake timestamptz;
    floor_vtime double precision;
    passes boolean;
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
    passes := false;
    IF k.paused_until > clock_timestamp() THEN  -- (the type is read only for a paused key)
        passes := orc_flow_passes_pause_v1(k, j.job_type);
    END IF;
    IF passes THEN  -- (this copy of the key only: its task makes its call on a fallback model)
        k.paused_until := NULL;
    END IF;
    IF k.paused_until > clock_timestamp() THEN
        blocked := 'paused';
    ELSIF waiter.dispatched_at IS NULL AND NOT passes
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

-- As in migration 0031, each waiter meeting the key as its type does: a pause longer than its
-- fallback threshold does not hold back a job that can move to a fallback model.
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
        seen := k;  -- the key as this waiter meets it: a long pause passed by its fallback
        IF k.paused_until > clock_timestamp()
           AND orc_flow_passes_pause_v1(k, (SELECT j.job_type FROM orc_jobs AS j
                                             WHERE j.id = waiter.job_id)) THEN
            seen.paused_until := NULL;
        END IF;
        IF lim.name IS NOT NULL THEN  -- (a limit no longer configured holds nothing back)
            SELECT c.blocked, c.wake INTO blocked, wake
              FROM orc_flow_capacity_v1(seen, lim, waiter.cost, held, held_cost) AS c;
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
