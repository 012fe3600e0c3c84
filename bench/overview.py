"""What one read of the dashboard's overview costs with 1,000,000 jobs in the table (its cache
off: the read each viewer's refresh would make every two seconds without it).

    ./dev bench overview [--jobs 1000000] [--reads 20]

The table is bench/fleet_scrape.py's settled fleet (95 % finished, 200 tenants, 12 types, 4
queues, dead letters), its jobs finished over the last day, with the events the overview's
"Now" chart reads (each failure's, each retry's), ANALYZEd and VACUUMed; the
rollup service has caught up with it (its time is printed too: the jobs it rolls up per
second). The read is the dashboard's own (``pages._overview``), as a viewer of every tenant and
as one of a single tenant; printed: median and slowest of ``--reads`` reads, and the same read
on an empty table in the same run (the baseline). Target: at most 100 ms at 1,000,000 jobs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from functools import partial

import psycopg

from bench.common import fresh_database, machine, server_version
from bench.fleet_scrape import LETTERS, fill
from bench.ui import LETTER_ERRORS
from orchestrator import Orchestrator
from orchestrator.domain.principals import Principal, Scope
from orchestrator.interfaces.ui import pages
from orchestrator.settings import Settings
from orchestrator.storage.sessions import Session

#: bench/fleet_scrape.py's settled fleet (SETTLED), its jobs finished over the last day in the
#: order they were written (as a table fills: a job's finished row is written at its finish),
#: each after a run of up to 20 s.
SETTLED_OVER_A_DAY = """
INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts, max_retries, trace_id,
                      tenant_id, run_at, next_retry_at, lease_token, heartbeat_at, finished_at,
                      started_at)
SELECT gen_random_uuid(), 'type_' || (i %% 12), s, 'null', 'queue_' || (i %% 4), 3, 3, 't',
       'tenant_' || (i %% 200),
       CASE WHEN s = 'PENDING' AND i %% 2 = 0 THEN now() + interval '1 hour' ELSE now() END,
       CASE WHEN s = 'RETRY' THEN now() + (CASE WHEN i %% 2 = 0 THEN 1 ELSE -1 END)
                                         * interval '10 minutes' END,
       CASE WHEN s = 'RUNNING' THEN gen_random_uuid() END,
       CASE WHEN s = 'RUNNING' THEN now() - (i %% 400) * interval '1 second' END,
       CASE WHEN s IN ('COMPLETED', 'FAILED', 'CANCELLED') THEN finish END,
       CASE WHEN s IN ('COMPLETED', 'FAILED', 'CANCELLED')
            THEN finish - (i %% 20000) * interval '1 millisecond' END
  FROM generate_series(1, %(jobs)s) AS i,
       LATERAL (SELECT CASE
           WHEN i %% 100 < 95
           THEN (ARRAY['COMPLETED', 'COMPLETED', 'FAILED', 'CANCELLED'])[1 + i %% 4]
           WHEN i %% 100 < 97 THEN 'PENDING'
           WHEN i %% 100 < 98 THEN 'RETRY'
           WHEN i %% 100 < 99 THEN 'RUNNING'
           ELSE 'WAITING_APPROVAL' END AS s,
           now() - (1 - i::float8 / %(jobs)s) * interval '1 day' AS finish) AS x
"""
#: What the overview's "Now" chart reads: each failed job's dead letter and each job in RETRY's
#: retry, as events at its time (the day's ~240,000 failures, a last hour's ~10,000 of them).
ACTIVITY_EVENTS = """
INSERT INTO orc_job_events (job_id, kind, at, payload)
SELECT id, CASE status WHEN 'FAILED' THEN 'job.dead_lettered' ELSE 'job.retry_scheduled' END,
       coalesce(finished_at, now() - interval '5 minutes'),
       jsonb_build_object('attempt', 1, 'run', 1, 'max_runs', 3, 'retry_count', 0,
                          'max_retries', 3, 'worker', 'w', 'run_id', 'r', 'layer', 'app',
                          'backoff_ms', 0)
  FROM orc_jobs WHERE status IN ('FAILED', 'RETRY')
"""
VIEWERS = {
    "every tenant": Principal("bench", frozenset({Scope.READ})),
    "one tenant": Principal("bench", frozenset({Scope.READ}), frozenset({"tenant_7"})),
}


async def timed(read: Callable[[], Awaitable[object]], n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        await read()
        times.append((time.perf_counter() - start) * 1000)
    return times


async def reads(dsn: str, n: int) -> dict[str, list[float]]:
    async with Orchestrator(settings=Settings(health_port=0), dsn=dsn) as orc:
        return {
            name: await timed(partial(pages._overview, orc, Session(principal, "")), n)
            for name, principal in VIEWERS.items()
        }


async def catch_up(dsn: str) -> tuple[float, int]:
    """Roll up every closed minute of the table: (seconds taken, runs)."""
    async with Orchestrator(settings=Settings(health_port=0), dsn=dsn) as orc:
        rollup = orc.maintenance.rollup
        start, runs = time.perf_counter(), 0
        while (await rollup.run_once()).minutes:
            runs += 1
        return time.perf_counter() - start, runs


async def rollup_sizes(dsn: str) -> str:
    """Rows and bytes (with indexes) of the rollups and queue depth samples."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        words = []
        kinds = (("orc_job_rollups", "period = 60"), ("orc_job_rollups", "period = 3600"),
                 ("orc_queue_depth", "true"))  # fmt: skip
        for table, rows in kinds:
            await conn.execute(f"VACUUM ANALYZE {table}")
            cur = await conn.execute(
                f"SELECT count(*) FILTER (WHERE {rows}), count(*),"
                f" pg_total_relation_size('{table}') FROM {table}"
            )
            n, total, size = await cur.fetchone() or (0, 0, 0)
            words.append(f"{table} ({rows}): {n:,} rows, {size / max(total, 1):.0f} B a row")
        return "; ".join(words)


async def vacuum(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("VACUUM ANALYZE orc_jobs")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--reads", type=int, default=20)
    args = parser.parse_args()
    with fresh_database("orc_bench_overview") as dsn:
        print(f"machine: {machine()}, PostgreSQL {asyncio.run(server_version(dsn))}")
        empty = asyncio.run(reads(dsn, args.reads))
        asyncio.run(
            fill(dsn, [SETTLED_OVER_A_DAY, LETTERS, LETTER_ERRORS, ACTIVITY_EVENTS], args.jobs)
        )
        asyncio.run(vacuum(dsn))
        seconds, runs = asyncio.run(catch_up(dsn))
        sizes = asyncio.run(rollup_sizes(dsn))
        full = asyncio.run(reads(dsn, args.reads))
    finished = round(args.jobs * 0.95)
    print(f"rollup catch-up: {finished:,} finished jobs in {seconds:.1f} s over {runs} runs "
          f"({finished / seconds:,.0f} jobs/s)")  # fmt: skip
    print(f"rollup sizes, with indexes: {sizes}")
    print(f"overview read (cache off), {args.reads} reads each; {args.jobs:,} jobs against an "
          "empty table")  # fmt: skip
    for name in VIEWERS:
        big, small = full[name], empty[name]
        print(f"  {name:<13} median {statistics.median(big):6.1f} ms, max {max(big):6.1f} ms"
              f"   (empty table: median {statistics.median(small):5.1f} ms, ratio "
              f"{statistics.median(big) / statistics.median(small):.1f}x)")  # fmt: skip
    worst = max(statistics.median(full[n]) for n in VIEWERS)
    print(f"overview read, slowest median: {worst:.1f} ms (target <= 100 ms)")


if __name__ == "__main__":
    main()
