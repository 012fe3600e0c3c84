-- write_outputs --
-- Batches of attempts' output ([{ord, job_id, lease_token, batch, chunks, max_bytes}]), each
-- fenced by its attempt's lease and held to its job's size cap (orc_output_write_many_v1,
-- functions/output.sql): one row per batch, nulls for a stale attempt's; a batch already
-- written (its number, in its attempt) is not written again.
SELECT ord, written, next_offset, cut FROM orc_output_write_many_v1(%(batches)s)

-- output_from --
-- A page of a job's output from the offset `from_offset` on, in order (its primary key).
SELECT chunk_offset AS offset, attempt, step, kind, body, written_at
  FROM orc_job_output
 WHERE job_id = %(job_id)s AND chunk_offset >= %(from_offset)s
 ORDER BY chunk_offset
 LIMIT %(limit)s

-- outputs_from --
-- Several jobs' output at once (the API's feeds, one statement per wake-up for every job streamed
-- from a server): for each job, whether it has ended (its status) and a page of its chunks from
-- its offset on, in one snapshot, so a job that has ended shows all of its output. One row per
-- chunk, and one with null chunk columns for a job with none; none for a job that no longer
-- exists.
SELECT w.job_id, j.finished_at IS NOT NULL AS finished, j.status, o.chunk_offset AS offset,
       o.attempt, o.step, o.kind, o.body, o.written_at
  FROM unnest(%(job_ids)s::uuid[], %(offsets)s::bigint[]) AS w (job_id, from_offset)
  JOIN orc_jobs AS j ON j.id = w.job_id
  LEFT JOIN LATERAL (
      SELECT c.chunk_offset, c.attempt, c.step, c.kind, c.body, c.written_at
        FROM orc_job_output AS c
       WHERE c.job_id = w.job_id AND c.chunk_offset >= w.from_offset
       ORDER BY c.chunk_offset
       LIMIT %(limit)s
  ) AS o ON true
 ORDER BY w.job_id, o.chunk_offset

-- final_output_from --
-- The job's final output, a page from `from_offset` on: its text and progress chunks that no
-- `superseded` marker covers (a marker covers its attempt's chunks from its step on, and those
-- written outside any step), and the `cut` marker. The markers are read first, once per page.
WITH markers AS MATERIALIZED (
    SELECT attempt, step FROM orc_job_output
     WHERE job_id = %(job_id)s AND kind = 'superseded'
)
SELECT o.chunk_offset AS offset, o.attempt, o.step, o.kind, o.body, o.written_at
  FROM orc_job_output AS o
 WHERE o.job_id = %(job_id)s AND o.chunk_offset >= %(from_offset)s AND o.kind <> 'superseded'
   AND NOT EXISTS (SELECT FROM markers AS m
                    WHERE m.attempt = o.attempt AND (o.step IS NULL OR o.step >= m.step))
 ORDER BY o.chunk_offset
 LIMIT %(limit)s
