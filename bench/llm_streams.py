"""1,000 concurrent ``llm_generate`` jobs in one worker process, each streaming about 10 s.

    ./dev bench llm_streams [--jobs 1000] [--chunks 20] [--every 0.5]

The bundled local Messages API server (demo/llm_server.py) runs in its own
process and streams each answer as ``--chunks`` deltas ``--every`` seconds apart. One worker
process (the real CLI, ``tasks.app:orc``, concurrency = jobs, heartbeat every 1 s) runs them all.
Printed: time to complete them all, requests the server saw (target: exactly one per job),
the worker's resident memory idle and at its peak (VmHWM; target <= 500 MB), and the gaps
between the worker's heartbeat statements, read from the rows they stamp (on time: under two
intervals).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

from bench.common import ROOT, fresh_database, machine, server_version
from bench.liveness import free_port, until_ready
from orchestrator import Orchestrator, Settings
from tasks import register_all

KEY = "bench-key-0123456789"
TARGET_MB = 500


def memory_mb(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/{pid}/status")


def start_llm(chunks: int, every: float) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "demo.llm_server", "--port", "0",
         "--chunks", str(chunks), "--chunk-every", str(every), "--api-key", KEY],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    line = process.stdout.readline()
    return process, line.split()[-1]


def measure(dsn: str, jobs: int, chunks: int, every: float) -> None:
    llm, url = start_llm(chunks, every)
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": dsn,
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_API_KEY": KEY,
        "ORCHESTRATOR_WORKER_CONCURRENCY": str(jobs),
        "ORCHESTRATOR_HEARTBEAT_INTERVAL": "1",
        "ORCHESTRATOR_HEALTH_PORT": str(port),
    }
    worker = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "--app", "tasks.app:orc", "worker"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        report = asyncio.run(run_jobs(dsn, worker.pid, port, url, jobs))
    finally:
        worker.terminate()
        worker.wait()
        llm.terminate()
        llm.wait()
    idle, peak, elapsed, statuses, tokens, requests, lateness = report
    print(
        f"{jobs} concurrent llm_generate jobs, one worker process, each stream {chunks} chunks "
        f"{every:g} s apart ({chunks * every:g} s):\n"
        f"  all finished in {elapsed:.1f} s: {statuses}; {tokens:,} output tokens kept\n"
        f"  requests the server saw: {requests} (target: exactly {jobs}, one per job)\n"
        f"  worker RSS idle {idle:.0f} MB, peak {peak:.0f} MB (VmHWM; target <= {TARGET_MB} MB, "
        f"{peak / TARGET_MB:.2f}x of it), {(peak - idle) * 1024 / jobs:.0f} KB per running job\n"
        f"  heartbeats (interval 1 s): {len(lateness) + 1} statements seen, gaps between them "
        f"median {statistics.median(lateness):.2f} s, max {max(lateness):.2f} s "
        f"(on time: < 2 s, and far below the 300 s zombie threshold)"
    )


async def run_jobs(dsn: str, pid: int, port: int, url: str, jobs: int) -> tuple[Any, ...]:
    app = Orchestrator(settings=Settings(), dsn=dsn)
    register_all(app)
    async with app:
        await until_ready(port)
        idle = memory_mb(pid, "VmRSS")
        request = {"model": "bench", "max_tokens": 256,
                   "messages": [{"role": "user", "content": "stream something"}]}  # fmt: skip
        started = time.monotonic()
        ids = await app.submit_many([{"job_type": "llm_generate", "payload": request}] * jobs)
        lateness = await _until_done(app, len(ids))
        elapsed = time.monotonic() - started
        peak = memory_mb(pid, "VmHWM")
        async with app.stores.queries.pool.connection() as conn:
            cur = await conn.execute("SELECT status, count(*) AS n FROM orc_jobs GROUP BY 1")
            statuses = {row["status"]: row["n"] for row in await cur.fetchall()}
            cur = await conn.execute(
                "SELECT sum((result->'usage'->>'output_tokens')::int) AS n FROM orc_jobs"
            )
            tokens = ((await cur.fetchone()) or {}).get("n") or 0
    async with httpx.AsyncClient() as client:
        requests = (await client.get(f"{url}/_stats")).json()["total"]
    return idle, peak, elapsed, statuses, tokens, requests, lateness


async def _until_done(app: Orchestrator, jobs: int) -> list[float]:
    """Wait for every job to finish; the gaps between the worker's heartbeat statements seen
    meanwhile, in seconds. Each statement stamps every row it refreshes with its own
    transaction time, so the stamps shared by many rows are the statements (a claim stamps
    one row)."""
    stamps: set[Any] = set()
    async with app.stores.queries.pool.connection() as conn:
        while True:
            cur = await conn.execute(
                "SELECT heartbeat_at AS at FROM orc_jobs WHERE status = 'RUNNING'"
                " GROUP BY 1 HAVING count(*) >= 10"
            )
            stamps.update(row["at"] for row in await cur.fetchall())
            cur = await conn.execute(
                "SELECT count(*) AS n FROM orc_jobs WHERE finished_at IS NOT NULL"
            )
            row = await cur.fetchone()
            if row is not None and row["n"] >= jobs:
                ordered = sorted(stamps)
                return [(b - a).total_seconds() for a, b in itertools.pairwise(ordered)]
            await asyncio.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=1_000)
    parser.add_argument("--chunks", type=int, default=20)
    parser.add_argument("--every", type=float, default=0.5)
    args = parser.parse_args()
    with fresh_database("orc_bench_llm") as dsn:
        print(f"machine: {machine()}, PostgreSQL {asyncio.run(server_version(dsn))}")
        measure(dsn, args.jobs, args.chunks, args.every)


if __name__ == "__main__":
    main()
