-- 0034_fetch_without_a_limit: a job whose type runs under no limit pays (nearly) nothing for
-- flow control at its claim.
--
-- compatible-with-older-workers: yes
--
-- orc_fetch_dispatch_v3 (migration 0029) called the flow gate for every job it fetched: the
-- gate read the job's row again and, finding no key, tried an UPDATE that gives the job the
-- key of its type's limit (for a job submitted without it), and the claim read the row a third
-- time, through a join, for its key. The fetch now reads the row once, as it locks it, and
-- calls the gate only for a job that has a key or whose type has a limit
-- (orc_flow_job_types, a primary-key lookup in a table of one row per limited type); the
-- claim names the key only then. What the gate decides is unchanged.
--
-- Compatible with older workers: the function is replaced with the same signature and the
-- same results.

CREATE OR REPLACE FUNCTION orc_fetch_dispatch_v3(
    p_queues character varying[], p_excluded character varying[], p_worker_id bigint,
    p_task_prefix text, p_worker text, p_claimable text[], p_running text
) RETURNS SETOF procrastinate_jobs
LANGUAGE plpgsql ROWS 1 AS $$
DECLARE
    fetched procrastinate_jobs;
    job uuid;
    j orc_jobs;
    gated boolean;
    claim jsonb;
BEGIN
    FOR parked IN 0 .. 100 LOOP
        fetched := orc_take_dispatch_v1(p_queues, p_excluded, p_worker_id);
        IF fetched.id IS NULL OR NOT starts_with(fetched.task_name, p_task_prefix) THEN
            RETURN NEXT fetched;
            RETURN;
        END IF;
        job := (fetched.args ->> 'job_id')::uuid;
        SELECT * INTO j FROM orc_jobs AS o WHERE o.id = job FOR NO KEY UPDATE SKIP LOCKED;
        IF NOT FOUND AND EXISTS (SELECT FROM orc_jobs AS o WHERE o.id = job) THEN
            fetched.args := fetched.args || '{"claim": null, "claim_later": true}';
            RETURN NEXT fetched;
            RETURN;
        END IF;
        gated := j.flow_key IS NOT NULL
                 OR EXISTS (SELECT FROM orc_flow_job_types AS t WHERE t.job_type = j.job_type);
        IF NOT gated OR NOT orc_flow_gate_v1(job, fetched.id, p_claimable, p_task_prefix) THEN
            SELECT to_jsonb(c) INTO claim
              FROM orc_claim_v1(job, fetched.id, fetched.attempts + 1,
                                p_worker || '/w' || p_worker_id, p_claimable, p_running) AS c;
            IF gated THEN  -- the gate may have given the job its key
                claim := claim || jsonb_build_object(
                    'flow_key', (SELECT o.flow_key FROM orc_jobs AS o WHERE o.id = job));
            END IF;
            fetched.args := fetched.args || jsonb_build_object('claim', claim);
            RETURN NEXT fetched;
            RETURN;
        END IF;
    END LOOP;
    fetched.args := fetched.args || '{"claim": null}';  -- parked, and gone: the worker ends it
    RETURN NEXT fetched;
END;
$$;
