-- 0069_job_dependencies: jobs that depend on jobs (docs/workflows.md). A job submitted with
-- `depends_on` whose parents have not all finished is BLOCKED (a status of the state machine:
-- no dispatch, never claimed), counted in orc_job_waits; each parent's end settles its edges
-- (orc_job_dependencies) in the transaction that ends it, and the last gives the job its
-- dispatch (functions/dependencies.sql). A job some job depends on says so
-- (orc_jobs.has_dependants), so the end of a job nobody depends on costs no lookup; a submit's
-- spec may name its parents (orc_job_spec_v1.depends_on).
--
-- The release before never meets a BLOCKED job in its fetch (it has no dispatch), and its
-- submits send no depends_on.
--
-- compatible-with-older-workers: yes
-- revises: functions/dependencies.sql fe618af7f599e1401c1c5b0c2c5fbaf930540278d1154cdbae84af88555cbbf0
-- revises: functions/history.sql 280f4f0c43b92a01167ddaaed2d9a0051ae929138711b1ae086f7537041e71f9
-- revises: functions/submit.sql 83052c33309fee75a74c99e0eb0f7ac676f0c5daa0e8360d2feb78175a676c9b

ALTER TABLE orc_jobs ADD COLUMN has_dependants boolean NOT NULL DEFAULT false;

ALTER TYPE orc_job_spec_v1 ADD ATTRIBUTE depends_on jsonb;

-- An edge of a graph: job_id waits for parent_id. `ord`: its place in the job's depends_on;
-- `settled`: how the parent ended (COMPLETED, FAILED or CANCELLED), null while it has not.
CREATE TABLE orc_job_dependencies (
    job_id uuid NOT NULL REFERENCES orc_jobs (id) ON DELETE CASCADE,
    parent_id uuid NOT NULL REFERENCES orc_jobs (id) ON DELETE CASCADE,
    ord integer NOT NULL,
    on_failure text NOT NULL CHECK (on_failure IN ('cancel', 'run', 'wait')),
    settled text CHECK (settled IN ('COMPLETED', 'FAILED', 'CANCELLED')),
    PRIMARY KEY (job_id, parent_id),
    CHECK (job_id <> parent_id)
);
CREATE INDEX orc_job_dependencies_parent ON orc_job_dependencies (parent_id);

-- A job that waits for other jobs: how many it still waits for, and the task prefix of its
-- application's dispatches (the one it gets when the count reaches 0).
CREATE TABLE orc_job_waits (
    job_id uuid PRIMARY KEY REFERENCES orc_jobs (id) ON DELETE CASCADE,
    unsettled integer NOT NULL CHECK (unsettled >= 0),
    task_prefix text NOT NULL,
    since timestamptz NOT NULL DEFAULT now()
);
