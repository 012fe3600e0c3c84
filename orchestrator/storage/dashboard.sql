-- job_holders --
-- Who runs jobs now (a worker, an external worker, by its lease's holder) and since when it was
-- last heard of (orc_jobs_running_heartbeat).
SELECT locked_by, count(*) AS running, max(heartbeat_at) AS last_heartbeat FROM orc_jobs
 WHERE status = 'RUNNING'
   AND (%(tenants)s::text[] IS NULL OR tenant_id = ANY (%(tenants)s))
 GROUP BY locked_by
 ORDER BY locked_by

-- registered_workers --
-- The Procrastinate registry: workers (and API servers) alive by their own heartbeat.
SELECT id, last_heartbeat FROM procrastinate_workers
 WHERE last_heartbeat > now() - make_interval(secs => %(seconds)s)
 ORDER BY id
