-- 0041_job_numbers_and_types: what a producer writing in SQL needs to know of the orchestrator
-- (docs/graphile.md): a job's number, a stable bigint id for the jobs Graphile Worker's API adds
-- (its WorkerUtils complete, fail and reschedule jobs by such ids), and the job types with
-- their defaults, as the last `orchestrator migrate` knew them (a submit in SQL refuses a type
-- not listed, as `submit` refuses an unknown one, and takes its budgets from here).
-- Other jobs have no number: the column has no default, and its index holds only numbered
-- rows, so a job's inserts and updates cost what they did (every update of a job writes each
-- index its row is in). Compatible: the release before neither reads nor writes either.
--
-- compatible-with-older-workers: yes

CREATE SEQUENCE orc_jobs_number_seq AS bigint;
ALTER TABLE orc_jobs ADD COLUMN number bigint;
ALTER SEQUENCE orc_jobs_number_seq OWNED BY orc_jobs.number;
CREATE UNIQUE INDEX orc_jobs_number ON orc_jobs (number) WHERE number IS NOT NULL;

CREATE TABLE orc_job_types (
    job_type text PRIMARY KEY,
    queue text NOT NULL,
    max_attempts integer NOT NULL CHECK (max_attempts >= 1),
    max_retries integer NOT NULL CHECK (max_retries >= 0),
    timeout_seconds integer CHECK (timeout_seconds > 0),
    external boolean NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
