-- job_parents --
-- A job's parents (its depends_on), in order: each one's end so far and, once it ended, its
-- result or its failure (under `wait`, the job that replayed it).
SELECT d.parent_id AS job_id, p.job_type, p.status, d.on_failure, d.settled AS ended,
       p.result, p.last_error
  FROM orc_job_dependencies AS d
  JOIN orc_jobs AS p ON p.id = d.parent_id
 WHERE d.job_id = %(job_id)s
 ORDER BY d.ord
