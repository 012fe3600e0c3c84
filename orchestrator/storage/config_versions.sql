-- record_worker_config --
-- The application a registered worker (or API server) belongs to, the retry config version it
-- runs now, its release: the newest migration its code has (0058), and the fingerprint of what
-- it declares (0060), and what it runs (0061: `jobs`, a worker; `external`, an API server).
INSERT INTO orc_worker_configs AS c (worker_id, worker, config_version, applied_at, application,
                                     schema_version, declares, runs)
VALUES (%(worker_id)s, %(worker)s, %(version)s, %(applied_at)s, %(application)s,
        %(schema_version)s, %(declares)s, %(runs)s)
ON CONFLICT (worker_id) DO UPDATE
   SET worker = EXCLUDED.worker, config_version = EXCLUDED.config_version,
       applied_at = EXCLUDED.applied_at, application = EXCLUDED.application,
       schema_version = EXCLUDED.schema_version, declares = EXCLUDED.declares,
       runs = EXCLUDED.runs
 WHERE (c.worker, c.config_version, c.applied_at, c.application, c.schema_version, c.declares,
        c.runs)
       IS DISTINCT FROM (EXCLUDED.worker, EXCLUDED.config_version, EXCLUDED.applied_at,
                         EXCLUDED.application, EXCLUDED.schema_version, EXCLUDED.declares,
                         EXCLUDED.runs)

-- worker_configs --
-- The registry's live workers and API servers, each with the retry config version it recorded
-- (null: it records none, as the previous release).
SELECT w.id, c.worker, c.config_version, c.applied_at, c.application, w.last_heartbeat
  FROM procrastinate_workers AS w
  LEFT JOIN orc_worker_configs AS c ON c.worker_id = w.id
 WHERE w.last_heartbeat > now() - make_interval(secs => %(seconds)s)
 ORDER BY w.id
