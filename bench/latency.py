"""Latency: how soon work starts.

    ./dev bench latency [--samples 300]

1. submit -> start: one idle worker (its own process, LISTEN/NOTIFY on); jobs are submitted one
   at a time, 25 ms apart, and each records when its task function began. Measured from just
   before ``submit()`` is called to that moment (both clocks are this machine's). Baselines:
   raw Procrastinate, measured here the same way (defer -> task start, on the orchestrator's
   pool settings); Graphile Worker, reported at 1.7 ms p50 / 8 ms p99 on this machine.
   Targets: p50 <= 2 ms, p99 <= 10 ms.
2. retry lateness: jobs fail once with ``RetryLater(0.2)``; the second attempt's start is
   compared with the ``next_retry_at`` it was scheduled for. Procrastinate alone finds
   scheduled jobs by polling (5 s); Graphile Worker is 0.6-1.3 s late here; target p50 <= 100 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import procrastinate
import psycopg

from bench.common import fresh_database, machine, percentile, server_version
from orchestrator import JobContext, Orchestrator, RetryLater, Settings
from orchestrator.database import create_pool

WARM_UP = 20  # first jobs: connections opening, statements being prepared
GAP = 0.025  # seconds between submits: each job meets an idle worker


def app(dsn: str) -> Orchestrator:
    orc = Orchestrator(settings=Settings(), dsn=dsn)

    @orc.job_type("probe")
    async def probe(ctx: JobContext, payload: None) -> float:
        return time.time()

    @orc.job_type("retry_once")
    async def retry_once(ctx: JobContext, payload: None) -> float:
        started = time.time()
        if ctx.attempt == 1:
            raise RetryLater(0.2)
        return started

    return orc


def raw_app(dsn: str) -> procrastinate.App:
    raw = procrastinate.App(
        connector=procrastinate.PsycopgConnector(pool_factory=lambda **_: create_pool(dsn))
    )

    @raw.task(name="probe")
    async def probe(i: int) -> None:
        started = time.time()
        async with raw.connector.pool.connection() as conn:
            await conn.execute("INSERT INTO bench_starts VALUES (%s, %s)", (i, started))

    return raw


async def run_worker(dsn: str, raw: bool) -> None:
    if raw:
        raw_procrastinate = raw_app(dsn)
        async with raw_procrastinate.open_async():
            await raw_procrastinate.run_worker_async(concurrency=10)
        return
    async with app(dsn) as orc:
        await orc.run_worker(concurrency=10)


async def measure_raw(dsn: str, samples: int) -> list[float]:
    raw = raw_app(dsn)
    async with raw.open_async():
        submitted = []
        for i in range(samples + WARM_UP):
            submitted.append(time.time())
            await raw.tasks["probe"].defer_async(i=i)
            await asyncio.sleep(GAP)  # the worker has finished and waits on LISTEN again
        await asyncio.sleep(1.0)
        async with raw.connector.pool.connection() as conn:
            rows = await (await conn.execute("SELECT i, t FROM bench_starts ORDER BY i")).fetchall()
    started = {row["i"]: row["t"] for row in rows}
    return [(started[i] - submitted[i]) * 1_000 for i in range(WARM_UP, samples + WARM_UP)]


async def wait_done(orc: Orchestrator, job_id: Any) -> Any:
    while (job := await orc.get_job(job_id)).finished_at is None:
        await asyncio.sleep(0.05)
    return job


async def measure(dsn: str, samples: int) -> tuple[list[float], list[float]]:
    async with app(dsn) as orc:
        submitted = []
        for _ in range(samples + WARM_UP):
            submitted.append((time.time(), await orc.submit("probe")))
            await asyncio.sleep(GAP)
        starts = [
            ((await wait_done(orc, job_id)).result - at) * 1_000
            for at, job_id in submitted[WARM_UP:]
        ]
        ids = []
        for _ in range(max(50, samples // 3)):
            ids.append(await orc.submit("retry_once"))
            await asyncio.sleep(0.05)  # spread them so each retry is due at its own moment
        late: list[float] = []
        for job_id in ids:
            job = await wait_done(orc, job_id)
            events = await orc.job_events(job_id)
            due = next(e for e in events if e.kind == "job.retry_scheduled").payload["available_at"]
            late.append((job.result - datetime.fromisoformat(due).timestamp()) * 1_000)
        return starts, late


def summary(name: str, values: list[float]) -> str:
    return (
        f"{name}: p50 {statistics.median(values):.2f} ms, p90 {percentile(values, 90):.2f} ms, "
        f"p99 {percentile(values, 99):.2f} ms, max {max(values):.2f} ms ({len(values)} samples)"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--worker", metavar="DSN")
    parser.add_argument("--raw", action="store_true")
    args = parser.parse_args()
    if args.worker:
        asyncio.run(run_worker(args.worker, args.raw))
        return
    with fresh_database() as dsn:
        print(f"machine: {machine()}, PostgreSQL {asyncio.run(server_version(dsn))}")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE bench_starts (i int PRIMARY KEY, t float8)")
        with worker_process(dsn, raw=True):
            raw = asyncio.run(measure_raw(dsn, args.samples))
        with worker_process(dsn, raw=False):
            starts, late = asyncio.run(measure(dsn, args.samples))
        print(summary("raw Procrastinate defer -> start", raw))
        print(summary("orchestrator submit -> start", starts))
        print(
            f"  ratio of p50s (orchestrator / raw Procrastinate): "
            f"{statistics.median(starts) / statistics.median(raw):.2f}; "
            "targets p50 <= 2 ms, p99 <= 10 ms (Graphile: 1.7 / 8 ms)"
        )
        print(summary("retry start after due", late) + "  (target p50 <= 100 ms)")


@contextlib.contextmanager
def worker_process(dsn: str, *, raw: bool) -> Iterator[None]:
    argv = [sys.executable, "-m", "bench.latency", "--worker", dsn] + (["--raw"] if raw else [])
    worker = subprocess.Popen(argv)
    try:
        time.sleep(2.0)  # let it start and LISTEN
        yield
    finally:
        worker.terminate()
        worker.wait(timeout=60)


if __name__ == "__main__":
    main()
