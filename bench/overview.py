"""What one read of the dashboard's overview costs with 1,000,000 jobs in the table (its cache
off: the read each viewer's refresh would make every two seconds without it).

    ./dev bench overview [--jobs 1000000] [--reads 20]

The table is bench/fleet_scrape.py's settled fleet (95 % finished, 200 tenants, 12 types, 4
queues, dead letters), its finish times spread over the last day, ANALYZEd and VACUUMed; the
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
from bench.fleet_scrape import LETTERS, SETTLED, fill
from bench.ui import LETTER_ERRORS
from orchestrator import Orchestrator
from orchestrator.domain.principals import Principal, Scope
from orchestrator.interfaces.ui import pages
from orchestrator.settings import Settings
from orchestrator.storage.sessions import Session

#: The settled fleet's finished jobs finished over the last day, each after a run of up to 20 s.
SPREAD = """
UPDATE orc_jobs
   SET finished_at = now() - (abs(hashtext(id::text)) %% 86400) * interval '1 second',
       started_at = now() - (abs(hashtext(id::text)) %% 86400) * interval '1 second'
                          - (abs(hashtext(id::text)) %% 20000) * interval '1 millisecond'
 WHERE finished_at IS NOT NULL
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
        asyncio.run(fill(dsn, [SETTLED, LETTERS, LETTER_ERRORS, SPREAD], args.jobs))
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
