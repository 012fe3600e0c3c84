-- Checkpoints and the side-effect ledger (checkpoints/): what a committed effect recorded is
-- final, and a replay carries its replayed job's ledger.

-- A committed side effect is history: see orc_history_is_final_v1 (history.sql).

-- A replay (a job requeued from a dead letter) carries the replayed job's ledger, so that no
-- effect is made again: a committed one returns its result, a pending or failed one (the call
-- may have happened) is reconciled before any new call of it. Its effects keep the chain's
-- invocation ids (`effects_root`: the first job of the chain), which the external system saw
-- as idempotency keys. Derived here, whoever submits the replay (an older release included).
CREATE OR REPLACE FUNCTION orc_replay_ledger_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_WHEN = 'BEFORE' THEN
        SELECT coalesce(j.effects_root, j.id) INTO NEW.effects_root
          FROM orc_dead_letters AS l JOIN orc_jobs AS j ON j.id = l.job_id
         WHERE l.id = NEW.replay_of;
        RETURN NEW;
    END IF;
    INSERT INTO orc_side_effects (job_id, invocation_id, step, name, args, status, result,
                                  error, attempt, reconciled, created_at, updated_at)
    SELECT NEW.id, e.invocation_id, e.step, e.name, e.args, e.status, e.result, e.error,
           e.attempt, e.reconciled, e.created_at, e.updated_at
      FROM orc_dead_letters AS l JOIN orc_side_effects AS e ON e.job_id = l.job_id
     WHERE l.id = NEW.replay_of;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER orc_jobs_replay_ledger_root
    BEFORE INSERT ON orc_jobs
    FOR EACH ROW WHEN (NEW.replay_of IS NOT NULL)
    EXECUTE FUNCTION orc_replay_ledger_v1();

CREATE OR REPLACE TRIGGER orc_jobs_replay_ledger
    AFTER INSERT ON orc_jobs
    FOR EACH ROW WHEN (NEW.replay_of IS NOT NULL)
    EXECUTE FUNCTION orc_replay_ledger_v1();
