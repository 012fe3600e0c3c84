"""The growing-table bench: what a job costs the worker as the tables fill with history.

    ./dev bench growing [--sizes 1000,100000,1000000] [--jobs 5000] [--rounds 3]
                        [--concurrency 10]

Measured: the orchestrator's claim -> complete cost per job (microseconds of wall time per job)
of one worker process, with (by default) 1,000, 100,000 and 1,000,000 jobs already in the
tables. Each size has a database of its own, planted by bench.history.fill_history: finished
jobs with their events, dispatches, dead letters and LLM usage, ANALYZEd, rollups marked as
done, nothing due. In each round and size, ``--jobs`` no-op jobs are submitted (batches of
1000), orc_jobs, orc_job_events and procrastinate_jobs are ANALYZEd, and one worker process
(bench.throughput's ``--drain orc``, ``--concurrency`` slots, metrics on) drains them; all must
end COMPLETED. The drained jobs are then deleted with their events and dispatches, so each
database keeps its planted size (a drained no-op job would otherwise make the smallest table
five times its size by the third round). Rounds take the sizes in turn, so the machine's drift
is shared, and medians of the rounds are compared.

Baseline: the smallest table, in the same run. Goal: median at the largest / median at the
smallest <= 1.3 (the hot statements stay indifferent to the history).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import time
from typing import Any
from uuid import UUID

import psycopg

from bench.common import fresh_database, machine, server_version
from bench.history import fill_history
from bench.throughput import analyze, drain, orc_app

GOAL = 1.3
#: The tables whose rows and size on disk are printed at the end.
SHOWN = ("orc_jobs", "orc_job_events", "procrastinate_jobs")


async def plant(dsn: str, size: int) -> float:
    """Fill ``dsn``'s database with ``size`` finished jobs; return the seconds it took."""
    started = time.perf_counter()
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await fill_history(conn, size)
    return time.perf_counter() - started


async def submit(dsn: str, jobs: int) -> list[UUID]:
    """Submit ``jobs`` no-op jobs, 1000 per call; return their ids."""
    ids: list[UUID] = []
    async with orc_app(dsn) as orc:
        for start in range(0, jobs, 1000):
            batch = range(start, min(jobs, start + 1000))
            ids += await orc.submit_many({"job_type": "noop", "payload": i} for i in batch)
    return ids


async def completed(dsn: str, ids: list[UUID]) -> int:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        query = "SELECT count(*) FROM orc_jobs WHERE id = ANY(%s) AND status = 'COMPLETED'"
        row = await (await conn.execute(query, (ids,))).fetchone()
        return int(row[0]) if row else 0


async def forget(dsn: str, ids: list[UUID]) -> None:
    """Delete the drained jobs, their events (by cascade) and their dispatches."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            "DELETE FROM procrastinate_jobs WHERE lock = ANY(%s)", ([str(i) for i in ids],)
        )
        await conn.execute("DELETE FROM orc_jobs WHERE id = ANY(%s)", (ids,))


def measure(dsn: str, jobs: int, concurrency: int) -> float:
    """Submit, ANALYZE and drain ``jobs`` no-op jobs, then delete them; return microseconds
    per job."""
    ids = asyncio.run(submit(dsn, jobs))
    asyncio.run(analyze(dsn))
    try:
        seconds = drain("orc", dsn, concurrency)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"the worker failed: {exc.stderr.strip()[-500:]}") from exc
    done = asyncio.run(completed(dsn, ids))
    assert done == jobs, f"{done}/{jobs} jobs COMPLETED"
    asyncio.run(forget(dsn, ids))
    return seconds / jobs * 1e6


async def table_sizes(dsn: str) -> str:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        shown = []
        for table in SHOWN:
            size = f"pg_size_pretty(pg_total_relation_size('{table}'))"
            query = f"SELECT count(*), {size} FROM {table}"
            row: Any = await (await conn.execute(query)).fetchone()
            shown.append(f"{table} {row[0]:,} rows ({row[1]})")
        return ", ".join(shown)


def report(results: dict[int, list[float]], rounds: int) -> None:
    print(f"claim -> complete per job (median of {rounds} rounds):")
    print(f"  {'jobs in tables':>14}  {'median µs/job':>13}  {'min-max µs/job':>15}  {'jobs/s':>7}")
    for size, times in results.items():
        median = statistics.median(times)
        spread = f"{min(times):.0f}-{max(times):.0f}"
        print(f"  {size:>14,}  {median:>13.0f}  {spread:>15}  {1e6 / median:>7.0f}")
    smallest, largest = min(results), max(results)
    ratio = statistics.median(results[largest]) / statistics.median(results[smallest])
    print(f"largest / smallest: {ratio:.2f} (goal <= {GOAL})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1000,100000,1000000", help="jobs already planted")
    parser.add_argument("--jobs", type=int, default=5000, help="drained per round and size")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=10)
    args = parser.parse_args()
    sizes = sorted({int(size) for size in args.sizes.split(",")})
    # The drain's worker process inherits this: no health endpoints, so no clash on port 8080
    # with another worker on this machine. Its metrics are still recorded.
    os.environ["ORCHESTRATOR_HEALTH_PORT"] = "0"

    with contextlib.ExitStack() as stack:
        dsns = {size: stack.enter_context(fresh_database("orc_growing")) for size in sizes}
        print(f"machine: {machine()}, PostgreSQL {asyncio.run(server_version(dsns[sizes[0]]))}")
        for size, dsn in dsns.items():
            print(f"  planted {size:,} jobs in {asyncio.run(plant(dsn, size)):.1f} s")
        print(f"{args.jobs} no-op jobs per round and size, 1 worker process, "
              f"concurrency {args.concurrency}; tables ANALYZEd after each submit")  # fmt: skip
        results: dict[int, list[float]] = {size: [] for size in sizes}
        for round_no in range(1, args.rounds + 1):
            for size, dsn in dsns.items():
                results[size].append(measure(dsn, args.jobs, args.concurrency))
                print(f"  round {round_no} {size:>10,} jobs: {results[size][-1]:6.0f} µs/job")
        report(results, args.rounds)
        print("tables at the end:")
        for size, dsn in dsns.items():
            print(f"  {size:>10,}: {asyncio.run(table_sizes(dsn))}")


if __name__ == "__main__":
    main()
