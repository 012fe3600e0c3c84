-- Flow control (docs/flow-control.md; migration 0029).

-- sync_flow_limits --
-- An application's limits ([{name, concurrency, requests, units, interval_seconds, weights,
-- key, share_by, tenant_share, learn}]) and which of its job types run under them ([{job_type,
-- limit, fallback_after_seconds}]: null when the type names no fallback models), written by
-- each of its processes that applies a config, after its declaration (orc_declare_v1) and in
-- its transaction; `gone_limits` and `gone_types`: what the application withdrew and no other
-- declares (another application's rows are never touched). The names of the limits that
-- changed or are gone (a limit gone holds nothing back: its keys' waiters are then
-- rescheduled, as are those of a limit raised or lowered). Nothing is written where nothing
-- changed.
WITH given AS (
    SELECT * FROM jsonb_to_recordset(%(limits)s::jsonb)
        AS g (name text, concurrency integer, requests integer, units bigint,
              interval_seconds double precision, weights jsonb, key text, share_by text,
              tenant_share double precision, learn boolean)
), types AS (
    SELECT * FROM jsonb_to_recordset(%(types)s::jsonb)
        AS t (job_type text, "limit" text, fallback_after_seconds double precision)
), gone_types AS (
    DELETE FROM orc_flow_job_types AS o WHERE o.job_type = ANY (%(gone_types)s::text[])
), new_types AS (
    INSERT INTO orc_flow_job_types AS o (job_type, limit_name, fallback_after_seconds)
    SELECT job_type, "limit", fallback_after_seconds FROM types
    ON CONFLICT (job_type) DO UPDATE
       SET limit_name = EXCLUDED.limit_name,
           fallback_after_seconds = EXCLUDED.fallback_after_seconds
     WHERE (o.limit_name, o.fallback_after_seconds)
           IS DISTINCT FROM (EXCLUDED.limit_name, EXCLUDED.fallback_after_seconds)
), changed AS (
    INSERT INTO orc_flow_limits AS l (name, concurrency, requests, units, interval_seconds,
                                      weights, key_template, share_by, tenant_share, learn)
    SELECT name, concurrency, requests, units, interval_seconds, coalesce(weights, '{}'), key,
           share_by, tenant_share, coalesce(learn, false)
      FROM given
    ON CONFLICT (name) DO UPDATE
       SET concurrency = EXCLUDED.concurrency, requests = EXCLUDED.requests,
           units = EXCLUDED.units, interval_seconds = EXCLUDED.interval_seconds,
           weights = EXCLUDED.weights, key_template = EXCLUDED.key_template,
           share_by = EXCLUDED.share_by, tenant_share = EXCLUDED.tenant_share,
           learn = EXCLUDED.learn, updated_at = now()
     WHERE (l.concurrency, l.requests, l.units, l.interval_seconds, l.weights, l.key_template,
            l.share_by, l.tenant_share, l.learn)
           IS DISTINCT FROM (EXCLUDED.concurrency, EXCLUDED.requests, EXCLUDED.units,
                             EXCLUDED.interval_seconds, EXCLUDED.weights, EXCLUDED.key_template,
                             EXCLUDED.share_by, EXCLUDED.tenant_share, EXCLUDED.learn)
    RETURNING name
), gone AS (  -- the config's own limits only (0049: the Graphile schema's is its own)
    DELETE FROM orc_flow_limits AS o
     WHERE o.owner = 'config' AND o.name = ANY (%(gone_limits)s::text[])
    RETURNING name
)
SELECT name FROM changed UNION ALL SELECT name FROM gone

-- flow_keys_of_limits --
-- The keys of these limits that have waiters (to be rescheduled once the limits changed).
SELECT k.key FROM orc_flow_keys AS k
 WHERE k.limit_name = ANY (%(names)s::text[])
   AND EXISTS (SELECT FROM orc_flow_waiters AS w WHERE w.key = k.key)
 ORDER BY k.key

-- flow_keys_to_backstop --
-- The safety net's backstop: the keys whose line may have missed its wake-up. A key with
-- waiters in line and none on its way for `stale_seconds`; a key with a waiter sent for a time
-- `stale_seconds` gone whose dispatch is lost; a key with a waiter sent for later than its
-- pause and its window explain (a pause shortened by a writer that did not reschedule).
SELECT k.key FROM orc_flow_keys AS k
  LEFT JOIN orc_flow_limits AS l ON l.name = k.limit_name
 WHERE EXISTS (SELECT FROM orc_flow_waiters AS w WHERE w.key = k.key)
   AND ((EXISTS (SELECT FROM orc_flow_waiters AS w
                  WHERE w.key = k.key AND w.dispatched_at IS NULL)
         AND NOT EXISTS (SELECT FROM orc_flow_waiters AS d
                          WHERE d.key = k.key AND d.dispatched_at IS NOT NULL
                            AND d.dispatched_at > now() - make_interval(secs => %(stale_seconds)s)))
        OR EXISTS (SELECT FROM orc_flow_waiters AS w JOIN orc_jobs AS j ON j.id = w.job_id
                    WHERE w.key = k.key
                      AND w.dispatched_at <= now() - make_interval(secs => %(stale_seconds)s)
                      AND NOT EXISTS (SELECT FROM procrastinate_jobs AS p
                                       WHERE p.id = j.procrastinate_job_id
                                         AND p.status IN ('todo', 'doing')))
        OR EXISTS (SELECT FROM orc_flow_waiters AS w
                    WHERE w.key = k.key
                      AND w.dispatched_at > greatest(now(), k.paused_until)
                                            + make_interval(secs => coalesce(l.interval_seconds, 0) + 1)))
 ORDER BY k.key

-- reschedule_flow_key --
-- Hand the key's capacity out afresh (orc_flow_reschedule_v1): how many waiters go now.
SELECT orc_flow_reschedule_v1(%(key)s) AS dispatched

-- flow_keys --
-- Every key: its limit, `requests` and `units` the allowances in effect (orc_flow_limit_of_v1:
-- when it learns, lowered to its provider's, as every claim and call meets them), what runs and
-- waits on it, what it spent in its window, its pause.
SELECT k.key, k.limit_name, k.paused_until, k.pause_reason, k.paused_by, k.throttled,
       orc_flow_factor_v1(k, l) AS rate_factor,
       l.concurrency, e.requests, e.units, l.interval_seconds, coalesce(l.learn, false) AS learn,
       k.learned_requests, k.learned_units, k.learned_at,
       (SELECT count(*) FROM orc_jobs AS j
         WHERE j.flow_key = k.key AND j.status = 'RUNNING' AND j.flow_key IS NOT NULL)::integer
           AS running,
       (SELECT count(*) FROM orc_flow_waiters AS w WHERE w.key = k.key)::integer AS waiting,
       orc_flow_used_v1(k.key, NULL, 'requests', l.interval_seconds) AS requests_used,
       orc_flow_used_v1(k.key, NULL, 'units', l.interval_seconds) AS units_used
  FROM orc_flow_keys AS k
  LEFT JOIN orc_flow_limits AS l ON l.name = k.limit_name
 CROSS JOIN LATERAL orc_flow_limit_of_v1(k, l) AS e
 WHERE (%(key)s::text IS NULL OR k.key = %(key)s)
 ORDER BY k.key

-- pause_flow_key --
-- An operator pauses a key for so many seconds from now, by the database's clock; its waiters
-- sent ahead are rescheduled for the new end (orc_flow_pause_v1). False: no such key.
SELECT orc_flow_pause_v1(%(key)s, %(seconds)s, %(reason)s, %(by)s) AS paused

-- resume_flow_key --
-- An operator lifts a key's pause (and resets its adaptive rate): its waiters go at once
-- (see orc_flow_resume_v1). dispatched null: no such key.
SELECT orc_flow_resume_v1(%(key)s) AS dispatched

-- flow_key_passable_for --
-- Seconds the job's key stays paused from now, when its type may pass the pause on a fallback
-- model (a provider's pause longer than the fleet's threshold: orc_flow_passes_pause_v1, as the
-- claim decides). No row: it may not, or the key is not paused.
SELECT extract(epoch FROM k.paused_until - clock_timestamp())::float8 AS seconds
  FROM orc_jobs AS j JOIN orc_flow_keys AS k ON k.key = j.flow_key
 WHERE j.id = %(job_id)s AND k.paused_until > clock_timestamp()
   AND orc_flow_passes_pause_v1(k, j.job_type)

-- flow_spend --
-- What an admitted job's call really used (see orc_flow_spend_v2): its reservation corrected
-- (the first call since its admission), or a later call's request and units added; dated from
-- when the call was sent; once per call id.
SELECT orc_flow_spend_v2(%(key)s, %(job_id)s, %(units)s, %(sent_seconds_ago)s, %(call_id)s)

-- flow_admit_call --
-- A running job's next call, on a model (null: its own), admitted in this one statement under
-- its key's lock (see orc_flow_admit_call_v1): go (at once or after a wait in place, its spend
-- recorded) or park; for an external worker's attempt, its lease checked (`stale`) and the
-- answer kept under its call id.
SELECT * FROM orc_flow_admit_call_v1(%(job_id)s, %(model)s, %(units)s, %(first)s, %(attempt)s,
                                     %(lease_token)s, %(call_id)s)

-- flow_call_go --
-- A call admitted ahead, at its instant: it goes (`paused_for` null), or its key was paused
-- meanwhile and its spend leaves the window (see orc_flow_call_go_v1).
SELECT orc_flow_call_go_v1(%(key)s, %(spend)s) AS paused_for

-- flow_call_key --
-- The key a job's call to `model` was admitted against (orc_flow_model_key_v1: its own, or a
-- fallback model's), where its usage reconciles its spend. No row: the job has no key.
SELECT orc_flow_model_key_v1(j, %(model)s) AS key
  FROM orc_jobs AS j
 WHERE j.id = %(job_id)s AND j.flow_key IS NOT NULL

-- flow_learn --
-- What a reply of the key's provider said of its limits (see orc_flow_learn_v1).
SELECT orc_flow_learn_v1(%(key)s, %(requests)s, %(units)s, %(hold)s, %(reason)s)
