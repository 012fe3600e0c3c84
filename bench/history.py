"""Tables of a realistic size: a fleet's history, written straight into a migrated database.

A fleet that keeps days of history has many more finished jobs than live ones, each with its
events and its finished dispatch; some failed (with a dead letter), some were cancelled; a few
wait for a retry, a later start or a worker. :func:`fill_history` writes that, in the shapes the
orchestrator's own statements write (one INSERT ... SELECT per table, so a million jobs take a
minute, not an hour), and ANALYZEs the tables, as autovacuum would have. Nothing it writes is
due to run, and rollups count it as already rolled up, so a worker started on it meets only the
jobs a bench or test adds: the planted history is what the hot statements must stay
indifferent to.

Used by the plan test (tests/test_plans.py), the growing-table bench (bench/growing.py), the
paired bench (bench/paired.py) and the paired bench of an admitted call (bench/call_admit.py).
"""

from __future__ import annotations

from typing import Any

import psycopg

#: One statement per table (and the plan they share), each run with the same parameters:
#: %(jobs)s finished jobs in all; %(live)s unfinished ones on top.
#: Of the finished: 1 in 25 FAILED (with its dead letter), 1 in 100 CANCELLED, the rest
#: COMPLETED; of the unfinished, PENDING with a start a day away, RETRY due in a day, and
#: WAITING_APPROVAL in turn. Ids are random (UUID v4), as on a fleet of many producers.
FILL = (
    """
CREATE TEMP TABLE planted ON COMMIT DROP AS
SELECT gen_random_uuid() AS id, nextval('procrastinate_jobs_id_seq') AS dispatch, n,
       CASE WHEN n > %(jobs)s THEN (ARRAY['PENDING', 'RETRY', 'WAITING_APPROVAL'])[n %% 3 + 1]
            WHEN n %% 25 = 0 THEN 'FAILED'
            WHEN n %% 100 = 1 THEN 'CANCELLED'
            ELSE 'COMPLETED' END AS status,
       (ARRAY['llm_generate', 'http_request', 'send_notification', 'run_agent'])[n %% 4 + 1]
           AS job_type,
       CASE WHEN n %% 3 = 0 THEN NULL ELSE 'tenant-' || (n %% 7) END AS tenant_id,
       now() - make_interval(secs => (%(jobs)s - n) * %(spacing)s) AS at
  FROM generate_series(1, %(jobs)s + %(live)s) AS n
""",
    """
INSERT INTO procrastinate_jobs (id, queue_name, task_name, priority, lock, args, status,
                                attempts)
SELECT p.dispatch, 'default', 'orc.' || p.job_type, 0, p.id::text,
       jsonb_build_object('job_id', p.id),
       CASE WHEN p.status IN ('COMPLETED', 'FAILED') THEN 'succeeded'
            ELSE 'cancelled' END::procrastinate_job_status, 1
  FROM planted AS p
 WHERE p.status NOT IN ('RETRY', 'WAITING_APPROVAL')
""",
    """
INSERT INTO orc_jobs (id, job_type, status, payload, result, queue, run_at, attempt,
                      max_attempts, dispatch_attempt, retry_count, max_retries, next_retry_at,
                      procrastinate_job_id, last_error, trace_id, timeout_seconds, created_at,
                      updated_at, started_at, finished_at, tenant_id)
SELECT p.id, p.job_type, p.status,
       jsonb_build_object('prompt', 'Summarise document ' || p.n, 'model', 'claude-sonnet'),
       CASE p.status WHEN 'COMPLETED' THEN jsonb_build_object('text', 'summary ' || p.n) END,
       'default',
       CASE p.status WHEN 'PENDING' THEN now() + interval '1 day' ELSE p.at END,
       CASE WHEN p.status = 'PENDING' THEN 0 ELSE 1 END, 3, 1,
       CASE p.status WHEN 'RETRY' THEN 1 ELSE 0 END, 5,
       CASE p.status WHEN 'RETRY' THEN now() + interval '1 day' END,
       CASE WHEN p.status IN ('RETRY', 'WAITING_APPROVAL') THEN NULL ELSE p.dispatch END,
       CASE p.status WHEN 'FAILED'
           THEN jsonb_build_object('ts', p.at, 'message', 'HTTP 400', 'code', 'HTTP_400',
                                   'classification', 'PERMANENT', 'attempt', 1,
                                   'terminal', true) END,
       md5(p.id::text), 300, p.at, p.at,
       CASE WHEN p.status = 'PENDING' THEN NULL ELSE p.at END,
       CASE WHEN p.status IN ('COMPLETED', 'FAILED', 'CANCELLED')
            THEN p.at + interval '2 seconds' END,
       p.tenant_id
  FROM planted AS p
""",
    """
INSERT INTO orc_job_events (job_id, kind, at, payload)
SELECT p.id, e.kind, p.at + e.after, e.payload
  FROM planted AS p
 CROSS JOIN LATERAL (VALUES
     ('job.created', interval '0', jsonb_build_object('job_type', p.job_type,
                                                      'queue', 'default', 'max_runs', 3)),
     ('job.running', interval '1 second', jsonb_build_object('attempt', 1, 'run', 1)),
     (CASE p.status WHEN 'COMPLETED' THEN 'job.completed' WHEN 'FAILED' THEN 'job.failed'
                    WHEN 'CANCELLED' THEN 'job.cancelled' WHEN 'RETRY' THEN 'job.retry_scheduled'
                    ELSE 'job.waiting_approval' END,
      interval '2 seconds',
      jsonb_build_object('attempt', 1, 'run', 1, 'max_runs', 3, 'retry_count', 0,
                         'max_retries', 5, 'layer', 'app', 'backoff_ms', 0,
                         'dead_letter_id', NULL, 'worker', 'w', 'run_id', NULL))
 ) AS e (kind, after, payload)
 WHERE p.status <> 'PENDING' OR e.kind = 'job.created'
""",
    """
INSERT INTO orc_dead_letters (id, job_id, job_type, payload, error, created_at, tenant_id)
SELECT gen_random_uuid(), p.id, p.job_type, '{}', j.last_error, p.at, p.tenant_id
  FROM planted AS p JOIN orc_jobs AS j ON j.id = p.id
 WHERE p.status = 'FAILED'
""",
    """
INSERT INTO orc_llm_usage (job_id, call_id, attempt, tenant_id, job_type, model, input_tokens,
                           output_tokens, cache_read_tokens, cache_creation_tokens, recorded_at)
SELECT p.id, 'call-1', 1, p.tenant_id, p.job_type, 'claude-sonnet', 900, 300, 0, 0, p.at
  FROM planted AS p
 WHERE p.job_type IN ('llm_generate', 'run_agent') AND p.status <> 'PENDING'
""",
    """
UPDATE orc_rollup_watermark SET rolled_up_to = now()
""",
)

#: The tables FILL writes, in the order ANALYZE takes them.
FILLED = (
    "procrastinate_jobs", "orc_jobs", "orc_job_events", "orc_dead_letters", "orc_llm_usage",
)  # fmt: skip


async def fill_history(
    conn: psycopg.AsyncConnection[Any], jobs: int, *, live: int = 0, spacing: float = 0.05
) -> None:
    """Plant ``jobs`` finished jobs (one every ``spacing`` seconds back from now) and ``live``
    unfinished ones, with their events, dispatches, dead letters and LLM usage, in one
    transaction; then ANALYZE what it wrote. ``conn`` must be in autocommit mode."""
    async with conn.transaction():
        for statement in FILL:
            await conn.execute(statement.strip(), {"jobs": jobs, "live": live, "spacing": spacing})
    for table in FILLED:
        await conn.execute(f"ANALYZE {table}")
