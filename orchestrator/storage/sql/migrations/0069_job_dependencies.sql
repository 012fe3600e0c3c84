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
-- revises: functions/dependencies.sql 3d0db6fe2e8d7f51471da3c803969b7e2bd34f25bb3cc67b3e58265215bb513d
-- revises: functions/dispatches.sql c3991a297a0c8f544ea08f58cd8e430cb261d45e2cab044194325b91d7597dd9
-- revises: functions/history.sql b7da1880530169041d9287435be533789cc38be770bffcb558d6ffbe28c8661d
-- revises: functions/submit.sql 83052c33309fee75a74c99e0eb0f7ac676f0c5daa0e8360d2feb78175a676c9b

ALTER TABLE orc_jobs ADD COLUMN has_dependants boolean NOT NULL DEFAULT false;

ALTER TYPE orc_job_spec_v1 ADD ATTRIBUTE depends_on jsonb;

-- An edge of a graph: job_id waits for awaited_id, its parent (`kind` parent: named in its
-- depends_on) or a child it spawned and waits for (`kind` child: ctx's wait_for). `ord`: its
-- place among the job's; `settled`: how the awaited job ended (COMPLETED, FAILED or CANCELLED),
-- null while it has not.
CREATE TABLE orc_job_dependencies (
    job_id uuid NOT NULL REFERENCES orc_jobs (id) ON DELETE CASCADE,
    awaited_id uuid NOT NULL REFERENCES orc_jobs (id) ON DELETE CASCADE,
    kind text NOT NULL DEFAULT 'parent' CHECK (kind IN ('parent', 'child')),
    ord integer NOT NULL,
    on_failure text NOT NULL CHECK (on_failure IN ('cancel', 'run', 'wait')),
    settled text CHECK (settled IN ('COMPLETED', 'FAILED', 'CANCELLED')),
    PRIMARY KEY (job_id, awaited_id),
    CHECK (job_id <> awaited_id)
);
CREATE INDEX orc_job_dependencies_awaited ON orc_job_dependencies (awaited_id);

-- A job that waits for other jobs (BLOCKED): how many it still waits for, and the task prefix of its
-- application's dispatches (the one it gets when the count reaches 0).
CREATE TABLE orc_job_waits (
    job_id uuid PRIMARY KEY REFERENCES orc_jobs (id) ON DELETE CASCADE,
    unsettled integer NOT NULL CHECK (unsettled >= 0),
    task_prefix text NOT NULL,
    since timestamptz NOT NULL DEFAULT now()
);

-- The children a running job spawned (a step's spawn: `step`, `key`, each child's place `n`),
-- written with them in one transaction: a step run again finds them, and spawns none anew.
-- `cancel_with_parent`: cancelled when the parent is.
CREATE TABLE orc_job_children (
    parent_id uuid NOT NULL REFERENCES orc_jobs (id) ON DELETE CASCADE,
    step integer NOT NULL,
    key text NOT NULL,
    n integer NOT NULL,
    child_id uuid NOT NULL UNIQUE REFERENCES orc_jobs (id) ON DELETE CASCADE,
    cancel_with_parent boolean NOT NULL,
    PRIMARY KEY (parent_id, step, key, n)
);
