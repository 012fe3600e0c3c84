-- The history: orc_job_events, one row per transition, written in the transaction that makes
-- it; append-only; announced to the API's event streams while any listens.

-- An event written without the facts every event of its kind carries (attempt, run, budget,
-- worker, run id, and for job.failed its layer, backoff and dead letter) gets them from its
-- job row: one place derives them, whichever statement wrote the event.
CREATE OR REPLACE FUNCTION orc_job_events_fill_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    j record;
    derived jsonb;
BEGIN
    SELECT attempt, dispatch_attempt, max_attempts, retry_count, max_retries INTO j
      FROM orc_jobs WHERE id = NEW.job_id;
    IF NOT FOUND THEN
        RETURN NEW;
    END IF;
    derived := jsonb_build_object('attempt', j.attempt, 'run', j.dispatch_attempt);
    IF NEW.kind IN ('job.failed', 'job.retry_scheduled') THEN
        derived := derived || jsonb_build_object('max_runs', j.max_attempts,
                                                 'retry_count', j.retry_count,
                                                 'max_retries', j.max_retries);
    END IF;
    IF NEW.kind = 'job.failed' THEN
        derived := derived || jsonb_build_object('layer', NULL, 'backoff_ms', NULL,
                                                 'dead_letter_id', NULL);
    END IF;
    IF NEW.kind IN ('job.failed', 'job.retry_scheduled') THEN
        -- The attempt's worker and lease token, as its claim recorded them.
        derived := derived || coalesce(
            (SELECT jsonb_build_object('worker', r.payload -> 'worker',
                                       'run_id', r.payload -> 'run_id')
               FROM orc_job_events AS r
              WHERE r.job_id = NEW.job_id AND r.kind = 'job.running'
                AND r.payload -> 'attempt' = coalesce(NEW.payload -> 'attempt', to_jsonb(j.attempt))
              ORDER BY r.id DESC
              LIMIT 1),
            '{}');
    END IF;
    NEW.payload := derived || NEW.payload;
    RETURN NEW;
END;
$$;

CREATE OR REPLACE TRIGGER orc_job_events_fill
    BEFORE INSERT ON orc_job_events
    FOR EACH ROW
    WHEN ((NEW.kind IN ('job.completed', 'job.interrupted')
           AND NOT NEW.payload ?& ARRAY['attempt', 'run'])
       OR (NEW.kind = 'job.retry_scheduled'
           AND NOT NEW.payload ?& ARRAY['attempt', 'run', 'max_runs', 'retry_count',
                                        'max_retries', 'worker', 'run_id'])
       OR (NEW.kind = 'job.failed'
           AND NOT NEW.payload ?& ARRAY['attempt', 'run', 'max_runs', 'retry_count',
                                        'max_retries', 'layer', 'backoff_ms',
                                        'dead_letter_id', 'worker', 'run_id']))
    EXECUTE FUNCTION orc_job_events_fill_v1();

-- History is final once written: an event is never updated (deleted only with its job, by
-- retention); a side effect, once committed, never becomes pending, failed or different again.
-- A side effect's other changes are dated.
CREATE OR REPLACE FUNCTION orc_history_is_final_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_TABLE_NAME = 'orc_job_events' THEN
        RAISE EXCEPTION 'orc_job_events is append-only' USING ERRCODE = 'WF002';
    END IF;
    IF OLD.status = 'committed' THEN
        RAISE EXCEPTION 'side effect % of job % is committed and cannot change',
            OLD.invocation_id, OLD.job_id
            USING ERRCODE = 'WF003';
    END IF;
    NEW.updated_at := now();
    RETURN NEW;
END;
$$;

CREATE OR REPLACE TRIGGER orc_job_events_append_only
    BEFORE UPDATE ON orc_job_events
    FOR EACH ROW EXECUTE FUNCTION orc_history_is_final_v1();

CREATE OR REPLACE TRIGGER orc_side_effects_committed_is_final
    BEFORE UPDATE ON orc_side_effects
    FOR EACH ROW EXECUTE FUNCTION orc_history_is_final_v1();

-- One notification per statement, and only while an event stream listens.
CREATE OR REPLACE FUNCTION orc_notify_event_listeners_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT FROM orc_event_listeners WHERE until > now()) THEN
        PERFORM pg_notify('orc_job_events', '');
    END IF;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER orc_job_events_notify
    AFTER INSERT ON orc_job_events
    FOR EACH STATEMENT EXECUTE FUNCTION orc_notify_event_listeners_v1();

-- The payloads of the kinds written in SQL, each shaped here and only here (the other kinds are
-- shaped in orchestrator/domain/events.py; docs/architecture.md, "Event payloads", says which,
-- and tests/test_event_writers.py holds every statement that writes an event to it). Each is
-- STABLE, as jsonb_build_object is, so that PostgreSQL inlines it into the statement that calls
-- it (job.created's says why).

-- job.created's payload, computed inside the submit statement. STABLE, not IMMUTABLE: a
-- timestamptz (run_at) turns into JSON text in the session's time zone, and PostgreSQL inlines
-- a SQL function only when its body is no more volatile than its declaration (declared
-- IMMUTABLE, it cost a call per job: 125 us on PostgreSQL 15).
CREATE OR REPLACE FUNCTION orc_created_event_v1(j orc_jobs) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object('job_type', j.job_type, 'queue', j.queue, 'run_at', j.run_at,
                              'max_runs', j.max_attempts, 'max_retries', j.max_retries,
                              'job_key', j.job_key, 'trace_id', j.trace_id,
                              'tenant_id', j.tenant_id)
$$;

-- job.running's payload, from the job row as the claim leaves it.
CREATE OR REPLACE FUNCTION orc_running_event_v1(j orc_jobs) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object(
        'attempt', j.attempt,
        'max_attempts', orc_max_attempts_v1(j.attempt, j.dispatch_attempt, j.max_attempts,
                                            j.retry_count, j.max_retries),
        'run', j.dispatch_attempt, 'max_runs', j.max_attempts, 'retry_count', j.retry_count,
        'max_retries', j.max_retries, 'worker', j.locked_by, 'run_id', j.lease_token)
$$;

-- job.replaced: a keyed submit replaced a waiting job, whose revision is now p_revision.
CREATE OR REPLACE FUNCTION orc_replaced_event_v1(
    p_job_key text, p_mode text, p_revision integer, p_tenant_id text
) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object('job_key', p_job_key, 'mode', p_mode, 'revision', p_revision,
                              'tenant_id', p_tenant_id)
$$;

-- job.key_revoked: a running job lost its key, to the job p_replaced_by (null: to nobody,
-- Graphile Worker's remove_job).
CREATE OR REPLACE FUNCTION orc_key_revoked_event_v1(p_job_key text, p_replaced_by uuid)
RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object('job_key', p_job_key, 'replaced_by', p_replaced_by)
$$;

-- job.cancelled: why, and by whom (an operator, or Graphile Worker's remove_job).
CREATE OR REPLACE FUNCTION orc_cancelled_event_v1(p_reason text, p_by text) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object('reason', p_reason, 'by', p_by)
$$;

-- job.rescheduled: what a waiting job has now that a producer moved it. STABLE: run_at is a
-- timestamptz (as job.created's).
CREATE OR REPLACE FUNCTION orc_rescheduled_event_v1(j orc_jobs) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object('run_at', coalesce(j.next_retry_at, j.run_at),
                              'priority', j.priority, 'max_runs', j.max_attempts)
$$;

-- job.waiting_for_capacity: the job parked on its flow key, waiting on p_waiting_on (what
-- blocked it: a window, a concurrency, a pause), in the status it waits in.
CREATE OR REPLACE FUNCTION orc_waiting_for_capacity_event_v1(j orc_jobs, p_waiting_on text)
RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object('key', j.flow_key, 'waiting_on', p_waiting_on, 'status', j.status)
$$;

-- job.checkpointed: the step saved, whether it was the last, and how many side effects the
-- statement that saved it committed.
CREATE OR REPLACE FUNCTION orc_checkpointed_event_v1(
    p_step integer, p_final boolean, p_effects_committed bigint
) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object('step', p_step, 'final', p_final,
                              'effects_committed', p_effects_committed)
$$;

-- job.completed: the attempt that completed (its lease token as run_id) and how long it ran, as
-- its worker measured it (null for a job no attempt held: Graphile Worker's complete_jobs).
CREATE OR REPLACE FUNCTION orc_completed_event_v1(
    p_attempt integer, p_run integer, p_run_id uuid, p_worker text, p_duration_ms numeric
) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object('attempt', p_attempt, 'run', p_run, 'run_id', p_run_id,
                              'worker', p_worker, 'duration_ms', p_duration_ms)
$$;

-- job.blocked: the job waits for these parents (its depends_on, in order), of which
-- p_waiting_on had not ended when it was submitted.
CREATE OR REPLACE FUNCTION orc_blocked_event_v1(p_parents uuid[], p_waiting_on bigint)
RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT jsonb_build_object('parents', to_jsonb(p_parents), 'waiting_on', p_waiting_on)
$$;

-- job.unblocked: how each job it waited for ended (in order; a failure under `run`, or under
-- `wait` the job that replayed it), now that none is left to wait for.
CREATE OR REPLACE FUNCTION orc_unblocked_event_v1(p_awaited uuid[], p_ends text[])
RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT jsonb_build_object('ended', coalesce(jsonb_agg(
               jsonb_build_object('job_id', e.job_id, 'status', e.status) ORDER BY e.n), '[]'))
      FROM unnest(p_awaited, p_ends) WITH ORDINALITY AS e (job_id, status, n)
$$;

-- job.children_spawned: the children a step spawned (in order), under the step's key.
CREATE OR REPLACE FUNCTION orc_children_spawned_event_v1(
    p_children uuid[], p_step integer, p_key text
) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT jsonb_build_object('children', to_jsonb(p_children), 'step', p_step, 'key', p_key)
$$;

-- job.waiting_for_children: the job stopped, holding no slot, until these children (of those it
-- named) have ended; p_waiting_on had not.
CREATE OR REPLACE FUNCTION orc_waiting_for_children_event_v1(
    p_children uuid[], p_waiting_on integer
) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT jsonb_build_object('awaiting', to_jsonb(p_children), 'unended', p_waiting_on)
$$;
