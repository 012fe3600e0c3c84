-- The state machine's guard: every status change of a job must be a row of
-- orc_state_transitions (copied from orchestrator.domain.states by `orchestrator migrate`), and a
-- finished job's outcome is final.

-- A status change that is not a transition of the state machine is refused, and once a job is
-- finished (finished_at is stamped by this trigger, on entering a terminal state, and only
-- then), its outcome columns are fixed: status, result, last_error, finished_at, the attempt and
-- retry counters, and the lease (token, holder, heartbeat, next retry). Such a write is refused
-- with WF_STATE_TRANSITION_INVALID (SQLSTATE WF001), as an illegal transition is. finished_at
-- cannot be set by hand either. Deleting a finished job (retention) is not an update, and stays
-- possible.
CREATE OR REPLACE FUNCTION orc_guard_transition_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    target_terminal boolean;
BEGIN
    NEW.updated_at := now();
    IF OLD.finished_at IS NOT NULL THEN
        IF (NEW.status, NEW.result, NEW.last_error, NEW.finished_at, NEW.attempt,
            NEW.dispatch_attempt, NEW.retry_count, NEW.lease_token, NEW.locked_by,
            NEW.heartbeat_at, NEW.next_retry_at)
           IS DISTINCT FROM
           (OLD.status, OLD.result, OLD.last_error, OLD.finished_at, OLD.attempt,
            OLD.dispatch_attempt, OLD.retry_count, OLD.lease_token, OLD.locked_by,
            OLD.heartbeat_at, OLD.next_retry_at) THEN
            RAISE EXCEPTION 'WF_STATE_TRANSITION_INVALID: job % is finished (%): its outcome '
                            'cannot change', OLD.id, OLD.status
                USING ERRCODE = 'WF001';
        END IF;
        RETURN NEW;
    END IF;
    IF NEW.status IS DISTINCT FROM OLD.status THEN
        SELECT s.terminal INTO target_terminal
          FROM orc_state_transitions AS t JOIN orc_states AS s ON s.status = t.to_status
         WHERE t.from_status = OLD.status AND t.to_status = NEW.status;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'WF_STATE_TRANSITION_INVALID: job % cannot go from % to %',
                OLD.id, OLD.status, NEW.status
                USING ERRCODE = 'WF001';
        END IF;
        IF target_terminal THEN
            NEW.finished_at := now();
            RETURN NEW;
        END IF;
    END IF;
    IF NEW.finished_at IS NOT NULL THEN
        RAISE EXCEPTION 'WF_STATE_TRANSITION_INVALID: job % is %: only a terminal transition '
                        'sets finished_at', OLD.id, NEW.status
            USING ERRCODE = 'WF001';
    END IF;
    RETURN NEW;
END;
$$;

CREATE OR REPLACE TRIGGER orc_jobs_guard_transition
    BEFORE UPDATE ON orc_jobs
    FOR EACH ROW EXECUTE FUNCTION orc_guard_transition_v1();
