-- 0041_job_numbers_and_types: what a producer writing in SQL needs to know of the orchestrator
-- (docs/graphile.md): each job's number, a stable bigint id (Graphile Worker's job ids are
-- bigints: its WorkerUtils complete, fail and reschedule jobs by them), and the job types with
-- their defaults, as the last `orchestrator migrate` knew them (a submit in SQL refuses a type
-- not listed, as `submit` refuses an unknown one, and takes its budgets from here).
-- Compatible: the release before neither reads nor writes either; its inserts get a number
-- from the column's default.
--
-- compatible-with-older-workers: yes

CREATE SEQUENCE orc_jobs_number_seq AS bigint;
-- Added without a value, then given its default: no rewrite of the table. The jobs that have
-- not finished get theirs now; a finished one is no producer's to complete, fail or reschedule.
ALTER TABLE orc_jobs ADD COLUMN number bigint;
ALTER TABLE orc_jobs ALTER COLUMN number SET DEFAULT nextval('orc_jobs_number_seq');
ALTER SEQUENCE orc_jobs_number_seq OWNED BY orc_jobs.number;
UPDATE orc_jobs SET number = nextval('orc_jobs_number_seq') WHERE finished_at IS NULL;
CREATE UNIQUE INDEX orc_jobs_number ON orc_jobs (number);

CREATE TABLE orc_job_types (
    job_type text PRIMARY KEY,
    queue text NOT NULL,
    max_attempts integer NOT NULL CHECK (max_attempts >= 1),
    max_retries integer NOT NULL CHECK (max_retries >= 0),
    timeout_seconds integer CHECK (timeout_seconds > 0),
    external boolean NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
