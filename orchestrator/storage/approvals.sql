-- step_approval --
-- The approval a step asked for (under its key), if it asked before.
SELECT * FROM orc_approvals
 WHERE job_id = %(job_id)s AND step = %(step)s AND key = %(key)s

-- request_approval --
-- The attempt stops and waits: WAITING_APPROVAL (lease released) with its approval record and a
-- job.waiting_approval event, in one statement (its notice, if any, is submitted in the same
-- transaction).
WITH waiting AS (
    UPDATE orc_jobs
       SET status = %(target)s, lease_token = NULL, locked_by = NULL, heartbeat_at = NULL
     WHERE id = %(job_id)s AND lease_token = %(lease_token)s AND status = ANY (%(sources)s)
    RETURNING id
), approval AS (
    INSERT INTO orc_approvals (id, job_id, step, key, question, details, on_reject, expires_at)
    SELECT %(approval_id)s, id, %(step)s, %(key)s, %(question)s, %(details)s, %(on_reject)s,
           now() + make_interval(secs => %(expires_in)s)
      FROM waiting
    RETURNING id, job_id, expires_at
), event AS (
    INSERT INTO orc_job_events (job_id, kind, payload)
    SELECT job_id, 'job.waiting_approval',
           %(event)s::jsonb || jsonb_build_object('expires_at', expires_at)
      FROM approval
)
SELECT id FROM approval

-- lock_approval --
-- An approval with its job (both locked, for the decision): the approval's own columns, and the
-- job's status and counters, which a failure reports.
SELECT a.id, a.step, a.status, a.on_reject, a.expires_at, a.job_id, j.status AS job_status,
       j.job_type, j.tenant_id, j.payload, j.attempt, j.max_attempts, j.dispatch_attempt, j.retry_count,
       j.max_retries, j.lease_token, j.locked_by
  FROM orc_approvals AS a JOIN orc_jobs AS j ON j.id = a.job_id
 WHERE a.id = %(approval_id)s
   FOR UPDATE OF a, j

-- decide_approval --
UPDATE orc_approvals
   SET status = %(decision)s, decided_at = now(), decided_by = %(decided_by)s,
       reason = %(reason)s
 WHERE id = %(approval_id)s AND status = 'pending'
RETURNING id

-- resume_after_approval --
-- Approved (or rejected down the task's rejection path): PENDING, no budget used, with an event;
-- dispatch_jobs gives it a new dispatch in the same transaction.
WITH resumed AS (
    UPDATE orc_jobs SET status = %(target)s
     WHERE id = %(job_id)s AND status = ANY (%(sources)s)
    RETURNING id
)
INSERT INTO orc_job_events (job_id, kind, payload)
SELECT id, %(kind)s, %(event)s FROM resumed
RETURNING job_id

-- expired_approvals --
-- Approvals past their expiry whose job still waits, but those this run could not handle;
-- bounded, SKIP LOCKED for several sweepers.
SELECT a.id, a.job_id
  FROM orc_approvals AS a JOIN orc_jobs AS j ON j.id = a.job_id
 WHERE a.status = 'pending' AND a.expires_at < now() AND j.status = %(waiting)s
   AND a.id <> ALL (%(passed_over)s::uuid[])
 ORDER BY a.expires_at
 LIMIT %(limit)s
   FOR UPDATE OF a SKIP LOCKED

-- list_approvals --
SELECT a.*, j.job_type, j.status AS job_status, j.tenant_id
  FROM orc_approvals AS a JOIN orc_jobs AS j ON j.id = a.job_id
 WHERE (%(status)s::text IS NULL OR a.status = %(status)s)
   AND (%(tenants)s::text[] IS NULL OR j.tenant_id = ANY (%(tenants)s))
 ORDER BY a.requested_at DESC
 LIMIT %(limit)s

-- get_approval --
SELECT a.*, j.job_type, j.status AS job_status, j.tenant_id
  FROM orc_approvals AS a JOIN orc_jobs AS j ON j.id = a.job_id
 WHERE a.id = %(approval_id)s
