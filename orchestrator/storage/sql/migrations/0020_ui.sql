-- 0020_ui: what the dashboard (`orchestrator serve` at /ui, docs/ui.md) keeps in the database.
--
-- * orc_ui_sessions: one row per signed-in browser. The cookie holds a random session id;
--   only its SHA-256 is stored, with the API token the person signed in with (the session dies
--   with the token: revoked, or deleted) and the session's CSRF token, which every form and
--   action of the session must carry.
-- * orc_dead_letters_job_id: a job's dead letter, on the job's page.
-- * orc_jobs_finished_at: jobs finished in the last minutes (the overview's throughput and
--   failure share). A BRIN index: a job's finishing writes a new row version at the end of the
--   table, so finish times follow the table's order closely, and the index costs a finishing
--   job next to nothing (a B-tree would add an entry to every completion).

CREATE TABLE orc_ui_sessions (
    id_sha256 bytea PRIMARY KEY CHECK (length(id_sha256) = 32),
    token_id uuid NOT NULL REFERENCES orc_api_tokens (id) ON DELETE CASCADE,
    csrf text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL
);

CREATE INDEX orc_ui_sessions_expires_at ON orc_ui_sessions (expires_at);

CREATE INDEX orc_jobs_finished_at ON orc_jobs USING brin (finished_at);

-- A job's dead letter, on its page (a job has at most a few: one per terminal failure).
CREATE INDEX orc_dead_letters_job_id ON orc_dead_letters (job_id);
