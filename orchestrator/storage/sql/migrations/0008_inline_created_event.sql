-- 0008_inline_created_event: the job.created payload is computed inside the submit statement.
--
-- orc_created_event_v1 was declared IMMUTABLE, but its body is only STABLE: a timestamptz
-- (run_at) turns into JSON text in the session's time zone. PostgreSQL does not inline a SQL
-- function whose body is more volatile than its declaration, so each submitted job paid a
-- function call; and before PostgreSQL 18 a SQL function that is not inlined is planned again
-- on every call. Measured by `./dev bench latency --breakdown` (server time per job): 125 us
-- on PostgreSQL 15, 18 us on PostgreSQL 18, on the path from submit to start. Declared STABLE,
-- it is inlined into the statements that call it and costs no call at all; its result is the
-- same.
CREATE OR REPLACE FUNCTION orc_created_event_v1(j orc_jobs) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_build_object('job_type', j.job_type, 'queue', j.queue, 'run_at', j.run_at,
                              'max_attempts', j.max_attempts, 'max_retries', j.max_retries,
                              'job_key', j.job_key, 'trace_id', j.trace_id)
$$;
