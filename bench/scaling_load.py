"""The autoscaler's query (fleet.sql, scaling_load; KEDA polls it every 15 s) in a big table.

    ./dev bench scaling_load [--finished 1000000] [--backlog 1000 100000] [--samples 50]

For each backlog: a fresh database with ``--finished`` finished jobs (COMPLETED, FAILED and
CANCELLED), and a live set: ``backlog`` PENDING jobs due, as many RETRY jobs due, 1,000 of each
not due yet, 500 RUNNING and 100 WAITING_APPROVAL, then VACUUM ANALYZE (as autovacuum would
have). Printed: the plan with EXPLAIN (ANALYZE, BUFFERS), and the query's latency from the
client, median and p99. Target: a few milliseconds however many jobs have finished; it grows
with the backlog only (each due job is one index entry read).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import psycopg

from bench.common import fresh_database, machine, percentile, server_version
from orchestrator.storage.queries import QUERIES

COLUMNS = "id, job_type, status, payload, queue, max_attempts, max_retries, trace_id"
LIVE = f"""
INSERT INTO orc_jobs ({COLUMNS}, run_at, next_retry_at, lease_token, heartbeat_at)
SELECT gen_random_uuid(), 'sleeper', %(status)s, '1', 'default', 3, 3, 't',
       now() + %(due_in)s * interval '1 second',
       CASE WHEN %(status)s = 'RETRY' THEN now() + %(due_in)s * interval '1 second' END,
       CASE WHEN %(status)s = 'RUNNING' THEN gen_random_uuid() END,
       CASE WHEN %(status)s = 'RUNNING' THEN now() END
  FROM generate_series(1, %(n)s)
"""


async def measure(dsn: str, finished: int, backlog: int, samples: int) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            f"""
            INSERT INTO orc_jobs ({COLUMNS}, finished_at, attempt)
            SELECT gen_random_uuid(), 'sleeper', s, '1', 'default', 3, 3, 't', now(), 1
              FROM generate_series(1, %s) AS i,
                   LATERAL (SELECT (ARRAY['COMPLETED', 'FAILED', 'CANCELLED'])[1 + i %% 3]) AS x (s)
            """,
            (finished,),
        )
        live = [
            ("PENDING", backlog, -60),
            ("RETRY", backlog, -60),
            ("PENDING", 1_000, 3600),
            ("RETRY", 1_000, 3600),
            ("RUNNING", 500, -60),
            ("WAITING_APPROVAL", 100, -60),
        ]
        for status, n, due_in in live:
            await conn.execute(LIVE, {"status": status, "n": n, "due_in": due_in})
        await conn.execute("VACUUM ANALYZE orc_jobs")
        query = QUERIES["scaling_load"]
        cur = await conn.execute(f"EXPLAIN (ANALYZE, BUFFERS) {query}")
        plan = [str(row[0]) for row in await cur.fetchall()]
        timings: list[float] = []
        load: Any = None
        for _ in range(samples):
            started = time.perf_counter()
            cur = await conn.execute(query)
            load = (await cur.fetchone() or [None])[0]
            timings.append((time.perf_counter() - started) * 1000)
    print(f"\n{finished:,} finished jobs, backlog {backlog:,} due PENDING + {backlog:,} due RETRY:")
    print("\n".join(f"  {line}" for line in plan))
    print(
        f"  load {load} (expected {2 * backlog + 500}); from the client over {samples} runs: "
        f"median {statistics.median(timings):.2f} ms, p99 {percentile(timings, 99):.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--finished", type=int, default=1_000_000)
    parser.add_argument("--backlog", type=int, nargs="+", default=[1_000, 100_000])
    parser.add_argument("--samples", type=int, default=50)
    args = parser.parse_args()
    for n, backlog in enumerate(args.backlog):
        with fresh_database("orc_bench_scaling") as dsn:
            if n == 0:
                print(f"machine: {machine()}, PostgreSQL {asyncio.run(server_version(dsn))}")
            asyncio.run(measure(dsn, args.finished, backlog, args.samples))


if __name__ == "__main__":
    main()
