-- scaling_load --
-- The fleet's load, for autoscaling: jobs due and waiting (PENDING past run_at, RETRY past
-- next_retry_at) plus jobs running, so that workers = ceil(load / concurrency) never drops
-- below what the running jobs occupy. KEDA's PostgreSQL scaler polls this exact text
-- (k8s/autoscaling/scaledobject.yaml; tests/test_autoscaling.py checks that the two are the
-- same): literals, no parameters. Each count reads a partial index (orc_jobs_pending_run_at,
-- orc_jobs_retry_due, orc_jobs_running_heartbeat), never the finished jobs. No store runs
-- it: it lives beside the fleet's other counts.
SELECT (SELECT count(*) FROM orc_jobs WHERE status = 'PENDING' AND run_at <= now())
     + (SELECT count(*) FROM orc_jobs WHERE status = 'RETRY' AND next_retry_at <= now())
     + (SELECT count(*) FROM orc_jobs WHERE status = 'RUNNING') AS load

-- fleet_snapshot --
-- The fleet's metrics are read in one snapshot: the counts below agree with each other.
SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY

-- fleet_jobs --
-- Unfinished jobs by status, type and tenant (orc_jobs_unfinished_counts: an index-only scan).
SELECT status, job_type, coalesce(tenant_id, '') AS tenant, count(*) AS n
  FROM orc_jobs
 WHERE finished_at IS NULL
 GROUP BY 1, 2, 3

-- fleet_queues --
-- Jobs due and waiting to start, by queue, and how long the oldest has been due
-- (orc_jobs_pending_run_at, orc_jobs_retry_due, whose predicates the statuses match: see
-- soonest_due).
SELECT queue, count(*) AS depth, extract(epoch FROM now() - min(due)) AS oldest_age
  FROM (SELECT queue, run_at AS due FROM orc_jobs
         WHERE status = 'PENDING' AND run_at <= now()
        UNION ALL
        SELECT queue, next_retry_at FROM orc_jobs
         WHERE status = 'RETRY' AND next_retry_at <= now()) AS waiting
 GROUP BY queue

-- fleet_dead_letters --
-- Dead letters by state and tenant (orc_dead_letters_state_tenant: an index-only scan).
SELECT state, coalesce(tenant_id, '') AS tenant, count(*) AS n
  FROM orc_dead_letters
 GROUP BY 1, 2

-- fleet_counts --
-- Approvals waiting (orc_approvals_pending_expiry) and zombies not swept yet
-- (orc_jobs_running_heartbeat).
SELECT (SELECT count(*) FROM orc_approvals WHERE status = 'pending') AS approvals,
       (SELECT count(*) FROM orc_jobs
         WHERE status = 'RUNNING'
           AND heartbeat_at < now() - make_interval(secs => %(threshold)s)) AS zombies

-- fleet_lags --
-- How far behind now (seconds) the rollups and retention are: the rollups' watermark (before
-- their first run, the oldest finished job, where that run starts: read from the finish times
-- only then), and the point retention last caught up to (orc_retention_progress, 0037).
SELECT extract(epoch FROM now() - coalesce(orc_rolled_up_to_v1(),
                                           (SELECT min(finished_at) FROM orc_jobs), now()))
           AS rollup_lag,
       extract(epoch FROM now() - (SELECT caught_up_to FROM orc_retention_progress))
           AS retention_lag

-- fleet_zombies --
-- Zombies not swept yet (orc_jobs_running_heartbeat); `tenants`: only jobs of these tenants
-- (null: every job), for the dashboard's overview of a token limited to tenants.
SELECT count(*) AS zombies
  FROM orc_jobs
 WHERE status = 'RUNNING'
   AND heartbeat_at < now() - make_interval(secs => %(threshold)s)
   AND (%(tenants)s::text[] IS NULL OR tenant_id = ANY (%(tenants)s))

-- fleet_flow --
-- The flow keys for the exporter: paused or not, running and waiting jobs, the adaptive rate.
-- Keys that are paused, slowed or have waiters first; at most 200 (the series stay bounded).
SELECT k.key, coalesce(k.paused_until > now(), false) AS paused,
       (SELECT count(*) FROM orc_jobs AS j
         WHERE j.flow_key = k.key AND j.status = 'RUNNING' AND j.flow_key IS NOT NULL)::integer
           AS running,
       (SELECT count(*) FROM orc_flow_waiters AS w WHERE w.key = k.key)::integer AS waiting,
       coalesce(orc_flow_factor_v1(k, l), 1) AS rate_factor
  FROM orc_flow_keys AS k
  LEFT JOIN orc_flow_limits AS l ON l.name = k.limit_name
 ORDER BY coalesce(k.paused_until > now(), false) DESC,
          EXISTS (SELECT FROM orc_flow_waiters AS w WHERE w.key = k.key) DESC, k.key
 LIMIT 200

-- queue_stats --
-- Per queue: jobs by status (unfinished), due and waiting, and the age of the oldest waiting
-- (orc_jobs_unfinished_counts holds every column read: an index-only scan).
SELECT queue,
       count(*) FILTER (WHERE status = 'PENDING') AS pending,
       count(*) FILTER (WHERE status = 'RUNNING') AS running,
       count(*) FILTER (WHERE status = 'RETRY') AS retry,
       count(*) FILTER (WHERE status = 'WAITING_APPROVAL') AS waiting_approval,
       count(*) FILTER (WHERE (status = 'PENDING' AND run_at <= now())
                           OR (status = 'RETRY' AND next_retry_at <= now())) AS due,
       extract(epoch FROM now() - min(CASE WHEN status = 'PENDING' AND run_at <= now()
                                           THEN run_at
                                           WHEN status = 'RETRY' AND next_retry_at <= now()
                                           THEN next_retry_at END)) AS oldest_due_age
  FROM orc_jobs
 WHERE finished_at IS NULL
   AND (%(tenants)s::text[] IS NULL OR tenant_id = ANY (%(tenants)s))
 GROUP BY queue
 ORDER BY queue

-- fleet_llm_tokens --
-- Tokens recorded in the last %(window)s seconds by tenant ('' for none), model and kind, for the
-- fleet exporter (a range of orc_llm_usage_recorded_at); numeric sums: a usage row holds any
-- bigint, so two of them can sum past one.
SELECT coalesce(u.tenant_id, '') AS tenant, u.model,
       sum(u.input_tokens) AS input, sum(u.output_tokens) AS output,
       sum(u.cache_read_tokens) AS cache_read, sum(u.cache_creation_tokens) AS cache_creation
  FROM orc_llm_usage AS u
 WHERE u.recorded_at >= now() - make_interval(secs => %(window)s)
 GROUP BY 1, 2
