-- 0073_output_in_rollups: orc_job_rollups counts the live output (0071) of the jobs each row
-- counts, beside their LLM calls (0030): `output_chunks`, its chunks (markers included: every
-- offset the job used), and `output_bytes`, the bytes of its chunks' bodies (the size cap's
-- count), read from the job's output head by job id when the job's minute is rolled up (the
-- query roll_up_minutes, orchestrator/storage/rollups.sql). So what the jobs streamed, by job
-- type, queue and tenant, outlives the output that retention deletes with them (it deletes only
-- jobs the rollups have counted). bigint: a job keeps at most output_max_bytes, and what a
-- group's minute or hour sums is bounded by what the database held. Added with a constant
-- default: no rewrite of the table; rows rolled up before this migration count no output.
--
-- The release before rolls up minutes with its own statement, which leaves these columns at
-- their default (a minute it rolls up counts no output), and reads none of them.
--
-- compatible-with-older-workers: yes

ALTER TABLE orc_job_rollups
    ADD COLUMN output_chunks bigint NOT NULL DEFAULT 0,
    ADD COLUMN output_bytes bigint NOT NULL DEFAULT 0;
