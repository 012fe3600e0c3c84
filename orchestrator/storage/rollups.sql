-- Rollups: history that outlives the jobs (migration 0026, services/rollup.py).

-- roll_up_minutes --
-- The closed minutes past the watermark (at most %(minutes)s, ending %(settle)s seconds before
-- now: a finish committed later than that after its own clock time is not seen), rolled up from
-- the jobs that finished in them (orc_jobs_finished_at), each group's row replaced by its value
-- recomputed from those jobs, and the watermark moved past them; its row is locked first, so
-- two runs take turns. The first run starts at the oldest finished job. Retries are counted
-- by layer from the job's job.retry_scheduled events (its primary key), a dead letter from
-- orc_dead_letters_job_id, its live output from its output head (0072: its primary key; none
-- for a job that streamed nothing). Returns the span rolled up and how many jobs finished in it.
-- Planned for the one row it reads (LIMIT 1: the table has one row, but the planner, without
-- statistics, guessed thousands and joined them to a sequential scan of orc_jobs), so the span
-- is found through orc_jobs_finished_at and each job's dead letter through its own lookup.
WITH mark AS (
    SELECT coalesce(w.rolled_up_to,
                    (SELECT date_trunc('minute', min(finished_at)) FROM orc_jobs),
                    date_trunc('minute', now())) AS since
      FROM orc_rollup_watermark AS w
     LIMIT 1
       FOR UPDATE
), span AS (
    SELECT m.since,
           greatest(m.since, least(m.since + make_interval(mins => %(minutes)s),
                                   date_trunc('minute',
                                              now() - make_interval(secs => %(settle)s))))
               AS until
      FROM mark AS m
), finished AS (
    SELECT date_trunc('minute', j.finished_at) AS at, j.job_type, j.queue,
           coalesce(j.tenant_id, '') AS tenant, j.status,
           round(1000 * extract(epoch FROM j.finished_at - j.started_at))::bigint AS ms,
           (SELECT true FROM orc_dead_letters AS d WHERE d.job_id = j.id) IS NOT NULL
               AS lettered,
           r.app, r.infra, u.calls, u.input, u.output, u.cache_read, u.cache_creation,
           coalesce(h.next_offset, 0) AS output_chunks, coalesce(h.bytes, 0) AS output_bytes
      FROM span AS s
      JOIN orc_jobs AS j ON j.finished_at >= s.since AND j.finished_at < s.until
      CROSS JOIN LATERAL (
          SELECT count(*) FILTER (WHERE e.payload ->> 'layer' = 'app') AS app,
                 count(*) FILTER (WHERE e.payload ->> 'layer' = 'infra') AS infra
            FROM orc_job_events AS e
           WHERE e.job_id = j.id AND e.kind = 'job.retry_scheduled') AS r
      CROSS JOIN LATERAL (  -- its LLM calls (0030; orc_llm_usage's (job_id, call_id) index)
          SELECT count(*) AS calls, coalesce(sum(l.input_tokens), 0) AS input,
                 coalesce(sum(l.output_tokens), 0) AS output,
                 coalesce(sum(l.cache_read_tokens), 0) AS cache_read,
                 coalesce(sum(l.cache_creation_tokens), 0) AS cache_creation
            FROM orc_llm_usage AS l WHERE l.job_id = j.id) AS u
      LEFT JOIN orc_job_output_heads AS h ON h.job_id = j.id
), bucketed AS (
    SELECT f.*, width_bucket(f.ms, %(bounds)s::bigint[]) AS b FROM finished AS f
), rolled AS (
    INSERT INTO orc_job_rollups AS r (
        period, at, job_type, queue, tenant, completed, failed, cancelled, dead_lettered,
        app_retries, infra_retries, timed, duration_ms_sum, duration_ms_max,
        lt_100ms, lt_500ms, lt_1s, lt_5s, lt_15s, lt_1min, lt_5min, lt_15min, lt_1h, ge_1h,
        llm_calls, input_tokens, output_tokens, cache_read_tokens, cache_creation_tokens,
        output_chunks, output_bytes)
    SELECT 60, at, job_type, queue, tenant,
           count(*) FILTER (WHERE status = 'COMPLETED'),
           count(*) FILTER (WHERE status = 'FAILED'),
           count(*) FILTER (WHERE status = 'CANCELLED'),
           count(*) FILTER (WHERE lettered),
           sum(app), sum(infra), count(ms), coalesce(sum(ms), 0), coalesce(max(ms), 0),
           count(*) FILTER (WHERE b = 0), count(*) FILTER (WHERE b = 1),
           count(*) FILTER (WHERE b = 2), count(*) FILTER (WHERE b = 3),
           count(*) FILTER (WHERE b = 4), count(*) FILTER (WHERE b = 5),
           count(*) FILTER (WHERE b = 6), count(*) FILTER (WHERE b = 7),
           count(*) FILTER (WHERE b = 8), count(*) FILTER (WHERE b = 9),
           sum(calls), sum(input), sum(output), sum(cache_read), sum(cache_creation),
           sum(output_chunks), sum(output_bytes)
      FROM bucketed
     GROUP BY at, job_type, queue, tenant
    ON CONFLICT (period, at, job_type, queue, tenant) DO UPDATE
       SET completed = excluded.completed, failed = excluded.failed,
           cancelled = excluded.cancelled, dead_lettered = excluded.dead_lettered,
           app_retries = excluded.app_retries, infra_retries = excluded.infra_retries,
           timed = excluded.timed, duration_ms_sum = excluded.duration_ms_sum,
           duration_ms_max = excluded.duration_ms_max, lt_100ms = excluded.lt_100ms,
           lt_500ms = excluded.lt_500ms, lt_1s = excluded.lt_1s, lt_5s = excluded.lt_5s,
           lt_15s = excluded.lt_15s, lt_1min = excluded.lt_1min, lt_5min = excluded.lt_5min,
           lt_15min = excluded.lt_15min, lt_1h = excluded.lt_1h, ge_1h = excluded.ge_1h,
           llm_calls = excluded.llm_calls, input_tokens = excluded.input_tokens,
           output_tokens = excluded.output_tokens,
           cache_read_tokens = excluded.cache_read_tokens,
           cache_creation_tokens = excluded.cache_creation_tokens,
           output_chunks = excluded.output_chunks, output_bytes = excluded.output_bytes
), moved AS (
    UPDATE orc_rollup_watermark SET rolled_up_to = s.until FROM span AS s
)
SELECT s.since, s.until, (SELECT count(*) FROM finished) AS jobs FROM span AS s

-- clear_hours --
-- The hour rows that %(since)s..%(until)s touched, which roll_up_hours then writes again (run
-- after roll_up_minutes, in its transaction).
DELETE FROM orc_job_rollups
 WHERE period = 3600
   AND at >= date_trunc('hour', %(since)s::timestamptz)
   AND at < date_trunc('hour', %(until)s::timestamptz - interval '1 microsecond')
            + interval '1 hour'

-- roll_up_hours --
-- The hours that %(since)s..%(until)s touched, summed again from their minutes (run after
-- clear_hours, in its transaction).
INSERT INTO orc_job_rollups AS r (
    period, at, job_type, queue, tenant, completed, failed, cancelled, dead_lettered,
    app_retries, infra_retries, timed, duration_ms_sum, duration_ms_max,
    lt_100ms, lt_500ms, lt_1s, lt_5s, lt_15s, lt_1min, lt_5min, lt_15min, lt_1h, ge_1h,
    llm_calls, input_tokens, output_tokens, cache_read_tokens, cache_creation_tokens,
    output_chunks, output_bytes)
SELECT 3600, date_trunc('hour', at), job_type, queue, tenant, sum(completed), sum(failed),
       sum(cancelled), sum(dead_lettered), sum(app_retries), sum(infra_retries), sum(timed),
       sum(duration_ms_sum), max(duration_ms_max), sum(lt_100ms), sum(lt_500ms), sum(lt_1s),
       sum(lt_5s), sum(lt_15s), sum(lt_1min), sum(lt_5min), sum(lt_15min), sum(lt_1h),
       sum(ge_1h), sum(llm_calls), sum(input_tokens), sum(output_tokens),
       sum(cache_read_tokens), sum(cache_creation_tokens), sum(output_chunks), sum(output_bytes)
  FROM orc_job_rollups
 WHERE period = 60
   AND at >= date_trunc('hour', %(since)s::timestamptz)
   AND at < date_trunc('hour', %(until)s::timestamptz - interval '1 microsecond')
            + interval '1 hour'
 GROUP BY 2, 3, 4, 5

-- sample_queue_depth --
-- This minute's sample of each queue's and tenant's jobs due and waiting, and running (the
-- partial indexes orc_jobs_pending_run_at, orc_jobs_retry_due, orc_jobs_running_heartbeat);
-- a second sample in the same minute replaces the first.
INSERT INTO orc_queue_depth AS q (at, queue, tenant, waiting, running)
SELECT date_trunc('minute', now()), queue, coalesce(tenant_id, ''),
       count(*) FILTER (WHERE status <> 'RUNNING'), count(*) FILTER (WHERE status = 'RUNNING')
  FROM orc_jobs
 WHERE (status = 'PENDING' AND run_at <= now())
    OR (status = 'RETRY' AND next_retry_at <= now())
    OR status = 'RUNNING'
 GROUP BY 2, 3
ON CONFLICT (at, queue, tenant) DO UPDATE SET waiting = excluded.waiting, running = excluded.running

-- prune_rollups --
-- At most %(limit)s rollups of %(period)s seconds older than %(days)s days.
DELETE FROM orc_job_rollups
 WHERE ctid = ANY (ARRAY(SELECT ctid FROM orc_job_rollups
                          WHERE period = %(period)s
                            AND at < now() - make_interval(secs => %(days)s * 86400)
                          LIMIT %(limit)s))

-- prune_queue_depth --
-- At most %(limit)s queue depth samples older than %(days)s days.
DELETE FROM orc_queue_depth
 WHERE ctid = ANY (ARRAY(SELECT ctid FROM orc_queue_depth
                          WHERE at < now() - make_interval(secs => %(days)s * 86400)
                          LIMIT %(limit)s))

-- rolled_up_to --
SELECT orc_rolled_up_to_v1() AS rolled_up_to

-- job_stats --
-- The rollups of %(period)s seconds in [since, until), summed per step of %(step)s seconds
-- and per the dimensions asked for (the others are summed over); tenants: only these
-- ('' is no tenant's, never a principal's).
SELECT %(since)s::timestamptz
           + floor(extract(epoch FROM at - %(since)s::timestamptz) / %(step)s)
             * make_interval(secs => %(step)s) AS at,
       CASE WHEN %(by_job_type)s THEN job_type END AS job_type,
       CASE WHEN %(by_queue)s THEN queue END AS queue,
       CASE WHEN %(by_tenant)s THEN tenant END AS tenant,
       sum(completed) AS completed, sum(failed) AS failed, sum(cancelled) AS cancelled,
       sum(dead_lettered) AS dead_lettered, sum(app_retries) AS app_retries,
       sum(infra_retries) AS infra_retries, sum(timed) AS timed,
       sum(duration_ms_sum) AS duration_ms_sum, max(duration_ms_max) AS duration_ms_max,
       ARRAY[sum(lt_100ms), sum(lt_500ms), sum(lt_1s), sum(lt_5s), sum(lt_15s), sum(lt_1min),
             sum(lt_5min), sum(lt_15min), sum(lt_1h), sum(ge_1h)] AS buckets,
       sum(llm_calls) AS llm_calls, sum(input_tokens) AS input_tokens,
       sum(output_tokens) AS output_tokens, sum(cache_read_tokens) AS cache_read_tokens,
       sum(cache_creation_tokens) AS cache_creation_tokens,
       sum(output_chunks) AS output_chunks, sum(output_bytes) AS output_bytes
  FROM orc_job_rollups
 WHERE period = %(period)s AND at >= %(since)s AND at < %(until)s
   AND (%(tenants)s::text[] IS NULL OR tenant = ANY (%(tenants)s))
 GROUP BY 1, 2, 3, 4
 ORDER BY 2, 3, 4, 1

-- queue_depth_stats --
-- The queue depth sampled at the start of each step in [since, until), per the dimensions asked
-- for (queue, tenant; the others summed over); tenants: only these.
SELECT at,
       CASE WHEN %(by_queue)s THEN queue END AS queue,
       CASE WHEN %(by_tenant)s THEN tenant END AS tenant,
       sum(waiting) AS waiting, sum(running) AS running
  FROM orc_queue_depth
 WHERE at = ANY (ARRAY(SELECT generate_series(%(since)s::timestamptz,
                                              %(until)s::timestamptz - interval '1 second',
                                              make_interval(secs => %(step)s))))
   AND (%(tenants)s::text[] IS NULL OR tenant = ANY (%(tenants)s))
 GROUP BY 1, 2, 3
 ORDER BY 2, 3, 1
