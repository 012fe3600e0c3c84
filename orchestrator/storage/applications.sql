-- Several applications on one database (docs/applications.md; migration 0056).

-- declare --
-- An application's declaration (orc_declare_v1): the names it withdrew that nobody declares
-- any more, or whose withdrawal waits for a peer (`deferred`), or the conflicts that refused it.
SELECT kind, name, other, difference, deferred
  FROM orc_declare_v1(%(application)s, %(kinds)s::text[], %(definitions)s::jsonb, %(whole)s,
                      %(version)s, %(live_seconds)s)

-- foreign_queues --
-- The queues of the job types that applications other than `application` declare: a worker of
-- `application` listening on every queue leaves those that none of its own types use.
SELECT DISTINCT d.definition ->> 'queue' AS queue
  FROM orc_application_definitions AS d
 WHERE d.kind = 'job_type' AND d.application <> %(application)s
   AND d.definition ->> 'queue' IS NOT NULL
 ORDER BY 1

-- forget_application_conflicts --
-- The refusals of an application forgotten.
DELETE FROM orc_application_conflicts WHERE application = %(application)s

-- application_definitions --
-- Every application's declarations.
SELECT application, kind, name, definition
  FROM orc_application_definitions
 ORDER BY application, kind, name

-- application_processes --
-- The registry's live processes, each with the application and config version it recorded (a
-- process of the release before applications records none: it can only be `default`'s).
SELECT w.id AS worker_id, c.worker, c.config_version,
       coalesce(c.application, 'default') AS application, w.last_heartbeat
  FROM procrastinate_workers AS w
  JOIN orc_worker_configs AS c ON c.worker_id = w.id
 WHERE w.last_heartbeat > now() - make_interval(secs => %(seconds)s)
 ORDER BY w.id

-- application_conflicts --
-- The declarations refused and not yet mended.
SELECT application, kind, name, other, difference, at
  FROM orc_application_conflicts
 ORDER BY application, kind, name, other

-- live_application_conflicts --
-- The refusals standing between two applications that both have a live process: they disagree
-- now (the alert OrchestratorApplicationsDisagree).
SELECT c.application, c.kind, c.name, c.other
  FROM orc_application_conflicts AS c
 WHERE EXISTS (SELECT FROM orc_worker_configs AS o
                 JOIN procrastinate_workers AS w ON w.id = o.worker_id
                WHERE coalesce(o.application, 'default') = c.application
                  AND w.last_heartbeat > now() - make_interval(secs => %(seconds)s))
   AND EXISTS (SELECT FROM orc_worker_configs AS o
                 JOIN procrastinate_workers AS w ON w.id = o.worker_id
                WHERE coalesce(o.application, 'default') = c.other
                  AND w.last_heartbeat > now() - make_interval(secs => %(seconds)s))
 ORDER BY c.application, c.kind, c.name, c.other

-- unserved_jobs --
-- Waiting jobs (PENDING, RETRY) of the types no live process runs, by type, with their queues
-- and how many are due; `tenants`: only theirs. A type is run by a live process of an
-- application that declares it and runs its kind (0061: a worker runs the in-process types, an
-- API server the external ones; a process of an older release, recording neither, either). The
-- counts come from orc_jobs_unfinished_counts alone.
WITH served AS (
    SELECT DISTINCT d.name
      FROM orc_application_definitions AS d
      JOIN orc_worker_configs AS o ON coalesce(o.application, 'default') = d.application
      JOIN procrastinate_workers AS w ON w.id = o.worker_id
     WHERE d.kind = 'job_type'
       AND w.last_heartbeat > now() - make_interval(secs => %(seconds)s)
       AND (o.runs IS NULL
            OR o.runs = CASE WHEN coalesce((d.definition ->> 'external')::boolean, false)
                             THEN 'external' ELSE 'jobs' END)
), waiting AS (
    SELECT j.job_type,
           count(*) FILTER (WHERE j.status = 'PENDING') AS pending,
           count(*) FILTER (WHERE j.status = 'RETRY') AS retry,
           count(*) FILTER (WHERE (j.status = 'PENDING' AND j.run_at <= now())
                               OR (j.status = 'RETRY' AND j.next_retry_at <= now())) AS due,
           array_agg(DISTINCT j.queue ORDER BY j.queue) AS queues
      FROM orc_jobs AS j
     WHERE j.finished_at IS NULL AND j.status IN ('PENDING', 'RETRY')
       AND (%(tenants)s::text[] IS NULL OR j.tenant_id = ANY (%(tenants)s))
     GROUP BY j.job_type
)
SELECT w.job_type, w.pending, w.retry, w.due, w.queues
  FROM waiting AS w
 WHERE NOT EXISTS (SELECT FROM served AS s WHERE s.name = w.job_type)
 ORDER BY w.job_type
