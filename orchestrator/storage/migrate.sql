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
-- Our migrations applied that this code does not have (a newer release applied them).
SELECT version, name, compatible_with_older_workers FROM orc_schema_migrations
 WHERE component = 'orchestrator' AND NOT version = ANY (%(known)s::text[])
 ORDER BY version

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

-- sync_states --
INSERT INTO orc_states (status, terminal)
SELECT * FROM unnest(%(statuses)s::text[], %(terminal)s::boolean[])
ON CONFLICT (status) DO UPDATE SET terminal = EXCLUDED.terminal

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

-- sync_job_types --
-- Make orc_job_types the job types of the code that migrates ([{job_type, queue, max_attempts,
-- max_retries, timeout_seconds, external}]).
WITH declared AS (
    SELECT * FROM jsonb_to_recordset(%(types)s::jsonb)
        AS d (job_type text, queue text, max_attempts integer, max_retries integer,
              timeout_seconds integer, external boolean)
), removed AS (
    DELETE FROM orc_job_types AS t
     WHERE NOT EXISTS (SELECT FROM declared AS d WHERE d.job_type = t.job_type)
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

-- graphile_settings --
-- Graphile Worker's API's settings, from the code that migrates (graphile_worker.sql).
INSERT INTO graphile_worker._orc_settings (tenant_id, max_payload_bytes, initial_status, waiting,
                                          cancelled, completed, failed, task_prefix,
                                          reserved_key_prefix, max_message)
VALUES (%(tenant_id)s, %(max_payload_bytes)s, %(initial_status)s, %(waiting)s, %(cancelled)s,
        %(completed)s, %(failed)s, %(task_prefix)s, %(reserved_key_prefix)s, %(max_message)s)
ON CONFLICT (one) DO UPDATE
   SET tenant_id = EXCLUDED.tenant_id, max_payload_bytes = EXCLUDED.max_payload_bytes,
       initial_status = EXCLUDED.initial_status, waiting = EXCLUDED.waiting,
       cancelled = EXCLUDED.cancelled, completed = EXCLUDED.completed,
       failed = EXCLUDED.failed, task_prefix = EXCLUDED.task_prefix,
       reserved_key_prefix = EXCLUDED.reserved_key_prefix, max_message = EXCLUDED.max_message
