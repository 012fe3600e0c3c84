-- 0023_derived_facts: what the database can derive from a job row, it fills itself, so that every
-- writer gets it right, the previous release's worker included (docs/operations.md, "Rollout
-- contract"): during a rolling deploy that worker runs on this schema and writes dead letters
-- and events with its own SQL, which knows nothing of the columns and keys added since 0009.
--
-- compatible-with-older-workers: yes
--
-- * A dead letter's tenant is its job's: orc_dead_letters_tenant_v1 sets it on every insert (and
--   on an update that changes the dead letter's job or tenant), whatever the writer passed; the
--   foreign key guarantees the job exists. orc_fail_jobs_v1 still passes it (same value). Before,
--   a dead letter written by the previous release had no tenant, so a tenant's token, list and
--   metrics missed it.
-- * A replay's tenant is its dead letter's: a job submitted with `replay_of` and no tenant (the
--   previous release's `dlq requeue` gives none) takes the letter's (orc_jobs_replay_tenant_v1,
--   before the insert, so job.created says it too). Today's requeue passes the same value.
-- * An event of an attempt that lacks a counter of docs/contracts.md's event table gets it from
--   its job (orc_job_events_fill_v1); the writer's own keys always win. Only values that the
--   writing statement does not change are taken: attempt (counted at the claim), run (the
--   dispatch's, set at the claim), max_runs, max_retries, and retry_count (which the previous
--   release's retry statements add themselves, after their increment); job.failed's keys that
--   do not apply (layer and backoff_ms on a terminal failure, dead_letter_id on a retry) are
--   null, as today's writer has them. A failure's `worker` and `run_id` are the attempt's, as
--   its claim recorded them in job.running (the statement that writes the failure clears the
--   job's lease, so the job row no longer has them). The trigger's WHEN clause looks at the
--   keys in C: today's writers, which give every key, never call the function.
--
-- Not derivable, and left as the previous release writes them (docs/operations.md lists them):
-- job.checkpointed's `final`, and `max_attempts`, which that release writes on job.failed with
-- its old meaning (the dispatch's budget, today's `max_runs`). A job it submits has no tenant
-- and no traceparent: it never had them to give.
--
-- Compatible with older workers: it adds three triggers and changes no table, column or function
-- that any release calls; every insert the previous release makes still succeeds.

CREATE FUNCTION orc_dead_letters_tenant_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    SELECT j.tenant_id INTO NEW.tenant_id FROM orc_jobs AS j WHERE j.id = NEW.job_id;
    RETURN NEW;
END;
$$;

CREATE TRIGGER orc_dead_letters_tenant
    BEFORE INSERT OR UPDATE OF job_id, tenant_id ON orc_dead_letters
    FOR EACH ROW EXECUTE FUNCTION orc_dead_letters_tenant_v1();

CREATE FUNCTION orc_jobs_replay_tenant_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    SELECT l.tenant_id INTO NEW.tenant_id FROM orc_dead_letters AS l WHERE l.id = NEW.replay_of;
    RETURN NEW;
END;
$$;

CREATE TRIGGER orc_jobs_replay_tenant
    BEFORE INSERT ON orc_jobs
    FOR EACH ROW WHEN (NEW.replay_of IS NOT NULL AND NEW.tenant_id IS NULL)
    EXECUTE FUNCTION orc_jobs_replay_tenant_v1();

CREATE FUNCTION orc_job_events_fill_v1() RETURNS trigger
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

CREATE TRIGGER orc_job_events_fill
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
