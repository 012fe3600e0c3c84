-- job_parents --
-- A page of a job's parents (its depends_on), in order, after the place `after`: each one's end
-- so far and, once it ended, its result or its failure (under `wait`, the job that replayed
-- it); of `tenants` only (null: any).
SELECT d.ord, d.awaited_id AS job_id, p.job_type, p.status, d.on_failure, d.settled AS ended,
       p.result, p.last_error
  FROM orc_job_dependencies AS d
  JOIN orc_jobs AS p ON p.id = d.awaited_id
 WHERE d.job_id = %(job_id)s AND d.kind = 'parent' AND d.ord > %(after)s
   AND (%(tenants)s::text[] IS NULL OR p.tenant_id = ANY (%(tenants)s::text[]))
 ORDER BY d.ord
 LIMIT %(limit)s

-- job_children --
-- A page of the children a job spawned, in the order made (their ids are time-ordered), after
-- the child `after`; of `tenants` only (null: any).
SELECT c.id AS job_id, c.job_type, c.status, NULL AS on_failure,
       CASE WHEN c.finished_at IS NOT NULL THEN c.status END AS ended, c.result, c.last_error
  FROM orc_job_children AS k
  JOIN orc_jobs AS c ON c.id = k.child_id
 WHERE k.parent_id = %(job_id)s AND k.child_id > coalesce(%(after)s::uuid, '00000000-0000-0000-0000-000000000000')
   AND (%(tenants)s::text[] IS NULL OR c.tenant_id = ANY (%(tenants)s::text[]))
 ORDER BY k.child_id
 LIMIT %(limit)s

-- awaited_outcomes --
-- Jobs as a job that waited for them reads them (its children: ctx's wait_for), in the order
-- given.
SELECT j.id AS job_id, j.job_type, j.status, NULL AS on_failure,
       CASE WHEN j.finished_at IS NOT NULL THEN j.status END AS ended, j.result, j.last_error
  FROM unnest(%(job_ids)s::uuid[]) WITH ORDINALITY AS c (id, n)
  JOIN orc_jobs AS j ON j.id = c.id
 ORDER BY c.n

-- lock_spawner --
-- The running job that spawns, locked, if the attempt still holds it.
SELECT id FROM orc_jobs
 WHERE id = %(job_id)s AND status = 'RUNNING' AND lease_token = %(lease_token)s
   FOR NO KEY UPDATE

-- spawned_children --
-- What a step's spawn under `key` made before (a step run again), in order.
SELECT child_id FROM orc_job_children
 WHERE parent_id = %(job_id)s AND step = %(step)s AND key = %(key)s
 ORDER BY n

-- record_children --
-- A step's children, spawned in this transaction, recorded with job.children_spawned; the parent
-- marked as one whose end and presence reach other jobs (its cancellation reaches the children
-- cancelled with it, orc_children_cancel_v1; retention keeps it while they run).
WITH recorded AS (
    INSERT INTO orc_job_children (parent_id, step, key, n, child_id, cancel_with_parent)
    SELECT %(job_id)s, %(step)s, %(key)s, c.n, c.id, %(cancel_with_parent)s
      FROM unnest(%(children)s::uuid[]) WITH ORDINALITY AS c (id, n)
), marked AS (
    UPDATE orc_jobs SET has_dependants = true WHERE id = %(job_id)s AND NOT has_dependants
)
INSERT INTO orc_job_events (job_id, kind, payload)
VALUES (%(job_id)s, 'job.children_spawned',
        orc_children_spawned_event_v1(%(children)s::uuid[], %(step)s, %(key)s))

-- wait_for_children --
-- A parent's wait (orc_wait_for_children_v1): how many children it waits for, or null when
-- its lease is gone.
SELECT orc_wait_for_children_v1(%(job_id)s, %(lease_token)s, %(children)s::uuid[],
                                %(task_prefix)s) AS waiting
