-- migrations_lock --
-- Two processes migrating at once take turns (released at commit).
SELECT pg_advisory_xact_lock(hashtextextended('orchestrator migrate', 0))

-- migrations_table --
CREATE TABLE IF NOT EXISTS orc_schema_migrations (
    component text NOT NULL,
    version text NOT NULL,
    name text NOT NULL,
    checksum text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (component, version)
)

-- migrations_table_compatibility --
-- Whether a migration of ours is compatible with the release before it (the file's marker, read
-- when it was applied): older code has no copy of the file. Rows recorded before this column
-- existed, and Procrastinate's, are not marked.
ALTER TABLE orc_schema_migrations
    ADD COLUMN IF NOT EXISTS compatible_with_older_workers boolean NOT NULL DEFAULT false

-- migrations_applied --
SELECT component, version, checksum FROM orc_schema_migrations

-- migrations_unknown --
-- Our migrations applied that this code does not have (a newer release applied them). The
-- marker is read through to_jsonb, so that `migrate --plan` (which adds no column) reads a
-- database from before the column too: there, none is marked.
SELECT version, name,
       coalesce((to_jsonb(m) ->> 'compatible_with_older_workers')::boolean, false)
  FROM orc_schema_migrations AS m
 WHERE component = 'orchestrator' AND NOT version = ANY (%(known)s::text[])
 ORDER BY version

-- read_only --
-- `migrate --plan` changes nothing: its transaction cannot write.
SET TRANSACTION READ ONLY

-- table_exists --
SELECT to_regclass(%(table)s) IS NOT NULL

-- migrations_table_exists --
-- Was this database ever migrated?
SELECT to_regclass('orc_schema_migrations') IS NOT NULL AS migrated

-- migrations_record --
-- A function file is recorded again each time it changes (its new checksum).
INSERT INTO orc_schema_migrations (component, version, name, checksum,
                                   compatible_with_older_workers)
VALUES (%(component)s, %(version)s, %(name)s, %(checksum)s, %(compatible)s)
ON CONFLICT (component, version) DO UPDATE
SET checksum = EXCLUDED.checksum, applied_at = now()

-- definitions_unchecked --
-- Function files are applied as a restore applies a dump: bodies are checked when they run, so
-- a function may name one that a later file defines (until the transaction ends).
SET LOCAL check_function_bodies = off

-- procrastinate_installed --
SELECT to_regclass('procrastinate_jobs')

-- state_machine_changes --
-- What sync_states and sync_transitions would write: the states missing or with another
-- terminal flag, the declared pairs missing, the pairs no longer declared.
WITH states AS (
    SELECT * FROM unnest(%(statuses)s::text[], %(terminal)s::boolean[]) AS d(status, terminal)
), pairs AS (
    SELECT * FROM unnest(%(sources)s::text[], %(targets)s::text[]) AS d(from_status, to_status)
)
SELECT (SELECT count(*) FROM states AS d
         WHERE NOT EXISTS (SELECT FROM orc_states AS s
                            WHERE s.status = d.status AND s.terminal = d.terminal)),
       (SELECT count(*) FROM pairs AS d
         WHERE NOT EXISTS (SELECT FROM orc_state_transitions AS t
                            WHERE t.from_status = d.from_status AND t.to_status = d.to_status))
     + (SELECT count(*) FROM orc_state_transitions AS t
         WHERE NOT EXISTS (SELECT FROM pairs AS d
                            WHERE d.from_status = t.from_status AND d.to_status = t.to_status))

-- sync_states --
-- Only a state missing or with another terminal flag is written.
INSERT INTO orc_states AS s (status, terminal)
SELECT * FROM unnest(%(statuses)s::text[], %(terminal)s::boolean[])
ON CONFLICT (status) DO UPDATE SET terminal = EXCLUDED.terminal
 WHERE s.terminal IS DISTINCT FROM EXCLUDED.terminal

-- sync_transitions --
-- Make orc_state_transitions exactly the pairs declared in states.py.
WITH declared AS (
    SELECT * FROM unnest(%(sources)s::text[], %(targets)s::text[]) AS d(from_status, to_status)
), removed AS (
    DELETE FROM orc_state_transitions AS t
     WHERE NOT EXISTS (SELECT 1 FROM declared AS d
                        WHERE d.from_status = t.from_status AND d.to_status = t.to_status)
)
INSERT INTO orc_state_transitions (from_status, to_status)
SELECT from_status, to_status FROM declared
ON CONFLICT DO NOTHING

-- principal_looks_changes --
-- How many rows sync_principal_looks would write or delete.
WITH declared AS (
    SELECT * FROM unnest(%(chars)s::text[], %(looks)s::text[], %(written)s::text[])
        AS d(ch, look, look_as_written)
)
SELECT (SELECT count(*) FROM declared AS d
         WHERE NOT EXISTS (SELECT FROM orc_principal_looks AS l
                            WHERE l.ch = d.ch AND l.look = d.look
                              AND l.look_as_written = d.look_as_written))
     + (SELECT count(*) FROM orc_principal_looks AS l
         WHERE NOT EXISTS (SELECT FROM declared AS d WHERE d.ch = l.ch))

-- principal_looks_table_exists --
-- orc_principal_looks as the code writes it (migration 0057: both looks).
SELECT EXISTS (SELECT 1 FROM pg_attribute
                WHERE attrelid = to_regclass('orc_principal_looks')
                  AND attname = 'look_as_written' AND NOT attisdropped)

-- sync_principal_looks --
-- Make orc_principal_looks exactly the looks of orchestrator.domain.principals.look_rows.
WITH declared AS (
    SELECT * FROM unnest(%(chars)s::text[], %(looks)s::text[], %(written)s::text[])
        AS d(ch, look, look_as_written)
), removed AS (
    DELETE FROM orc_principal_looks AS l
     WHERE NOT EXISTS (SELECT 1 FROM declared AS d WHERE d.ch = l.ch)
)
INSERT INTO orc_principal_looks (ch, look, look_as_written)
SELECT ch, look, look_as_written FROM declared
ON CONFLICT (ch) DO UPDATE SET look = EXCLUDED.look, look_as_written = EXCLUDED.look_as_written
WHERE (orc_principal_looks.look, orc_principal_looks.look_as_written)
      IS DISTINCT FROM (EXCLUDED.look, EXCLUDED.look_as_written)

-- rederive_requested_persons --
-- The requester's person of every discard awaiting confirmation, by the looks just written (the
-- trigger derives it only when the requester is written; a confirmed discard keeps its persons).
UPDATE orc_dead_letters
   SET discard_requested_person = orc_principal_person_v1(discard_requested_by),
       discard_requested_persons = orc_principal_persons_v1(discard_requested_by)
 WHERE discard_requested_by IS NOT NULL AND discarded_by IS NULL
   AND (discard_requested_person, discard_requested_persons) IS DISTINCT FROM
       (orc_principal_person_v1(discard_requested_by),
        orc_principal_persons_v1(discard_requested_by))

-- job_types_changes --
-- What `application`'s migrate would do to orc_job_types, by job type: add, change (any of its
-- defaults), remove (a type it declares and no longer gives, that no other application
-- declares; docs/applications.md).
WITH declared AS (
    SELECT * FROM jsonb_to_recordset(%(types)s::jsonb)
        AS d (job_type text, queue text, max_attempts integer, max_retries integer,
              timeout_seconds integer, external boolean)
)
SELECT d.job_type, CASE WHEN t.job_type IS NULL THEN 'add' ELSE 'change' END
  FROM declared AS d LEFT JOIN orc_job_types AS t ON t.job_type = d.job_type
 WHERE (t.queue, t.max_attempts, t.max_retries, t.timeout_seconds, t.external)
       IS DISTINCT FROM (d.queue, d.max_attempts, d.max_retries, d.timeout_seconds, d.external)
UNION ALL
SELECT a.name, 'remove' FROM orc_application_definitions AS a
 WHERE a.kind = 'job_type' AND a.application = %(application)s
   AND NOT EXISTS (SELECT FROM declared AS d WHERE d.job_type = a.name)
   AND NOT EXISTS (SELECT FROM orc_application_definitions AS o
                    WHERE o.kind = 'job_type' AND o.name = a.name
                      AND o.application <> a.application)
   AND EXISTS (SELECT FROM orc_job_types AS t WHERE t.job_type = a.name)
ORDER BY 1

-- job_types_changes_before_applications --
-- The same, on a database that 0056 has not reached: its migration records every job type as
-- the application `default`'s, which then declares these in their place.
WITH declared AS (
    SELECT * FROM jsonb_to_recordset(%(types)s::jsonb)
        AS d (job_type text, queue text, max_attempts integer, max_retries integer,
              timeout_seconds integer, external boolean)
)
SELECT d.job_type, CASE WHEN t.job_type IS NULL THEN 'add' ELSE 'change' END
  FROM declared AS d LEFT JOIN orc_job_types AS t ON t.job_type = d.job_type
 WHERE (t.queue, t.max_attempts, t.max_retries, t.timeout_seconds, t.external)
       IS DISTINCT FROM (d.queue, d.max_attempts, d.max_retries, d.timeout_seconds, d.external)
UNION ALL
SELECT t.job_type, 'remove' FROM orc_job_types AS t
 WHERE NOT EXISTS (SELECT FROM declared AS d WHERE d.job_type = t.job_type)
ORDER BY 1

-- declarations_differ --
-- Would `application`'s declaration of `kinds` ({kind: {name: definition}}) write: a definition
-- new or changed, one withdrawn, or a refusal of it to clear?
WITH given AS (
    SELECT * FROM orc_declared_v1(%(kinds)s::text[], %(definitions)s::jsonb)
)
SELECT EXISTS (SELECT FROM given AS g
                WHERE NOT EXISTS (SELECT FROM orc_application_definitions AS o
                                   WHERE o.kind = g.kind AND o.name = g.name
                                     AND o.application = %(application)s
                                     AND o.definition = g.definition))
    OR EXISTS (SELECT FROM orc_application_definitions AS o
                WHERE o.application = %(application)s AND o.kind = ANY (%(kinds)s::text[])
                  AND NOT EXISTS (SELECT FROM given AS g
                                   WHERE g.kind = o.kind AND g.name = o.name))
    OR EXISTS (SELECT FROM orc_application_conflicts AS c
                WHERE c.application = %(application)s AND c.kind = ANY (%(kinds)s::text[]))

-- graphile_declared_by_others --
-- Does an application other than `application` declare Graphile Worker's API?
SELECT EXISTS (SELECT FROM orc_application_definitions
                WHERE kind = 'graphile' AND application <> %(application)s)

-- sync_job_types --
-- The job types of the code that migrates ([{job_type, queue, max_attempts, max_retries,
-- timeout_seconds, external}]), written after its application's declaration (orc_declare_v1)
-- in migrate's transaction; `gone`: the types it withdrew that no other application declares.
WITH declared AS (
    SELECT * FROM jsonb_to_recordset(%(types)s::jsonb)
        AS d (job_type text, queue text, max_attempts integer, max_retries integer,
              timeout_seconds integer, external boolean)
), removed AS (
    DELETE FROM orc_job_types AS t WHERE t.job_type = ANY (%(gone)s::text[])
)
INSERT INTO orc_job_types AS t (job_type, queue, max_attempts, max_retries, timeout_seconds,
                                external)
SELECT job_type, queue, max_attempts, max_retries, timeout_seconds, external FROM declared
ON CONFLICT (job_type) DO UPDATE
   SET queue = EXCLUDED.queue, max_attempts = EXCLUDED.max_attempts,
       max_retries = EXCLUDED.max_retries, timeout_seconds = EXCLUDED.timeout_seconds,
       external = EXCLUDED.external, updated_at = now()
 WHERE (t.queue, t.max_attempts, t.max_retries, t.timeout_seconds, t.external)
       IS DISTINCT FROM (EXCLUDED.queue, EXCLUDED.max_attempts, EXCLUDED.max_retries,
                         EXCLUDED.timeout_seconds, EXCLUDED.external)

-- graphile_schema --
-- Is there a schema graphile_worker, and is it the one migrate installs (its settings table)?
SELECT to_regnamespace('graphile_worker') IS NOT NULL,
       to_regclass('graphile_worker._orc_settings') IS NOT NULL

-- graphile_drop --
DROP SCHEMA IF EXISTS graphile_worker CASCADE

-- graphile_forget --
DELETE FROM orc_schema_migrations WHERE component = %(component)s

-- graphile_checksum --
SELECT checksum FROM orc_schema_migrations WHERE component = %(component)s

-- graphile_settings_differ --
-- Would graphile_settings write? (No row yet, or one holding other settings.)
WITH declared AS (
    SELECT %(tenant_id)s::text AS tenant_id, %(max_payload_bytes)s::integer AS max_payload_bytes,
           %(initial_status)s::text AS initial_status, %(waiting)s::text[] AS waiting,
           %(cancelled)s::text AS cancelled, %(completed)s::text AS completed,
           %(failed)s::text AS failed, %(task_prefix)s::text AS task_prefix,
           %(reserved_key_prefix)s::text AS reserved_key_prefix,
           %(max_message)s::integer AS max_message, %(max_queue)s::integer AS max_queue,
           %(max_job_key)s::integer AS max_job_key
)
SELECT NOT EXISTS (
    SELECT FROM graphile_worker._orc_settings AS s, declared AS d
     WHERE (s.tenant_id, s.max_payload_bytes, s.initial_status, s.waiting, s.cancelled,
            s.completed, s.failed, s.task_prefix, s.reserved_key_prefix, s.max_message,
            s.max_queue, s.max_job_key)
           IS NOT DISTINCT FROM
           (d.tenant_id, d.max_payload_bytes, d.initial_status, d.waiting, d.cancelled,
            d.completed, d.failed, d.task_prefix, d.reserved_key_prefix, d.max_message,
            d.max_queue, d.max_job_key))

-- graphile_settings --
-- Graphile Worker's API's settings, from the code that migrates (graphile_worker.sql); the row
-- is written only when they differ.
INSERT INTO graphile_worker._orc_settings AS s (tenant_id, max_payload_bytes, initial_status, waiting,
                                          cancelled, completed, failed, task_prefix,
                                          reserved_key_prefix, max_message, max_queue,
                                          max_job_key)
VALUES (%(tenant_id)s, %(max_payload_bytes)s, %(initial_status)s, %(waiting)s, %(cancelled)s,
        %(completed)s, %(failed)s, %(task_prefix)s, %(reserved_key_prefix)s, %(max_message)s,
        %(max_queue)s, %(max_job_key)s)
ON CONFLICT (one) DO UPDATE
   SET tenant_id = EXCLUDED.tenant_id, max_payload_bytes = EXCLUDED.max_payload_bytes,
       initial_status = EXCLUDED.initial_status, waiting = EXCLUDED.waiting,
       cancelled = EXCLUDED.cancelled, completed = EXCLUDED.completed,
       failed = EXCLUDED.failed, task_prefix = EXCLUDED.task_prefix,
       reserved_key_prefix = EXCLUDED.reserved_key_prefix, max_message = EXCLUDED.max_message,
       max_queue = EXCLUDED.max_queue, max_job_key = EXCLUDED.max_job_key
 WHERE (s.tenant_id, s.max_payload_bytes, s.initial_status, s.waiting, s.cancelled, s.completed,
        s.failed, s.task_prefix, s.reserved_key_prefix, s.max_message, s.max_queue,
        s.max_job_key)
       IS DISTINCT FROM
       (EXCLUDED.tenant_id, EXCLUDED.max_payload_bytes, EXCLUDED.initial_status,
        EXCLUDED.waiting, EXCLUDED.cancelled, EXCLUDED.completed, EXCLUDED.failed,
        EXCLUDED.task_prefix, EXCLUDED.reserved_key_prefix, EXCLUDED.max_message,
        EXCLUDED.max_queue, EXCLUDED.max_job_key)

-- live_worker_releases --
-- The registry's live workers and API servers, each with the release it recorded (0058: the
-- newest migration its code has; null when it records none, as a release before 0058, whose
-- row lacks it, or a process that wrote no row). Read through to_jsonb so that it runs on a
-- database 0058 has not reached yet.
SELECT w.id, c.worker, to_jsonb(c) ->> 'schema_version' AS schema_version
  FROM procrastinate_workers AS w
  LEFT JOIN orc_worker_configs AS c ON c.worker_id = w.id
 WHERE w.last_heartbeat > now() - make_interval(secs => %(seconds)s)
 ORDER BY w.id

-- live_workers --
-- The registry's live workers, on a database from before orc_worker_configs (0028).
SELECT id, NULL::text AS worker, NULL::text AS schema_version FROM procrastinate_workers
 WHERE last_heartbeat > now() - make_interval(secs => %(seconds)s)
 ORDER BY id
