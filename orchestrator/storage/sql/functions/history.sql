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
