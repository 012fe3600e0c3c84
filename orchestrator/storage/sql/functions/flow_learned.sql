-- Flow control's learned limits (docs/flow-control.md, "Limits learned from the provider"):
-- what a provider's replies said of its limits, kept in the key's row, and the allowance
-- in effect.

-- The key's limit as the key meets it (docs/flow-control.md, "Limits learned from the
-- provider"): for a limit that learns, its requests and units each lowered to what the key's
-- provider allows (never raised: a configured one is a ceiling), or what it allows where the
-- limit configures none. The rule's one home: every reader of a key's window reads its limit
-- through this, and so do the keys as shown (storage/flow.sql, flow_keys);
-- tests/test_flow_learned.py holds it to a model.
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
