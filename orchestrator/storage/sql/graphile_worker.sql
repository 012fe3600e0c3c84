-- Graphile Worker's SQL API for producers (docs/graphile.md), installed by `orchestrator
-- migrate` into the schema graphile_worker when ORCHESTRATOR_GRAPHILE_COMPAT is on. Each call
-- writes through the orchestrator's own submit (orc_submit_jobs_v2), completion
-- (orc_complete_jobs_v1), failure writer (orc_fail_jobs_v1) and dispatches, under the state
-- machine's trigger, and answers with Graphile Worker 0.17.3's job columns. Nothing here holds data of its own: the
-- schema is dropped and created again whenever this file changes (docs/architecture.md,
-- "Where the SQL lives").

CREATE SCHEMA graphile_worker;

-- Graphile Worker's bookkeeping, shown fully migrated (0.17.3: migrations 1 to 19; those
-- starting "--! breaking" marked so): its client migrates on connect, and would otherwise
-- install its own tables beside these functions, or refuse.
CREATE TABLE graphile_worker.migrations (
    id integer PRIMARY KEY,
    ts timestamptz NOT NULL DEFAULT now(),
    breaking boolean NOT NULL DEFAULT false
);
INSERT INTO graphile_worker.migrations (id, breaking)
SELECT n, n IN (1, 3, 11, 13, 14, 16, 19) FROM generate_series(1, 19) AS n;

-- What the functions take from the orchestrator, written by each `migrate` from its Python
-- (one row): the tenant its jobs get, the payload limit, the state machine's names, the
-- Procrastinate task prefix, the key prefix only the scheduler may use, the longest error
-- message a failure stores, and the longest queue name and job key a submit takes (its
-- JobSpec's bounds).
CREATE TABLE graphile_worker._orc_settings (
    one boolean PRIMARY KEY DEFAULT true CHECK (one),
    tenant_id text,
    max_payload_bytes integer NOT NULL,
    initial_status text NOT NULL,
    waiting text[] NOT NULL,
    cancelled text NOT NULL,
    completed text NOT NULL,
    failed text NOT NULL,
    task_prefix text NOT NULL,
    reserved_key_prefix text NOT NULL,
    max_message integer NOT NULL,
    max_queue integer NOT NULL,
    max_job_key integer NOT NULL
);

-- Graphile Worker's job_spec, as its WorkerUtils.addJobs sends it.
CREATE TYPE graphile_worker.job_spec AS (
    identifier text,
    payload json,
    queue_name text,
    run_at timestamptz,
    max_attempts smallint,
    job_key text,
    priority smallint,
    flags text[]
);

-- A job as Graphile Worker's functions return it.
CREATE TYPE graphile_worker.job AS (
    id bigint,
    queue_name text,
    task_identifier text,
    payload json,
    priority integer,
    run_at timestamptz,
    attempts integer,
    max_attempts integer,
    last_error text,
    created_at timestamptz,
    updated_at timestamptz,
    key text,
    locked_at timestamptz,
    locked_by text,
    revision integer,
    flags jsonb,
    is_available boolean
);

-- A named queue is serial in Graphile Worker: its jobs run one at a time. Here it is a flow key
-- of this limit (one running job per key; docs/flow-control.md).
CREATE FUNCTION graphile_worker._queue_limit() RETURNS text
LANGUAGE sql IMMUTABLE AS $$ SELECT 'graphile_worker_queue' $$;

-- The limit itself, in the flow limits' table, as its owner (no config's sync changes or
-- deletes it: migration 0049; a config cannot name it: retry_config/names.py).
INSERT INTO orc_flow_limits (name, concurrency, interval_seconds, share_by, owner)
VALUES (graphile_worker._queue_limit(), 1, 1, 'none', 'graphile_worker')
ON CONFLICT (name) DO UPDATE
   SET concurrency = 1, requests = NULL, units = NULL, share_by = 'none',
       owner = 'graphile_worker', updated_at = now();

CREATE FUNCTION graphile_worker._settings() RETURNS graphile_worker._orc_settings
LANGUAGE plpgsql STABLE AS $$
DECLARE
    s graphile_worker._orc_settings;
BEGIN
    SELECT * INTO s FROM graphile_worker._orc_settings;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'graphile_worker: not configured; run `orchestrator migrate`'
              USING ERRCODE = '55000';
    END IF;
    RETURN s;
END;
$$;

-- A job's runs per dispatch (max_attempts) as given to add_job or reschedule_jobs: at least 1,
-- as the job table holds them (null: the default, or kept).
CREATE FUNCTION graphile_worker._runs(max_attempts smallint) RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF max_attempts < 1 THEN
        RAISE EXCEPTION 'graphile_worker: max_attempts must be at least 1 (given %)', max_attempts
              USING ERRCODE = '22023';
    END IF;
END;
$$;

-- The orchestrator's job as Graphile Worker shows one.
CREATE FUNCTION graphile_worker._job(j orc_jobs, s graphile_worker._orc_settings)
RETURNS graphile_worker.job
LANGUAGE sql STABLE AS $$
    SELECT j.number,
           CASE WHEN j.flow_limit = graphile_worker._queue_limit()
                THEN substr(j.flow_key, length(graphile_worker._queue_limit()) + 2) END,
           j.job_type, j.payload::json, j.priority, coalesce(j.next_retry_at, j.run_at),
           j.attempt, j.max_attempts,
           coalesce(j.last_error ->> 'message', j.last_error::text), j.created_at,
           j.updated_at, j.job_key,
           CASE WHEN j.status = 'RUNNING' THEN coalesce(j.heartbeat_at, j.started_at) END,
           j.locked_by, j.revision, NULL::jsonb,
           j.status = ANY (s.waiting)
$$;

-- Submit Graphile Worker job specs with one key mode, through orc_submit_jobs_v2; each spec's
-- job, in the specs' order. A spec the orchestrator would refuse is refused, naming why, and
-- nothing is written. A job of a type under a flow limit gets its key from the limit's
-- template in the submit's statement, as every submit's (a payload that lacks a field the
-- template names is refused there: orc_flow_key_v1), with a cost of 1.
CREATE FUNCTION graphile_worker._submit(specs graphile_worker.job_spec[], p_mode text)
RETURNS SETOF graphile_worker.job
LANGUAGE plpgsql AS $$
DECLARE
    s graphile_worker._orc_settings := graphile_worker._settings();
    spec graphile_worker.job_spec;
    t orc_job_types;
    lim orc_flow_limits;
    n integer := 0;
    payload jsonb;
    existing jsonb;
    rows jsonb := '[]';
    ids uuid[];
BEGIN
    FOREACH spec IN ARRAY coalesce(specs, '{}') LOOP
        SELECT * INTO t FROM orc_job_types AS o WHERE o.job_type = spec.identifier;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'graphile_worker: unknown job type %; known: %', quote_literal(spec.identifier),
                  (SELECT coalesce(string_agg(quote_literal(o.job_type), ', ' ORDER BY o.job_type), 'none')
                     FROM orc_job_types AS o)
                  USING ERRCODE = '22023';
        END IF;
        IF cardinality(spec.flags) > 0 THEN
            RAISE EXCEPTION 'graphile_worker: flags are not supported (given %); to hold jobs back, pause their flow key (docs/graphile.md)', spec.flags
                  USING ERRCODE = '0A000';
        END IF;
        SELECT l.* INTO lim
          FROM orc_flow_job_types AS f JOIN orc_flow_limits AS l ON l.name = f.limit_name
         WHERE f.job_type = t.job_type;
        IF spec.queue_name IS NOT NULL AND (t.external OR lim.name IS NOT NULL) THEN
            RAISE EXCEPTION 'graphile_worker: queue_name %: job type % %; a named (serial) queue is a flow key of its own',
                  quote_literal(spec.queue_name), quote_literal(t.job_type),
                  CASE WHEN t.external THEN 'is external' ELSE 'runs under a flow limit' END
                  USING ERRCODE = '22023';
        END IF;
        IF spec.queue_name = '' OR length(spec.queue_name) > s.max_queue THEN
            RAISE EXCEPTION 'graphile_worker: queue_name must be 1 to % characters', s.max_queue
                  USING ERRCODE = '22023';
        END IF;
        IF spec.job_key = '' OR length(spec.job_key) > s.max_job_key THEN
            RAISE EXCEPTION 'graphile_worker: job_key must be 1 to % characters', s.max_job_key
                  USING ERRCODE = '22023';
        END IF;
        IF starts_with(spec.job_key, s.reserved_key_prefix) THEN
            RAISE EXCEPTION 'graphile_worker: job key % is in the schedules'' namespace (%<name>/<tick>): only the scheduler submits those keys; use another key',
                  quote_literal(left(spec.job_key, 80)), s.reserved_key_prefix
                  USING ERRCODE = '22023';
        END IF;
        PERFORM graphile_worker._runs(spec.max_attempts);
        payload := coalesce(spec.payload::jsonb, '{}');  -- \u0000: 22P05, as jsonb refuses it
        IF octet_length(payload::text) > s.max_payload_bytes THEN
            RAISE EXCEPTION 'graphile_worker: payload of job type %: % bytes, over the limit of % (ORCHESTRATOR_MAX_PAYLOAD_BYTES)',
                  quote_literal(t.job_type), octet_length(payload::text), s.max_payload_bytes
                  USING ERRCODE = '22023';
        END IF;
        -- Graphile Worker's replace appends an array payload to a waiting job's array payload.
        IF spec.job_key IS NOT NULL AND p_mode <> 'unsafe_dedupe'
           AND jsonb_typeof(payload) = 'array' THEN
            PERFORM pg_advisory_xact_lock(orc_job_key_lock_id_v1(s.tenant_id, spec.job_key));
            SELECT j.payload INTO existing FROM orc_jobs AS j
             WHERE j.job_key = spec.job_key
               AND coalesce(j.tenant_id, '') = coalesce(s.tenant_id, '')
               AND j.finished_at IS NULL AND j.status = ANY (s.waiting);
            IF jsonb_typeof(existing) = 'array' THEN
                payload := existing || payload;
            END IF;
        END IF;
        rows := rows || jsonb_build_object(
            'ord', n, 'id', orc_uuid7_v1(), 'job_type', t.job_type,
            'payload', payload, 'queue', t.queue, 'priority', coalesce(spec.priority, 0),
            'run_at', spec.run_at, 'max_attempts', coalesce(spec.max_attempts, t.max_attempts),
            'max_retries', t.max_retries, 'job_key', spec.job_key, 'job_key_mode', p_mode,
            'trace_id', replace(gen_random_uuid()::text, '-', ''),
            'timeout_seconds', t.timeout_seconds, 'tenant_id', s.tenant_id,
            'flow_key', graphile_worker._queue_limit() || ':' || spec.queue_name,
            'flow_template', lim.key_template,
            'flow_limit', CASE WHEN spec.queue_name IS NOT NULL
                               THEN graphile_worker._queue_limit() ELSE lim.name END,
            'flow_cost', CASE WHEN spec.queue_name IS NOT NULL OR lim.name IS NOT NULL THEN 1 END,
            'flow_share_by', lim.share_by,
            'flow_share', CASE WHEN spec.queue_name IS NOT NULL THEN '' END);
        n := n + 1;
    END LOOP;
    IF n = 0 THEN
        RETURN;
    END IF;
    -- Submitted first, read after: a statement does not see the rows a function it calls
    -- writes.
    ids := ARRAY(SELECT r.job_id
                   FROM orc_submit_jobs_v2(rows, s.initial_status, s.waiting, s.task_prefix) AS r
                  ORDER BY r.ord);
    -- Graphile Worker's id for each: only the jobs this API adds have one (0041).
    UPDATE orc_jobs AS j SET number = nextval('orc_jobs_number_seq')
     WHERE j.id = ANY (ids) AND j.number IS NULL;
    RETURN QUERY
    SELECT (graphile_worker._job(j, s)).*
      FROM unnest(ids) WITH ORDINALITY AS i (id, n)
      JOIN orc_jobs AS j ON j.id = i.id
     ORDER BY i.n;
END;
$$;

-- Graphile Worker's add_jobs: its job specs, job keys replaced (their run_at kept when
-- job_key_preserve_run_at).
CREATE FUNCTION graphile_worker.add_jobs(
    specs graphile_worker.job_spec[], job_key_preserve_run_at boolean DEFAULT false
) RETURNS SETOF graphile_worker.job
LANGUAGE sql AS $$
    SELECT * FROM graphile_worker._submit(
        specs, CASE WHEN job_key_preserve_run_at THEN 'preserve_run_at' ELSE 'replace' END)
$$;

-- Graphile Worker's add_job, with its named parameters and defaults. As there, a key mode other
-- than its three is an error (GWBKM) only when a key is given.
CREATE FUNCTION graphile_worker.add_job(
    identifier text,
    payload json DEFAULT NULL,
    queue_name text DEFAULT NULL,
    run_at timestamptz DEFAULT NULL,
    max_attempts integer DEFAULT NULL,
    job_key text DEFAULT NULL,
    priority integer DEFAULT NULL,
    flags text[] DEFAULT NULL,
    job_key_mode text DEFAULT 'replace'
) RETURNS graphile_worker.job
LANGUAGE plpgsql AS $$
DECLARE
    v_job graphile_worker.job;
BEGIN
    IF job_key IS NOT NULL AND job_key_mode IS NOT NULL
       AND job_key_mode NOT IN ('replace', 'preserve_run_at', 'unsafe_dedupe') THEN
        RAISE EXCEPTION 'Invalid job_key_mode value, expected ''replace'', ''preserve_run_at'' or ''unsafe_dedupe''.'
              USING ERRCODE = 'GWBKM';
    END IF;
    SELECT * INTO v_job FROM graphile_worker._submit(
        ARRAY[(identifier, payload, queue_name, run_at, max_attempts::smallint, job_key,
               priority::smallint, flags)::graphile_worker.job_spec],
        coalesce(job_key_mode, 'replace'));
    RETURN v_job;
END;
$$;

-- Graphile Worker's remove_job: a waiting job with the key is cancelled (job.cancelled); one
-- running or awaiting an approval loses its key (job.key_revoked) and goes on. An unknown key:
-- one row of nulls, as there.
CREATE FUNCTION graphile_worker.remove_job(job_key text) RETURNS graphile_worker.job
LANGUAGE plpgsql STRICT AS $$
DECLARE
    s graphile_worker._orc_settings := graphile_worker._settings();
    j orc_jobs;
BEGIN
    SELECT * INTO j FROM orc_live_job_with_key_v1(remove_job.job_key, s.tenant_id) AS k
     WHERE k.id IS NOT NULL;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF j.status = ANY (s.waiting) THEN
        UPDATE orc_jobs AS o
           SET status = s.cancelled, next_retry_at = NULL
         WHERE o.id = j.id
        RETURNING * INTO j;
        INSERT INTO orc_job_events (job_id, kind, payload)
        VALUES (j.id, 'job.cancelled',
                orc_cancelled_event_v1('graphile_worker.remove_job', 'graphile_worker'));
        PERFORM procrastinate_cancel_job_v1(j.procrastinate_job_id, true, false)
           WHERE j.procrastinate_job_id IS NOT NULL;
    ELSE
        UPDATE orc_jobs AS o SET job_key = NULL WHERE o.id = j.id RETURNING * INTO j;
        INSERT INTO orc_job_events (job_id, kind, payload)
        VALUES (j.id, 'job.key_revoked',
                orc_key_revoked_event_v1(remove_job.job_key, NULL));
    END IF;
    RETURN graphile_worker._job(j, s);
END;
$$;

-- The jobs of Graphile Worker's ids (job numbers) that complete_jobs, permanently_fail_jobs and
-- reschedule_jobs may change: the API's tenant's (without one, the jobs without a tenant), and
-- waiting (PENDING or RETRY). As Graphile Worker leaves a locked job alone, a running job is
-- left to its attempt, one awaiting an approval to its approval, a finished one as it ended; an
-- unknown id, or another tenant's, is ignored. Locked, in id order (a job before its dispatch:
-- docs/architecture.md, "Lock order"); one that moved on meanwhile is not returned.
CREATE FUNCTION graphile_worker._waiting(job_ids bigint[], s graphile_worker._orc_settings)
RETURNS SETOF orc_jobs
LANGUAGE sql AS $$
    SELECT * FROM orc_jobs AS j
     WHERE j.number = ANY (job_ids)
       AND coalesce(j.tenant_id, '') = coalesce(s.tenant_id, '')
       AND j.status = ANY (s.waiting)
     ORDER BY j.id
       FOR UPDATE
$$;

-- The jobs, as Graphile Worker returns them, in the order of their ids there.
CREATE FUNCTION graphile_worker._jobs(ids uuid[], s graphile_worker._orc_settings)
RETURNS SETOF graphile_worker.job
LANGUAGE sql STABLE AS $$
    SELECT (graphile_worker._job(j, s)).* FROM orc_jobs AS j
     WHERE j.id = ANY (ids)
     ORDER BY j.number
$$;

-- The waiting dispatches of the jobs are deleted, as a keyed replace deletes a replaced job's;
-- one a worker fetched already finds its job finished, or holding another dispatch: stale.
CREATE FUNCTION graphile_worker._drop_dispatches(ids uuid[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM procrastinate_cancel_job_v1(j.procrastinate_job_id, false, true)
       FROM orc_jobs AS j
      WHERE j.id = ANY (ids) AND j.procrastinate_job_id IS NOT NULL
      ORDER BY j.id;
END;
$$;

-- Graphile Worker's complete_jobs: each waiting job of the ids ends COMPLETED (its result
-- null) through the orchestrator's completion, its job.completed naming no attempt (run_id,
-- worker and duration_ms null), and its dispatch deleted. Graphile Worker deletes the job; here
-- it stays, finished, with its history. The jobs it completed.
CREATE FUNCTION graphile_worker.complete_jobs(job_ids bigint[])
RETURNS SETOF graphile_worker.job
LANGUAGE plpgsql AS $$
DECLARE
    s graphile_worker._orc_settings := graphile_worker._settings();
    ids uuid[] := ARRAY(SELECT w.id FROM graphile_worker._waiting(job_ids, s) AS w);
    done uuid[];
BEGIN
    done := ARRAY(
        SELECT ids[c.ord]
          FROM orc_complete_jobs_v1(
                   (SELECT coalesce(jsonb_agg(jsonb_build_object(
                               'ord', i.n, 'job_id', j.id, 'lease_token', NULL, 'result', NULL,
                               'attempt', j.attempt, 'run', j.dispatch_attempt, 'worker', NULL,
                               'duration_ms', NULL,
                               'procrastinate_job_id', NULL, 'delete_dispatch', false)
                               ORDER BY i.n), '[]')
                      FROM unnest(ids) WITH ORDINALITY AS i (id, n)
                      JOIN orc_jobs AS j ON j.id = i.id),
                   s.completed, s.waiting) AS c
         WHERE c.completed);
    PERFORM graphile_worker._drop_dispatches(done);
    RETURN QUERY SELECT * FROM graphile_worker._jobs(done, s);
END;
$$;

-- Graphile Worker's permanently_fail_jobs: each waiting job of the ids ends FAILED as a failure
-- no attempt held (orc_fail_unheld_v1, through the one failure writer): dead-lettered, a
-- PERMANENT error, code GRAPHILE_PERMANENTLY_FAILED, message error_message or Graphile
-- Worker's 'Manually marked as failed'; nobody is notified, as for a rejected approval: the
-- producer decided it. Its dispatch is deleted. The jobs it failed.
CREATE FUNCTION graphile_worker.permanently_fail_jobs(job_ids bigint[], error_message text DEFAULT NULL)
RETURNS SETOF graphile_worker.job
LANGUAGE plpgsql AS $$
DECLARE
    s graphile_worker._orc_settings := graphile_worker._settings();
    failed uuid[];
BEGIN
    IF length(error_message) > s.max_message THEN
        RAISE EXCEPTION 'graphile_worker: error_message must be at most % characters (given %)',
              s.max_message, length(error_message)
              USING ERRCODE = '22023';
    END IF;
    failed := ARRAY(
        SELECT f.job_id
          FROM orc_fail_unheld_v1(
                   ARRAY(SELECT w.id FROM graphile_worker._waiting(job_ids, s) AS w),
                   jsonb_build_object(
                       'message', coalesce(error_message, 'Manually marked as failed'),
                       'code', 'GRAPHILE_PERMANENTLY_FAILED', 'classification', 'PERMANENT'),
                   s.failed, s.waiting) AS f);
    PERFORM graphile_worker._drop_dispatches(failed);
    RETURN QUERY SELECT * FROM graphile_worker._jobs(failed, s);
END;
$$;

-- Graphile Worker's reschedule_jobs: each waiting job of the ids gets the run time, priority
-- and runs per dispatch (max_attempts) given (null: kept), a job.rescheduled event saying what
-- it now has, and a new dispatch for them, as a keyed replace gives a waiting job (its
-- dispatch's runs start again). As there, the values are smallints (out of range: 22003).
-- `attempts` is refused: a job's attempts count its every claim, and are never reset.
CREATE FUNCTION graphile_worker.reschedule_jobs(
    job_ids bigint[],
    run_at timestamptz DEFAULT NULL,
    priority integer DEFAULT NULL,
    attempts integer DEFAULT NULL,
    max_attempts integer DEFAULT NULL
) RETURNS SETOF graphile_worker.job
LANGUAGE plpgsql AS $$
DECLARE
    s graphile_worker._orc_settings := graphile_worker._settings();
    v_priority smallint := reschedule_jobs.priority::smallint;
    v_max_attempts smallint := reschedule_jobs.max_attempts::smallint;
    ids uuid[];
BEGIN
    IF reschedule_jobs.attempts IS NOT NULL THEN
        RAISE EXCEPTION 'graphile_worker: attempts cannot be set (given %): a job''s attempts count its every claim and are never reset; max_attempts gives it more runs (docs/graphile.md)',
              reschedule_jobs.attempts
              USING ERRCODE = '0A000';
    END IF;
    PERFORM graphile_worker._runs(v_max_attempts);
    ids := ARRAY(SELECT w.id FROM graphile_worker._waiting(job_ids, s) AS w);
    UPDATE orc_jobs AS j
       SET run_at = coalesce(reschedule_jobs.run_at, j.run_at),
           next_retry_at = CASE WHEN j.next_retry_at IS NULL THEN NULL
                                ELSE coalesce(reschedule_jobs.run_at, j.next_retry_at) END,
           priority = coalesce(v_priority, j.priority),
           max_attempts = coalesce(v_max_attempts, j.max_attempts)
     WHERE j.id = ANY (ids);
    INSERT INTO orc_job_events (job_id, kind, payload)
    SELECT j.id, 'job.rescheduled', orc_rescheduled_event_v1(j)
      FROM orc_jobs AS j
     WHERE j.id = ANY (ids)
     ORDER BY j.id;
    PERFORM graphile_worker._drop_dispatches(ids);
    PERFORM orc_dispatch_v1(ids, s.task_prefix) WHERE cardinality(ids) > 0;
    RETURN QUERY SELECT * FROM graphile_worker._jobs(ids, s);
END;
$$;
