-- job_holders --
-- Who runs jobs now (a worker, an external worker, by its lease's holder) and since when it was
-- last heard of (orc_jobs_running_heartbeat).
SELECT locked_by, count(*) AS running, max(heartbeat_at) AS last_heartbeat FROM orc_jobs
 WHERE status = 'RUNNING'
   AND (%(tenants)s::text[] IS NULL OR tenant_id = ANY (%(tenants)s))
 GROUP BY locked_by
 ORDER BY locked_by

-- registry_processes --
-- Every process in the Procrastinate registry, live or stalled (silent %(seconds)s or more: a
-- stalled one stays until the next worker's registration prunes it), with what it recorded of
-- itself (orc_worker_configs: its name, application, and what it runs, 0061).
SELECT w.id AS worker_id, c.worker, c.application, c.runs, w.last_heartbeat,
       w.last_heartbeat <= now() - make_interval(secs => %(seconds)s) AS stalled
  FROM procrastinate_workers AS w
  LEFT JOIN orc_worker_configs AS c ON c.worker_id = w.id
 ORDER BY w.id

-- held_flow_keys --
-- The flow keys that hold jobs back: paused, or slowed (their adaptive rate below 1), with how
-- many jobs wait on each. `tenants`: only the keys a job of theirs waits on or runs under, and
-- only their jobs counted (a key is shared by the fleet: the other tenants' jobs on it, and the
-- keys only they use, are none of theirs).
SELECT k.key, k.limit_name, coalesce(k.paused_until > now(), false) AS paused, k.paused_until,
       k.paused_by, k.pause_reason, orc_flow_factor_v1(k, l) AS rate_factor,
       (SELECT count(*) FROM orc_flow_waiters AS w
         WHERE w.key = k.key
           AND (%(tenants)s::text[] IS NULL
                OR EXISTS (SELECT FROM orc_jobs AS j WHERE j.id = w.job_id
                             AND j.tenant_id = ANY (%(tenants)s))))::integer AS waiting
  FROM orc_flow_keys AS k
  LEFT JOIN orc_flow_limits AS l ON l.name = k.limit_name
 WHERE (k.paused_until > now() OR orc_flow_factor_v1(k, l) < 1)
   AND (%(tenants)s::text[] IS NULL
        OR EXISTS (SELECT FROM orc_flow_waiters AS w JOIN orc_jobs AS j ON j.id = w.job_id
                    WHERE w.key = k.key AND j.tenant_id = ANY (%(tenants)s))
        OR EXISTS (SELECT FROM orc_jobs AS j
                    WHERE j.flow_key = k.key AND j.status = 'RUNNING' AND j.flow_key IS NOT NULL
                      AND j.tenant_id = ANY (%(tenants)s)))
 ORDER BY coalesce(k.paused_until > now(), false) DESC, k.key
 LIMIT 50

-- letters_to_review --
-- Dead letters someone has to look at, by state (orc_dead_letters_state_tenant: an index-only
-- scan); `tenants`: only theirs.
SELECT state, count(*)::integer AS n
  FROM orc_dead_letters
 WHERE state IN ('recorded', 'discard_requested')
   AND (%(tenants)s::text[] IS NULL OR tenant_id = ANY (%(tenants)s))
 GROUP BY state

-- approvals_waiting --
-- Approvals waiting for a decision (orc_approvals_pending_expiry); `tenants`: only theirs.
SELECT count(*)::integer AS n
  FROM orc_approvals AS a
 WHERE a.status = 'pending'
   AND (%(tenants)s::text[] IS NULL
        OR EXISTS (SELECT FROM orc_jobs AS j WHERE j.id = a.job_id
                     AND j.tenant_id = ANY (%(tenants)s)))

-- activity --
-- Retries scheduled and failures (jobs failed for good: dead-lettered; `job.failed` is written
-- for every failed attempt) by the minute they happened, since
-- %(since)s (orc_job_events_activity, 0061: a range of the last hour's events of these two
-- kinds, never the whole history); `tenants`: only their jobs' events.
SELECT date_bin('1 minute', e.at, %(since)s) AS at,
       count(*) FILTER (WHERE e.kind = 'job.retry_scheduled')::integer AS retried,
       count(*) FILTER (WHERE e.kind = 'job.dead_lettered')::integer AS failed
  FROM orc_job_events AS e
 WHERE e.kind IN ('job.retry_scheduled', 'job.dead_lettered') AND e.at >= %(since)s
   AND (%(tenants)s::text[] IS NULL
        OR EXISTS (SELECT FROM orc_jobs AS j WHERE j.id = e.job_id
                     AND j.tenant_id = ANY (%(tenants)s)))
 GROUP BY 1
 ORDER BY 1
