-- 0005_lean_job_writes: fewer index entries and lookups per status change.
--
-- A status change can never be a HOT update (status is in every partial index's predicate), so
-- each one writes a new entry into every index of orc_jobs whose predicate the new row meets.
-- A no-op job changes status twice (claim, completion); measured on PostgreSQL 18 before this
-- migration, its two orc_jobs updates wrote 7 index entries, and the history they leave
-- (COMPLETED rows) filled two full indexes that only `list_jobs` read.
--
-- * orc_jobs_status_id (status, id) covered every row. It becomes partial: RUNNING rows are
--   listed through orc_jobs_running_heartbeat (there are at most as many as workers run at
--   once), and COMPLETED ones, most of the table, by walking the primary key newest first.
--   The waiting statuses that lost_dispatches reads, and the rarer terminal ones, stay indexed.
-- * orc_jobs_job_type_id (job_type, id) stays, though only `list_jobs` reads it: without it,
--   listing a type rare in the recent history would scan the whole table (measured: 3 ms at
--   20,000 rows, growing with the history), for about 90 B of WAL per status change.
-- * The transition guard looks the transition and its target's terminal flag up in one query
--   rather than two.

DROP INDEX orc_jobs_status_id;
CREATE INDEX orc_jobs_unfinished_status_id ON orc_jobs (status, id)
    WHERE status NOT IN ('RUNNING', 'COMPLETED');

CREATE OR REPLACE FUNCTION orc_guard_transition_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    target_terminal boolean;
BEGIN
    NEW.updated_at := now();
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
        END IF;
    END IF;
    RETURN NEW;
END;
$$;
