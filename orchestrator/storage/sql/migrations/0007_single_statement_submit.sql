-- 0007_single_statement_submit: jobs without a key are submitted by one SQL statement.
--
-- orc_submit_jobs_v1 runs seven statements inside its function even for a batch without keys
-- (the spec array, Procrastinate's defer, the inserts, the result rows, the keyed loop, the
-- dispatch and the wake-up checks), and each pays its own executor start-up. Submitting is on the
-- path from submit to start, so here the keyless case is one statement. Measured on one job at a
-- time (server round trip, prepared): PostgreSQL 18, 1.20 -> 0.96 ms; PostgreSQL 15, 2.5 -> 1.3 ms.
--
-- The dispatches are inserted as procrastinate_defer_jobs_v1 inserts them (the same columns; the
-- table's triggers notify the workers and record the events), in the same statement as the jobs
-- that point at them, matched by their lock (the job id). A batch with any job key goes through
-- orc_submit_jobs_v1, whose key handling is unchanged.
CREATE FUNCTION orc_submit_jobs_v2(
    p_specs jsonb, p_initial_status text, p_waiting text[], p_task_prefix text
) RETURNS TABLE (ord integer, job_id uuid, outcome text)
LANGUAGE plpgsql AS $$
BEGIN
    IF jsonb_path_exists(p_specs, '$[*] ? (@.job_key != null)') THEN
        RETURN QUERY SELECT * FROM orc_submit_jobs_v1(p_specs, p_initial_status, p_waiting,
                                                      p_task_prefix);
        RETURN;
    END IF;

    RETURN QUERY
    WITH spec AS (
        SELECT s.* FROM jsonb_populate_recordset(NULL::orc_job_spec_v1, p_specs) AS s
    ), dispatch AS (
        INSERT INTO procrastinate_jobs (queue_name, task_name, priority, lock, args, scheduled_at)
        SELECT s.queue, p_task_prefix || s.job_type, -s.priority, s.id::text,
               jsonb_build_object('job_id', s.id), CASE WHEN s.run_at > now() THEN s.run_at END
          FROM spec AS s
         ORDER BY s.ord
        RETURNING procrastinate_jobs.id, procrastinate_jobs.lock
    ), job AS (
        INSERT INTO orc_jobs (id, job_type, status, payload, queue, priority, run_at,
                              max_attempts, max_retries, agent_id, trace_id, timeout_seconds,
                              replay_of, procrastinate_job_id)
        SELECT s.id, s.job_type, p_initial_status, coalesce(s.payload, 'null'), s.queue,
               s.priority, coalesce(s.run_at, now()), s.max_attempts, s.max_retries, s.agent_id,
               s.trace_id, s.timeout_seconds, s.replay_of, d.id
          FROM spec AS s JOIN dispatch AS d ON d.lock = s.id::text
        RETURNING *
    ), created AS (
        INSERT INTO orc_job_events (job_id, kind, payload)
        SELECT j.id, 'job.created', orc_created_event_v1(j) FROM job AS j
    )
    SELECT s.ord, s.id, 'created'::text FROM spec AS s;

    -- Workers waiting for a future time are told, as orc_submit_jobs_v1 tells them.
    IF jsonb_path_exists(p_specs, '$[*] ? (@.run_at != null)') THEN
        PERFORM pg_notify('orc_wakeup', extract(epoch FROM min(s.run_at))::text)
           FROM jsonb_populate_recordset(NULL::orc_job_spec_v1, p_specs) AS s
          WHERE s.run_at > now()
         HAVING count(*) > 0;
    END IF;
END;
$$;
