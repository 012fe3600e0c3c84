"""Liveness: what heartbeats cost, how fast a worker stops, how soon handed-back work resumes,
and what one zombie sweep run costs in a big table.

    ./dev bench liveness [heartbeats|idle-exit|handback|sweep|backlog-sweep ...] [--samples N]

1. heartbeats: one worker process runs 1,000 jobs at once (each sleeps), heartbeating every
   second (30 s in production). Counted: heartbeat statements per tick (target: one), rows each
   refreshes, the statement's latency; and the worker's CPU while nothing but waiting and
   heartbeating happens (target: a small share of one core), scaled to the default interval.
2. idle-exit: an idle worker process gets SIGTERM; time until it has exited (target < 1 s).
3. handback, under load: a worker drains with a 1 s deadline while running a long checkpointed
   job; another worker is idle, and a third runs a stream of short jobs meanwhile (the load).
   Time from the hand-back (job.interrupted) to the job running again on the idle worker
   (job.running), read from the job's events (targets: p50 <= 100 ms, max <= 1 s, with the
   default 5 s polling interval: no round may wait for a poll).
4. sweep: 10,000 zombies among 1,000,000 terminal jobs; time of one sweep run, bounded by
   sweep_limit (1,000 by default) (target < 1 s), and the runs needed to clear them all.
5. backlog-sweep: a worker whose every job slot is busy, 10,000 jobs queued behind, the sweep
   ticking every 2 s with a 10 s threshold; zombies appear one after another. Delay from a
   zombie's last heartbeat to its recovery (job.zombie_detected), beyond the threshold
   (target: at most one sweep interval, 2 s).

Worker processes are the real CLI (``orchestrator --app bench.liveness:orc worker``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import psycopg

from bench.common import ROOT, fresh_database, machine, server_version
from orchestrator import JobContext, Orchestrator, Settings

orc = Orchestrator()  # the app of the worker processes; settings from their environment


@orc.job_type("sleeper")
async def sleeper(ctx: JobContext, seconds: float) -> None:
    await asyncio.sleep(seconds)


@orc.job_type("long_steps")
async def long_steps(ctx: JobContext, steps: int) -> int:
    """One checkpoint per 0.2 s step: a long job that resumes where it was handed back."""
    progress = ctx.steps(int, initial=0, max_steps=steps)
    async for step in progress:
        await asyncio.sleep(0.2)
        await step.checkpoint(step.number, final=step.number == steps)
    return int(progress.state)


@contextmanager
def worker(dsn: str, job_types: str | None = None, **env: Any) -> Iterator[subprocess.Popen[bytes]]:
    """A worker process (running only ``job_types``, comma-separated, when given)."""
    environment = {**os.environ, "DATABASE_URL": dsn, **{k: str(v) for k, v in env.items()}}
    only = ["--job-types", job_types] if job_types else []
    process = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "--app", "bench.liveness:orc", "worker", *only],
        cwd=ROOT,
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def until_ready(port: int, within: float = 30) -> None:
    deadline = time.monotonic() + within
    async with httpx.AsyncClient(timeout=1) as client:
        while time.monotonic() < deadline:
            try:
                if (await client.get(f"http://127.0.0.1:{port}/readyz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.02)
    raise RuntimeError("worker never became ready")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


# -- 1. heartbeats --------------------------------------------------------------------------------


async def heartbeats(dsn: str, jobs: int, seconds: float) -> None:
    interval = 1.0
    app = Orchestrator(settings=Settings(), dsn=dsn)
    app.job_type("sleeper")(sleeper)
    port = free_port()
    env = {
        "ORCHESTRATOR_WORKER_CONCURRENCY": jobs,
        "ORCHESTRATOR_HEARTBEAT_INTERVAL": interval,
        "ORCHESTRATOR_HEALTH_PORT": port,
    }
    async with app:
        with worker(dsn, **env) as process:
            await until_ready(port)
            job_ids = await app.submit_many(
                [{"job_type": "sleeper", "payload": seconds + 30}] * jobs
            )
            async with app.stores.queries.pool.connection() as conn:
                while await _count_running(conn) < jobs:
                    await asyncio.sleep(0.1)
                await asyncio.sleep(2 * interval)  # past the claims' burst
                cpu_before, wall_before = cpu_seconds(process.pid), time.monotonic()
                written = await _heartbeats_written(conn, seconds)
                cpu = cpu_seconds(process.pid) - cpu_before
                wall = time.monotonic() - wall_before
            # The statement itself, on the same 1,000 live leases, timed from here.
            leases = {j.lease_token: j.id for j in [await app.get_job(i) for i in job_ids]}
            latencies = []
            for _ in range(50):
                started = time.perf_counter()
                held = await app.stores.liveness.heartbeat(
                    {k: v for k, v in leases.items() if k is not None},
                    zombie_threshold=300,
                    expiry_grace=60,
                )
                latencies.append((time.perf_counter() - started) * 1_000)
            assert len(held) == jobs
    ticks = wall / interval
    statements = len(written)
    rows = statistics.median(written.values())
    share = cpu / wall
    print(
        f"heartbeats, {jobs} running jobs in one worker, interval {interval:g} s, "
        f"{wall:.1f} s observed:\n"
        f"  {statements} heartbeat statements in {ticks:.1f} ticks "
        f"= {statements / ticks:.2f} per interval (target: 1), each refreshing {rows:.0f} "
        f"rows (read from the rows themselves)\n"
        f"  statement latency p50 {statistics.median(latencies):.1f} ms, "
        f"max {max(latencies):.1f} ms (1,000 rows, timed from the driver)\n"
        f"  worker CPU while running them: {share:.1%} of one core at a 1 s interval; "
        f"heartbeat statements are {statistics.median(latencies) / 1_000 / interval:.2%} of "
        f"the time at 1 s, {statistics.median(latencies) / 30_000:.3%} at the default 30 s"
    )


async def _count_running(conn: psycopg.AsyncConnection[Any]) -> int:
    cur = await conn.execute("SELECT count(*) AS n FROM orc_jobs WHERE status = 'RUNNING'")
    row = await cur.fetchone()
    return int(row["n"]) if row else 0


async def _heartbeats_written(conn: psycopg.AsyncConnection[Any], seconds: float) -> dict[Any, int]:
    """The heartbeat statements the server executed, read from the rows they wrote: one
    statement stamps every row it refreshes with its own transaction time, so each distinct
    heartbeat_at is one statement, and its row count how many jobs it covered."""
    seen: dict[Any, int] = {}
    deadline = time.monotonic() + seconds
    first: set[Any] | None = None
    while time.monotonic() < deadline:
        cur = await conn.execute(
            "SELECT heartbeat_at AS at, count(*) AS n FROM orc_jobs WHERE status = 'RUNNING' "
            "GROUP BY 1"
        )
        rows = {row["at"]: row["n"] for row in await cur.fetchall()}
        if first is None:
            first = set(rows)  # written before the window opened
        for at, n in rows.items():
            if at not in first:
                seen[at] = max(seen.get(at, 0), n)
        await asyncio.sleep(0.05)
    return seen


# -- 2. idle exit ---------------------------------------------------------------------------------


async def idle_exit(dsn: str, samples: int) -> None:
    times = []
    for _ in range(samples):
        port = free_port()
        with worker(dsn, ORCHESTRATOR_HEALTH_PORT=port) as process:
            await until_ready(port)
            await asyncio.sleep(0.5)
            started = time.monotonic()
            process.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(process.wait, 30)
            times.append(time.monotonic() - started)
            assert code == 0, code
    print(
        f"idle worker, SIGTERM -> exited (code 0): median {statistics.median(times) * 1_000:.0f} "
        f"ms, max {max(times) * 1_000:.0f} ms over {samples} runs (target < 1 s)"
    )


# -- 3. hand-back ---------------------------------------------------------------------------------


async def _load(app: Orchestrator, stop: asyncio.Event) -> int:
    """Short jobs for the load worker, 100 every 0.1 s, until ``stop``; how many."""
    submitted = 0
    while not stop.is_set():
        await app.submit_many([{"job_type": "sleeper", "payload": 0.02}] * 100)
        submitted += 100
        await asyncio.sleep(0.1)
    return submitted


async def handback(dsn: str, samples: int) -> None:
    app = Orchestrator(settings=Settings(), dsn=dsn)
    app.job_type("long_steps")(long_steps)
    app.job_type("sleeper")(sleeper)
    gaps, resumed_from = [], []
    load_port = free_port()
    async with app:
        with worker(dsn, "sleeper", ORCHESTRATOR_HEALTH_PORT=load_port,
                    ORCHESTRATOR_WORKER_CONCURRENCY=20):  # fmt: skip
            await until_ready(load_port)
            stop = asyncio.Event()
            load = asyncio.create_task(_load(app, stop))
            try:
                for _ in range(samples):
                    gaps_and_step = await _one_handback(app, dsn)
                    gaps.append(gaps_and_step[0])
                    resumed_from.append(gaps_and_step[1])
            finally:
                stop.set()
                submitted = await load
    polling = Settings().fetch_polling_interval
    print(
        f"hand-back at the drain deadline -> running on another, idle worker, while a third ran "
        f"{submitted:,} short jobs (polling interval {polling:g} s), over {samples} runs:\n"
        f"  p50 {statistics.median(gaps) * 1_000:.0f} ms (target <= 100 ms), "
        f"max {max(gaps) * 1_000:.0f} ms (target <= 1,000 ms); "
        f"resumed after step {sorted(set(resumed_from))} (its last checkpoint)"
    )


async def _one_handback(app: Orchestrator, dsn: str) -> tuple[float, int]:
    first_port, second_port = free_port(), free_port()
    with worker(dsn, "long_steps", ORCHESTRATOR_HEALTH_PORT=first_port,
                ORCHESTRATOR_DRAIN_SECONDS=1) as first:  # fmt: skip
        await until_ready(first_port)
        job_id = await app.submit("long_steps", 100)
        while (await app.get_job(job_id)).status.value != "RUNNING":
            await asyncio.sleep(0.02)
        with worker(dsn, "long_steps", ORCHESTRATOR_HEALTH_PORT=second_port) as second:
            await until_ready(second_port)
            first.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(first.wait, 30) == 0
            while (await app.get_job(job_id)).attempt < 2:
                await asyncio.sleep(0.02)
            events = await app.job_events(job_id)
            await app.cancel(job_id, reason="benchmark done")
            second.send_signal(signal.SIGTERM)
            await asyncio.to_thread(second.wait, 30)
    interrupted = next(e for e in events if e.kind == "job.interrupted")
    running = [e for e in events if e.kind == "job.running"][1]
    steps = await app.job_steps(job_id)
    step = max(s["step"] for s in steps if s["attempt"] == 1)
    return (running.at - interrupted.at).total_seconds(), step


# -- 4. sweep -------------------------------------------------------------------------------------


async def sweep(dsn: str, zombies: int, terminal: int) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            """
            INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts,
                                  max_retries, trace_id, finished_at, attempt)
            SELECT gen_random_uuid(), 'sleeper', s, '1', 'sleeper', 3, 3, 't', now(), 1
              FROM generate_series(1, %s) AS i,
                   LATERAL (SELECT (ARRAY['COMPLETED', 'FAILED', 'CANCELLED'])[1 + i %% 3]) AS x (s)
            """,
            (terminal,),
        )
        await conn.execute(
            """
            INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts,
                                  max_retries, trace_id, lease_token, locked_by, attempt,
                                  dispatch_attempt, heartbeat_at, started_at, deadline_at)
            SELECT gen_random_uuid(), 'sleeper', 'RUNNING', '1', 'sleeper', 3, 3, 't',
                   gen_random_uuid(), 'dead/1/w1', 1, 1, now() - interval '10 minutes',
                   now() - interval '10 minutes', now() + interval '50 minutes'
              FROM generate_series(1, %s)
            """,
            (zombies,),
        )
        await conn.execute("VACUUM ANALYZE orc_jobs")
    app = Orchestrator(settings=Settings(), dsn=dsn)
    app.job_type("sleeper")(sleeper)
    runs: list[tuple[int, float]] = []
    async with app:
        while True:
            started = time.perf_counter()
            done = (await app.maintenance.sweep.run_once()).handled
            runs.append((done, time.perf_counter() - started))
            if done == 0:
                break
    per_run = [seconds for done, seconds in runs if done]
    limit = app.settings.sweep_limit
    print(
        f"sweep over {zombies:,} zombies among {terminal:,} terminal jobs (sweep_limit {limit}, "
        f"batches of {app.settings.sweep_batch_size}):\n"
        f"  one run: median {statistics.median(per_run) * 1_000:.0f} ms, "
        f"max {max(per_run) * 1_000:.0f} ms, {runs[0][0]} zombies each (target < 1 s); "
        f"{len(per_run)} runs cleared them all ({sum(d for d, _ in runs):,}), "
        f"{statistics.median(per_run) / runs[0][0] * 1e6:.0f} us per zombie"
    )


# -- 5. sweep behind a backlog -------------------------------------------------------------------


async def backlog_sweep(dsn: str, backlog: int, zombies: int) -> None:
    threshold, every = 10.0, 2
    app = Orchestrator(settings=Settings(), dsn=dsn)
    app.job_type("sleeper")(sleeper)
    port = free_port()
    env = {
        "ORCHESTRATOR_HEALTH_PORT": port,
        "ORCHESTRATOR_WORKER_CONCURRENCY": 4,
        "ORCHESTRATOR_ZOMBIE_THRESHOLD": threshold,
        "ORCHESTRATOR_HEARTBEAT_INTERVAL": 2,
        "ORCHESTRATOR_DRAIN_SECONDS": 1,
        "ORCHESTRATOR_SWEEP_CRON": f"* * * * * */{every}",  # seconds come last
    }
    delays = []
    async with app:
        await app.submit_many([{"job_type": "sleeper", "payload": 3600}] * backlog)
        with worker(dsn, **env) as process:
            await until_ready(port)
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                while await _count(conn, "RUNNING") < 4:
                    await asyncio.sleep(0.1)
                ids = []
                for _ in range(zombies):  # one every 0.7 s: each meets the sweep at another phase
                    cur = await conn.execute(ZOMBIE)
                    row = await cur.fetchone()
                    assert row is not None
                    ids.append((row[0], row[1]))
                    await asyncio.sleep(0.7)
                for job_id, heartbeat_at in ids:
                    while not (found := await _detected(app, job_id)):
                        await asyncio.sleep(0.1)
                    delays.append((found - heartbeat_at).total_seconds() - threshold)
                queued = await _count(conn, "PENDING")
            process.send_signal(signal.SIGTERM)
            await asyncio.to_thread(process.wait, 60)
    print(
        f"zombie recovery behind a backlog: {queued:,} jobs queued, every job slot busy, sweep "
        f"every {every} s, threshold {threshold:g} s, {zombies} zombies:\n"
        f"  recovered after threshold + p50 {statistics.median(delays):.2f} s, "
        f"max {max(delays):.2f} s (target <= one sweep interval, {every} s)"
    )


ZOMBIE = (
    "INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts, max_retries, "
    "trace_id, lease_token, locked_by, attempt, dispatch_attempt, heartbeat_at, started_at, "
    "deadline_at) VALUES (gen_random_uuid(), 'sleeper', 'RUNNING', '1', 'sleeper', 3, 3, 't', "
    "gen_random_uuid(), 'gone/1/w1', 1, 1, now(), now(), now() + interval '1 hour') "
    "RETURNING id, heartbeat_at"
)


async def _detected(app: Orchestrator, job_id: Any) -> Any:
    events = await app.job_events(job_id)
    return next((e.at for e in events if e.kind == "job.zombie_detected"), None)


async def _count(conn: psycopg.AsyncConnection[Any], status: str) -> int:
    cur = await conn.execute("SELECT count(*) FROM orc_jobs WHERE status = %s", (status,))
    row = await cur.fetchone()
    return int(row[0]) if row else 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "which",
        nargs="*",
        default=["heartbeats", "idle-exit", "handback", "sweep", "backlog-sweep"],
    )
    parser.add_argument("--jobs", type=int, default=1_000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--zombies", type=int, default=10_000)
    parser.add_argument("--terminal", type=int, default=1_000_000)
    parser.add_argument("--backlog", type=int, default=10_000)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the sweep logs each run as a warning
    for which in args.which:
        with fresh_database("orc_bench_liveness") as dsn:
            if which == args.which[0]:
                print(f"machine: {machine()}, PostgreSQL {asyncio.run(server_version(dsn))}")
            match which:
                case "heartbeats":
                    asyncio.run(heartbeats(dsn, args.jobs, args.seconds))
                case "idle-exit":
                    asyncio.run(idle_exit(dsn, args.samples))
                case "handback":
                    asyncio.run(handback(dsn, max(3, args.samples)))
                case "sweep":
                    asyncio.run(sweep(dsn, args.zombies, args.terminal))
                case "backlog-sweep":
                    asyncio.run(backlog_sweep(dsn, args.backlog, max(3, args.samples)))
                case _:
                    parser.error(f"unknown measurement {which!r}")


if __name__ == "__main__":
    main()
