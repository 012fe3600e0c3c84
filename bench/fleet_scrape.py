"""What one scrape of the fleet metrics (``orchestrator exporter``) costs the database.

    ./dev bench fleet_scrape [--jobs 1000000] [--scrapes 20]

Two tables of ``--jobs`` jobs each, on a fresh database:
  settled   95 % finished, the rest live: PENDING (half due), RETRY (half due), RUNNING (a few
            stale), WAITING_APPROVAL; a dead letter for every 50th finished job; 200 tenants
  backlog   every job PENDING and due (a fleet that stopped: the worst case for the counts)
Each is ANALYZEd and VACUUMed (as autovacuum would have), then scraped ``--scrapes`` times
(the cache off); printed: the median and the slowest scrape, and the series it exported. The
baseline named is a scrape of an empty table, in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import psycopg

from bench.common import fresh_database, machine, server_version
from orchestrator.services.fleet import FleetMetrics
from orchestrator.storage.database import create_pool
from orchestrator.storage.stores import Stores

SETTLED = """
INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts, max_retries, trace_id,
                      tenant_id, run_at, next_retry_at, lease_token, heartbeat_at, finished_at)
SELECT gen_random_uuid(), 'type_' || (i %% 12), s, 'null', 'queue_' || (i %% 4), 3, 3, 't',
       'tenant_' || (i %% 200),
       CASE WHEN s = 'PENDING' AND i %% 2 = 0 THEN now() + interval '1 hour' ELSE now() END,
       CASE WHEN s = 'RETRY' THEN now() + (CASE WHEN i %% 2 = 0 THEN 1 ELSE -1 END)
                                         * interval '10 minutes' END,
       CASE WHEN s = 'RUNNING' THEN gen_random_uuid() END,
       CASE WHEN s = 'RUNNING' THEN now() - (i %% 400) * interval '1 second' END,
       CASE WHEN s IN ('COMPLETED', 'FAILED', 'CANCELLED') THEN now() END
  FROM generate_series(1, %(jobs)s) AS i,
       LATERAL (SELECT CASE
           WHEN i %% 100 < 95
           THEN (ARRAY['COMPLETED', 'COMPLETED', 'FAILED', 'CANCELLED'])[1 + i %% 4]
           WHEN i %% 100 < 97 THEN 'PENDING'
           WHEN i %% 100 < 98 THEN 'RETRY'
           WHEN i %% 100 < 99 THEN 'RUNNING'
           ELSE 'WAITING_APPROVAL' END AS s) AS x
"""
LETTERS = """
INSERT INTO orc_dead_letters (id, job_id, job_type, payload, error, tenant_id, state)
SELECT gen_random_uuid(), id, job_type, payload, '{}', tenant_id,
       (ARRAY['recorded', 'requeued', 'discarded'])[1 + (abs(hashtext(id::text)) %% 3)]
  FROM orc_jobs WHERE status = 'FAILED' AND abs(hashtext(id::text)) %% 13 = 0
"""
BACKLOG = """
INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts, max_retries, trace_id,
                      tenant_id, run_at)
SELECT gen_random_uuid(), 'type_' || (i %% 12), 'PENDING', 'null', 'queue_' || (i %% 4), 3, 3,
       't', 'tenant_' || (i %% 200), now() - interval '1 minute'
  FROM generate_series(1, %(jobs)s) AS i
"""


async def fill(dsn: str, statements: list[str], jobs: int) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("ALTER TABLE orc_jobs DISABLE TRIGGER USER")  # a bulk load
        for statement in statements:
            await conn.execute(statement, {"jobs": jobs})
        await conn.execute("ALTER TABLE orc_jobs ENABLE TRIGGER USER")
        await conn.execute("VACUUM ANALYZE orc_jobs")
        await conn.execute("VACUUM ANALYZE orc_dead_letters")


async def scrapes(dsn: str, n: int) -> tuple[list[float], int, dict[str, Any]]:
    pool = create_pool(dsn, min_size=1, max_size=2)
    await pool.open()
    try:
        fleet = FleetMetrics(
            Stores.on(pool).fleet, zombie_threshold=300, max_tenants=100, min_interval=0
        )
        times, series = [], 0
        for _ in range(n):
            started = time.perf_counter()
            families = await fleet.families()
            times.append(time.perf_counter() - started)
            series = sum(len(f.samples) for f in families)
        counts = {
            f.name: sum(s.value for s in f.samples)
            for f in families
            if f.name
            in ("orchestrator_jobs", "orchestrator_queue_depth", "orchestrator_dead_letters")
        }
        return times, series, counts
    finally:
        await pool.close()


def report(name: str, times: list[float], series: int, counts: dict[str, Any]) -> str:
    ms = [t * 1_000 for t in times]
    summed = ", ".join(f"{k.removeprefix('orchestrator_')} {v:,.0f}" for k, v in counts.items())
    return (
        f"  {name:<8} scrape median {statistics.median(ms):7.1f} ms, max {max(ms):7.1f} ms; "
        f"{series} series ({summed})"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--scrapes", type=int, default=20)
    args = parser.parse_args()
    lines = []
    with fresh_database("orc_bench_fleet") as dsn:
        print(f"machine: {machine()}, PostgreSQL {asyncio.run(server_version(dsn))}")
        base = asyncio.run(scrapes(dsn, args.scrapes))
        lines.append(report("empty", *base))
        asyncio.run(fill(dsn, [SETTLED, LETTERS], args.jobs))
        settled = asyncio.run(scrapes(dsn, args.scrapes))
        lines.append(report("settled", *settled))
    with fresh_database("orc_bench_fleet") as dsn:
        asyncio.run(fill(dsn, [BACKLOG], args.jobs))
        backlog = asyncio.run(scrapes(dsn, args.scrapes))
        lines.append(report("backlog", *backlog))
    print(f"fleet scrape ({args.jobs:,} jobs per table, {args.scrapes} scrapes, cache off):")
    print("\n".join(lines))
    empty = statistics.median(base[0])
    print(
        f"  ratio to the empty table's scrape: settled "
        f"{statistics.median(settled[0]) / empty:.1f}x, backlog "
        f"{statistics.median(backlog[0]) / empty:.1f}x"
    )


if __name__ == "__main__":
    main()
