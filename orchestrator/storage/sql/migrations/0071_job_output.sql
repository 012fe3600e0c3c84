-- 0071_job_output: a job's live output (docs/output.md): the text deltas and progress records
-- its attempts write while they run (ctx.output; the built-in LLM types write every text delta),
-- in batches, each fenced by the attempt's lease, marked with its attempt and step, at offsets
-- counted per job; a `superseded` marker, written with a failed attempt's outcome, says which of
-- its output the next attempt makes again; a `cut` marker, that the job's stream reached its size
-- cap (functions/output.sql). Deleted with its job (retention), never updated.
--
-- The release before writes no output, and its outcomes meet the marker's trigger as any
-- writer does (a job that wrote nothing gets nothing).
--
-- compatible-with-older-workers: yes
-- revises: functions/output.sql c75243af3d7b4c46330f555beafece6032fd63318cad10f609059e336ffb96bc

-- One chunk of a job's output, at `chunk_offset` (0, 1, 2... per job, never reused): `kind`
-- text (`body` a JSON string, the deltas of one batch of one step), progress (`body` the
-- record), superseded (`body` {attempt, step}: that attempt's output from that step on is made
-- again by the next) or cut (`body` {max_bytes}: nothing more is kept). `attempt`: the attempt
-- that wrote it (a marker: the attempt it is about); `step`: the checkpointed step it was written
-- in (null: outside any step).
CREATE TABLE orc_job_output (
    job_id uuid NOT NULL REFERENCES orc_jobs (id) ON DELETE CASCADE,
    chunk_offset bigint NOT NULL CHECK (chunk_offset >= 0),
    attempt integer NOT NULL,
    step integer CHECK (step >= 1),
    kind text NOT NULL CHECK (kind IN ('text', 'progress', 'superseded', 'cut')),
    body jsonb NOT NULL,
    written_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, chunk_offset)
);

-- Where a job's output stands: the offset its next chunk gets, the bytes of its chunks' bodies
-- kept so far (its size cap's count), whether it was cut, and the last batch written (its
-- number, of which attempt: a batch written again after a lost acknowledgement is not written
-- twice). Its row lock orders the job's writes and markers.
CREATE TABLE orc_job_output_heads (
    job_id uuid PRIMARY KEY REFERENCES orc_jobs (id) ON DELETE CASCADE,
    next_offset bigint NOT NULL DEFAULT 0 CHECK (next_offset >= 0),
    bytes bigint NOT NULL DEFAULT 0 CHECK (bytes >= 0),
    cut boolean NOT NULL DEFAULT false,
    attempt integer NOT NULL DEFAULT 0,
    batch integer NOT NULL DEFAULT 0
);
