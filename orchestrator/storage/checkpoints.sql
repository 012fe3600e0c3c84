-- Checkpoints and the side-effect ledger: the statements of checkpoints/store.py
-- (CheckpointStore; its package is a layer above storage, whose loader reads them here).
-- Writes made by an attempt lock its job row FOR SHARE while checking the lease: a concurrent
-- change of lease (a sweep) either waits for them or makes them match nothing.

-- record_attempt_event --
-- An event an attempt writes about its own work (job.model_fallback), fenced by its lease: a
-- superseded attempt writes nothing (no row returned).
INSERT INTO orc_job_events (job_id, kind, payload)
SELECT j.id, %(kind)s, %(payload)s
  FROM orc_jobs AS j
 WHERE j.id = %(job_id)s AND j.lease_token = %(lease_token)s AND j.status = %(running)s
RETURNING job_id

-- last_checkpoint --
-- Where a stepped job resumes: its last committed step, that step's state, and whether it was
-- the final step.
SELECT step, state, final FROM orc_checkpoints
 WHERE job_id = %(job_id)s
 ORDER BY step DESC
 LIMIT 1

-- begin_effect --
-- Before a side-effecting call: its invocation id (`<root>.<step>.<key>`, the root being the job,
-- or for a replay the first job of its chain: orc_replay_ledger_v1), what the ledger knows of
-- it, and (if nothing) record it pending.
WITH leased AS (
    SELECT id, concat_ws('.', coalesce(effects_root, id), %(step)s::int, %(key)s::text)
               AS invocation_id
      FROM orc_jobs
     WHERE id = %(job_id)s AND lease_token = %(lease_token)s AND status = %(running)s
       FOR SHARE
), existing AS (
    SELECT e.status, e.result FROM orc_side_effects AS e JOIN leased AS l USING (invocation_id)
     WHERE e.job_id = %(job_id)s
), recorded AS (
    INSERT INTO orc_side_effects (job_id, invocation_id, step, name, args, status, attempt)
    SELECT id, invocation_id, %(step)s, %(name)s, %(args)s, 'pending', %(attempt)s
      FROM leased
     WHERE NOT EXISTS (SELECT 1 FROM existing)
)
SELECT (SELECT invocation_id FROM leased) AS invocation_id,
       (SELECT status FROM existing) AS status,
       (SELECT result FROM existing) AS result

-- retry_effect --
-- An earlier attempt's call failed, or is pending and will be made again: pending, for this one.
UPDATE orc_side_effects
   SET status = 'pending', error = NULL, attempt = %(attempt)s
 WHERE job_id = %(job_id)s AND invocation_id = %(invocation_id)s
   AND status IN ('pending', 'failed')
   AND EXISTS (SELECT 1 FROM orc_jobs
                WHERE id = %(job_id)s AND lease_token = %(lease_token)s AND status = %(running)s
                  FOR SHARE)
RETURNING invocation_id

-- fail_effect --
-- The call raised: the ledger keeps its classified error (the attempt's outcome follows).
UPDATE orc_side_effects
   SET status = 'failed', error = %(error)s
 WHERE job_id = %(job_id)s AND invocation_id = %(invocation_id)s AND status = 'pending'
   AND EXISTS (SELECT 1 FROM orc_jobs
                WHERE id = %(job_id)s AND lease_token = %(lease_token)s AND status = %(running)s
                  FOR SHARE)
RETURNING invocation_id

-- commit_effects --
-- Results of side effects ([{invocation_id, result, reconciled}]) become committed, outside a
-- checkpoint: a plain task's effects, reconciled ones, and those an ending attempt still holds.
-- Written again with the same results, it changes nothing and still matches every row, so a write
-- whose acknowledgement was lost can be made again.
UPDATE orc_side_effects AS e
   SET status = 'committed', result = coalesce(c.result, 'null'), reconciled = c.reconciled,
       error = NULL, attempt = %(attempt)s
  FROM jsonb_to_recordset(%(effects)s) AS c (invocation_id text, result jsonb, reconciled boolean)
 WHERE e.job_id = %(job_id)s AND e.invocation_id = c.invocation_id
   AND EXISTS (SELECT 1 FROM orc_jobs
                WHERE id = %(job_id)s AND lease_token = %(lease_token)s AND status = %(running)s
                  FOR SHARE)
RETURNING e.invocation_id

-- write_checkpoint --
-- A step's commit point, in one round trip: its checkpoint, its side effects' results, and a
-- job.checkpointed event. A stale attempt (superseded lease) writes none of them.
WITH leased AS (
    SELECT id, attempt FROM orc_jobs
     WHERE id = %(job_id)s AND lease_token = %(lease_token)s AND status = %(running)s
       FOR SHARE
), saved AS (
    INSERT INTO orc_checkpoints (job_id, step, state, final, attempt)
    SELECT id, %(step)s, %(state)s, %(final)s, attempt FROM leased
    RETURNING job_id, step
), committed AS (
    UPDATE orc_side_effects AS e
       SET status = 'committed', result = coalesce(c.result, 'null'),
           reconciled = c.reconciled, error = NULL, attempt = %(attempt)s
      FROM saved,
           jsonb_to_recordset(%(effects)s) AS c (invocation_id text, result jsonb,
                                                 reconciled boolean)
     WHERE e.job_id = saved.job_id AND e.invocation_id = c.invocation_id
       AND e.status <> 'committed'
    RETURNING e.invocation_id
), event AS (
    INSERT INTO orc_job_events (job_id, kind, payload)
    SELECT job_id, 'job.checkpointed',
           orc_checkpointed_event_v1(step, %(final)s, (SELECT count(*) FROM committed))
      FROM saved
)
SELECT (SELECT count(*) FROM saved) AS saved, (SELECT count(*) FROM committed) AS committed

-- prune_steps --
-- Checkpoints and ledger rows of jobs finished before the cutoff, up to %(limit)s of each; the
-- larger count. A job whose dead letter awaits review keeps its ledger: a requeue carries it
-- (orc_replay_ledger_v1), so that the replay reconciles what may have happened.
WITH checkpoints AS (
    DELETE FROM orc_checkpoints
     WHERE (job_id, step) IN (
           SELECT c.job_id, c.step FROM orc_checkpoints AS c JOIN orc_jobs AS j ON j.id = c.job_id
            WHERE j.finished_at < now() - make_interval(secs => %(older_than)s) LIMIT %(limit)s)
    RETURNING 1
), effects AS (
    DELETE FROM orc_side_effects
     WHERE (job_id, invocation_id) IN (
           SELECT e.job_id, e.invocation_id FROM orc_side_effects AS e
             JOIN orc_jobs AS j ON j.id = e.job_id
            WHERE j.finished_at < now() - make_interval(secs => %(older_than)s)
              AND NOT EXISTS (SELECT FROM orc_dead_letters AS l WHERE l.job_id = j.id
                                 AND l.state IN ('recorded', 'discard_requested'))
            LIMIT %(limit)s)
    RETURNING 1
)
SELECT greatest((SELECT count(*) FROM checkpoints), (SELECT count(*) FROM effects)) AS n
