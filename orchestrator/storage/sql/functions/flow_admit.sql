-- Flow control at the claim (docs/flow-control.md): the gate every claim passes, admitting a
-- job whose key has room and parking one whose key has none; a running job parked; and a job's
-- share as it joins its key's line.

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
                orc_waiting_for_capacity_event_v1(j, blocked));
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
        -- Submitted without its flow, though its type runs under a limit: it gets it now, or
        -- fails (then it is no longer claimable, and its dispatch is stale).
        j := orc_flow_assign_v1(j);
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

-- A share of `p_key` that starts waiting starts level with the shares already waiting (the
-- lowest virtual time among them), so time it spent idle buys it no run of turns; a share
-- already waiting keeps its own. Called as a job joins its key's line: at its claim, and as a
-- running job parks.
CREATE OR REPLACE FUNCTION orc_flow_share_waits_v1(p_key text, p_share text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    floor_vtime double precision := orc_flow_floor_vtime_v1(p_key);
BEGIN
    INSERT INTO orc_flow_shares AS s (key, share, vtime)
    VALUES (p_key, p_share, coalesce(floor_vtime, 0))
    ON CONFLICT (key, share) DO UPDATE
       SET vtime = greatest(s.vtime, coalesce(floor_vtime, s.vtime))
     WHERE NOT EXISTS (SELECT FROM orc_flow_waiters AS w
                        WHERE w.key = s.key AND w.share = s.share AND w.dispatched_at IS NULL);
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
        PERFORM orc_flow_unspend_v1((SELECT max(s.id) FROM orc_flow_spends AS s
                                      WHERE s.job_id = j.id AND s.key = j.flow_key
                                        AND NOT s.reconciled),
                                    lim);
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
            orc_waiting_for_capacity_event_v1(j, p_blocked));
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
