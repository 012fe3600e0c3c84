-- prune_finished_jobs --
-- One batch of the retention of finished jobs (orchestrator.services.retention): at most
-- %(limit)s jobs past their retention, deleted in this one statement with their dispatches
-- (their Procrastinate events go by cascade) and, by cascade, their events, checkpoints, ledger
-- rows, approvals, reviewed dead letters, LLM usage and token budget (0030), and live output
-- (0071: its chunks and head). `candidates` is the whole rule of which jobs may go (kept in this
-- one place):
-- * finished longer ago than the retention of its (type, status): `retention` pairs every job
--   type present (a loose scan of orc_jobs_job_type_id, one probe per type) with each terminal
--   status, and each pair is one range of orc_jobs_finished_by_type (0025);
-- * finished before the rollups' watermark (orc_rolled_up_to_v1, 0026): counted in the
--   history that outlives it (none before the first rollup, whose watermark is null);
-- * not a FAILED job whose dead letter awaits review (recorded, discard_requested), nor one whose
--   dead letter was requeued to a job that has not finished (its replay_of points here);
-- * not a job that an unfinished job depends on (its result is what that job will read), nor
--   one whose spawned children have not all ended (docs/workflows.md);
-- * no dispatch still todo, or doing on a registered worker (one finishing it, in
--   orc_procrastinate_jobs_live_lock); a dispatch a dead worker left doing (Procrastinate pruned
--   the worker, which unset its worker_id: a job cancelled while it ran there) goes with the job;
-- * not locked by anyone else (SKIP LOCKED: two prunes never share a job).
-- Returns one row per job taken: its type and status, how many rows of each kind went with it,
-- and, with %(archive)s, the whole of it as JSON (read from the statement's snapshot: what the
-- deletes remove). With %(dry_run)s nothing is deleted: the rows are what one batch would take.
-- A batch that takes fewer than %(limit)s jobs has caught up (`progress`, 0037): every job due
-- before the earlier of now() and the watermark plus the shortest retention (%(shortest)s
-- seconds: a job finished after the watermark is due no sooner) is gone, unless kept by the
-- rule above or locked elsewhere; that point goes into orc_retention_progress, whose lag the
-- fleet exporter exports (left where it was before the first rollup: nothing is counted yet).
WITH RECURSIVE job_types AS (
    SELECT min(job_type) AS job_type FROM orc_jobs
    UNION ALL
    SELECT (SELECT min(j.job_type) FROM orc_jobs AS j WHERE j.job_type > t.job_type)
      FROM job_types AS t
     WHERE t.job_type IS NOT NULL
), retention AS (
    SELECT t.job_type, d.status, coalesce(o.seconds, d.seconds) AS seconds
      FROM job_types AS t
     CROSS JOIN unnest(%(statuses)s::text[], %(seconds)s::float8[]) AS d (status, seconds)
      LEFT JOIN unnest(%(override_types)s::text[], %(override_statuses)s::text[],
                       %(override_seconds)s::float8[]) AS o (job_type, status, seconds)
        ON o.job_type = t.job_type AND o.status = d.status
     WHERE t.job_type IS NOT NULL
), candidates AS (
    SELECT c.id, c.job_type, c.status
      FROM retention AS r
     CROSS JOIN LATERAL (
        SELECT j.id, j.job_type, j.status FROM orc_jobs AS j
         WHERE j.job_type = r.job_type AND j.status = r.status
           AND j.finished_at < now() - make_interval(secs => r.seconds)
           AND j.finished_at < (SELECT orc_rolled_up_to_v1())
           AND NOT EXISTS (
                   SELECT FROM orc_dead_letters AS l
                    WHERE l.job_id = j.id
                      AND (l.state IN ('recorded', 'discard_requested')
                           OR EXISTS (SELECT FROM orc_jobs AS replay
                                       WHERE replay.id = l.requeued_job_id
                                         AND replay.finished_at IS NULL)))
           AND NOT (j.has_dependants AND (
                   EXISTS (SELECT FROM orc_job_dependencies AS d
                             JOIN orc_jobs AS dependant ON dependant.id = d.job_id
                            WHERE d.awaited_id = j.id AND dependant.finished_at IS NULL)
                   OR EXISTS (SELECT FROM orc_job_children AS k
                                JOIN orc_jobs AS child ON child.id = k.child_id
                               WHERE k.parent_id = j.id AND child.finished_at IS NULL)))
           AND NOT EXISTS (
                   SELECT FROM procrastinate_jobs AS p
                    WHERE p.lock = j.id::text AND p.status IN ('todo', 'doing')
                      AND (p.status = 'todo' OR p.worker_id IS NOT NULL))
         LIMIT %(limit)s
           FOR UPDATE OF j SKIP LOCKED
     ) AS c
     LIMIT %(limit)s
), dispatches AS (
    SELECT p.id, p.lock
      FROM procrastinate_jobs AS p  -- orc_procrastinate_jobs_finished_lock: a lookup per job
     WHERE p.lock = ANY (ARRAY(SELECT c.id::text FROM candidates AS c))
       AND p.status NOT IN ('todo', 'doing')
    UNION ALL
    SELECT p.id, p.lock
      FROM procrastinate_jobs AS p  -- orc_procrastinate_jobs_live_lock: a dead worker's
     WHERE p.lock = ANY (ARRAY(SELECT c.id::text FROM candidates AS c))
       AND p.status = 'doing' AND p.worker_id IS NULL
), dispatch_rows AS (
    SELECT x.lock, count(*) AS n, sum(pe.n)::bigint AS events,
           CASE WHEN %(archive)s THEN jsonb_agg(
               to_jsonb(p) || jsonb_build_object('events', pe.archived) ORDER BY p.id) END
               AS archived
      FROM dispatches AS x
      JOIN procrastinate_jobs AS p ON p.id = x.id
     CROSS JOIN LATERAL (
        SELECT count(*) AS n, coalesce(jsonb_agg(to_jsonb(e) ORDER BY e.id), '[]') AS archived
          FROM procrastinate_events AS e WHERE e.job_id = x.id
     ) AS pe
     GROUP BY x.lock
), deleted_dispatches AS (  -- by key: a join's generic plan, not knowing the batch is small,
    DELETE FROM procrastinate_jobs AS p  -- hashed the whole table
     WHERE p.id = ANY (ARRAY(SELECT x.id FROM dispatches AS x)) AND NOT %(dry_run)s
), deleted_jobs AS (
    DELETE FROM orc_jobs AS j
     WHERE j.id = ANY (ARRAY(SELECT c.id FROM candidates AS c)) AND NOT %(dry_run)s
), progress AS (
    UPDATE orc_retention_progress
       SET caught_up_to = least(now(), w.rolled_up_to + make_interval(secs => %(shortest)s))
      FROM (SELECT orc_rolled_up_to_v1() AS rolled_up_to) AS w
     WHERE w.rolled_up_to IS NOT NULL AND NOT %(dry_run)s
       AND (SELECT count(*) FROM candidates) < %(limit)s
)
SELECT c.id, c.job_type, c.status,
       (SELECT count(*) FROM orc_job_events AS e WHERE e.job_id = c.id) AS events,
       (SELECT count(*) FROM orc_checkpoints AS k WHERE k.job_id = c.id) AS checkpoints,
       (SELECT count(*) FROM orc_side_effects AS s WHERE s.job_id = c.id) AS side_effects,
       (SELECT count(*) FROM orc_approvals AS a WHERE a.job_id = c.id) AS approvals,
       (SELECT count(*) FROM orc_dead_letters AS l WHERE l.job_id = c.id) AS dead_letters,
       coalesce(r.n, 0) AS dispatches, coalesce(r.events, 0) AS dispatch_events,
       (SELECT count(*) FROM orc_llm_usage AS u WHERE u.job_id = c.id) AS llm_usage,
       (SELECT count(*) FROM orc_job_output AS o WHERE o.job_id = c.id) AS output_chunks,
       CASE WHEN %(archive)s THEN jsonb_build_object(
           'job', (SELECT to_jsonb(j) FROM orc_jobs AS j WHERE j.id = c.id),
           'events', coalesce((SELECT jsonb_agg(to_jsonb(e) ORDER BY e.id)
                                 FROM orc_job_events AS e WHERE e.job_id = c.id), '[]'),
           'checkpoints', coalesce((SELECT jsonb_agg(to_jsonb(k) ORDER BY k.step)
                                      FROM orc_checkpoints AS k WHERE k.job_id = c.id), '[]'),
           'side_effects', coalesce((SELECT jsonb_agg(to_jsonb(s) ORDER BY s.invocation_id)
                                       FROM orc_side_effects AS s WHERE s.job_id = c.id), '[]'),
           'approvals', coalesce((SELECT jsonb_agg(to_jsonb(a) ORDER BY a.id)
                                    FROM orc_approvals AS a WHERE a.job_id = c.id), '[]'),
           'dead_letters', coalesce((SELECT jsonb_agg(to_jsonb(l) ORDER BY l.id)
                                       FROM orc_dead_letters AS l WHERE l.job_id = c.id), '[]'),
           'dispatches', coalesce(r.archived, '[]'),
           'llm_usage', coalesce((SELECT jsonb_agg(to_jsonb(u) ORDER BY u.id)
                                    FROM orc_llm_usage AS u WHERE u.job_id = c.id), '[]'),
           'output', coalesce((SELECT jsonb_agg(to_jsonb(o) ORDER BY o.chunk_offset)
                                 FROM orc_job_output AS o WHERE o.job_id = c.id), '[]'))
       END AS archived
  FROM candidates AS c
  LEFT JOIN dispatch_rows AS r ON r.lock = c.id::text

-- prune_maintenance_dispatches --
-- The finished dispatches of the maintenance services' periodic ticks (no lock: no job is
-- theirs) whose tick is older than %(older_than)s seconds; Procrastinate unlinks the periodic
-- defer that names one. How many went (or, with %(dry_run)s, would go). The queue is
-- written out (orchestrator.services.maintenance.QUEUE): as a parameter, a generic plan
-- estimated it by the average queue and read the whole table.
WITH doomed AS (
    SELECT p.id FROM procrastinate_jobs AS p  -- procrastinate_jobs_queue_name_idx_v1
     WHERE p.queue_name = 'maintenance' AND p.lock IS NULL
       AND p.status NOT IN ('todo', 'doing')
       AND CASE WHEN jsonb_typeof(p.args -> 'timestamp') = 'number'
                THEN (p.args ->> 'timestamp')::float8 END
           < extract(epoch FROM now()) - %(older_than)s
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), deleted AS (
    DELETE FROM procrastinate_jobs AS p
     WHERE p.id = ANY (ARRAY(SELECT d.id FROM doomed AS d)) AND NOT %(dry_run)s
)
SELECT count(*) AS maintenance_dispatches FROM doomed

-- prune_expired --
-- Rows past their own end, at most %(limit)s of each kind: dashboard sessions past their expiry
-- (orc_ui_sessions_expires_at), and API servers' claims to wait for events that lapsed (a
-- server that died without its stop). How many of each went (or, with %(dry_run)s, would go).
WITH sessions AS (
    SELECT id_sha256 FROM orc_ui_sessions WHERE expires_at < now() LIMIT %(limit)s
), listeners AS (
    SELECT listener FROM orc_event_listeners WHERE until < now() LIMIT %(limit)s
), sessions_gone AS (
    DELETE FROM orc_ui_sessions WHERE id_sha256 IN (SELECT * FROM sessions) AND NOT %(dry_run)s
), listeners_gone AS (
    DELETE FROM orc_event_listeners
     WHERE listener IN (SELECT * FROM listeners) AND NOT %(dry_run)s
)
SELECT (SELECT count(*) FROM sessions) AS sessions,
       (SELECT count(*) FROM listeners) AS event_listeners

-- prune_revoked_tokens --
-- API tokens revoked more than %(older_than)s seconds ago (the longest job retention: no kept
-- job's history can name one of them any more). Their sessions go by cascade.
WITH doomed AS (
    SELECT id FROM orc_api_tokens
     WHERE revoked_at < now() - make_interval(secs => %(older_than)s)
     LIMIT %(limit)s
), deleted AS (
    DELETE FROM orc_api_tokens AS t USING doomed AS d WHERE t.id = d.id AND NOT %(dry_run)s
)
SELECT count(*) AS revoked_tokens FROM doomed
