"""Latency: how soon work starts.

    ./dev bench latency [--samples 1000] [--rounds 3] [--breakdown]

1. submit -> start, by Graphile Worker's own method (perfTest/latencyTest.js): the worker runs in
   the driver's process with concurrency 1; each job is submitted the moment the previous one
   started, and the time from just before ``submit()`` to the task function's first line is
   recorded. Baselines, measured the same way: raw Procrastinate (defer -> start), and Graphile
   Worker itself (bench/graphile/latency.js). That needs Node.js and npm; the pinned
   graphile-worker (0.17.3, the newest that supports Node 20) is installed when it is missing,
   and without them the bench says why it skipped it. The three take turns, ``--rounds`` times
   (the machine's speed drifts within minutes, and interleaving spreads the drift over all
   three), each time on a fresh database of its own, so that all start from the same empty
   tables and none runs on another's finished jobs. Raw Procrastinate's database holds
   Procrastinate's schema alone. Percentiles are over all rounds' samples, and each round's p50
   is shown. The issue's figures for Graphile Worker on this machine: 1.7 ms p50 / 8 ms p99.
   Targets: p50 <= 2 ms, p99 <= 10 ms. Each system's CPU time per job is printed too: of the
   measuring process (submitter and worker) and of the server's processes serving its database
   (read from /proc, when the server runs on this machine), to show where each one's time goes.
   Raw Procrastinate's includes its task's own insert (bench_starts).
2. the same, with the worker in another process and 25 ms of idleness before each submit: the
   usual production shape, slower on this VM because every idle hop wakes a sleeping CPU.
3. retry lateness: jobs fail once with ``RetryLater(0.2)``; the second attempt's start is
   compared with the ``next_retry_at`` it was scheduled for. Procrastinate alone finds
   scheduled jobs by polling (5 s); Graphile Worker is 0.6-1.3 s late here; target p50 <= 100 ms.

``--breakdown`` adds, for raw Procrastinate and the orchestrator in 1. (all rounds together), the
server's time per job in each SQL function called at least once per job (``track_functions``;
it needs a superuser): where the orchestrator's own writes cost. Each function's own time is
shown: the functions and PL/pgSQL triggers it calls have lines of their own, foreign-key checks
count in the function whose statement made them, and statements outside functions are not
counted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import datetime
from typing import Any, Literal

import procrastinate
import psycopg
from psycopg import conninfo, sql

from bench.common import (
    ROOT,
    CpuMeter,
    cpu_per_job,
    fresh_database,
    machine,
    percentile,
    quiet_orchestrator,
    server_version,
)
from orchestrator import JobContext, Orchestrator, RetryLater, Settings
from orchestrator.storage.database import create_pool

WARM_UP = 100  # as Graphile's test: connections opening, statements being prepared
GAP = 0.025  # idle seconds before each submit in the cross-process measurement
RAW, ORC, GRAPHILE_WORKER = "raw Procrastinate", "orchestrator", "Graphile Worker"

started_at: dict[int, float] = {}  # sample -> when its task began (in-process measurements)
arrived: dict[int, asyncio.Future[None]] = {}


def note_start(sample: int) -> None:
    started_at[sample] = time.perf_counter()
    if sample in arrived and not arrived[sample].done():
        arrived[sample].set_result(None)


def orchestrator_app(dsn: str) -> Orchestrator:
    quiet_orchestrator()
    orc = Orchestrator(settings=Settings(), dsn=dsn)

    @orc.job_type("probe")
    async def probe(ctx: JobContext, payload: int) -> float:
        note_start(payload)
        return time.time()

    @orc.job_type("retry_once")
    async def retry_once(ctx: JobContext, payload: None) -> float:
        started = time.time()
        if ctx.attempt == 1:
            raise RetryLater(0.2)
        return started

    return orc


def procrastinate_app(dsn: str) -> procrastinate.App:
    raw = procrastinate.App(
        connector=procrastinate.PsycopgConnector(pool_factory=lambda **_: create_pool(dsn))
    )

    @raw.task(name="probe")
    async def probe(i: int) -> None:
        note_start(i)
        started = time.time()
        async with raw.connector.pool.connection() as conn:
            await conn.execute("INSERT INTO bench_starts VALUES (%s, %s)", (i, started))

    return raw


async def back_to_back(
    submit: Callable[[int], Awaitable[Any]],
    worker: AsyncIterator[None],
    samples: int,
    cpu: tuple[CpuMeter, str],
) -> list[float]:
    """Graphile's loop: submit, wait for the task to start, submit the next one. ``cpu``: the
    meter that adds the CPU time of the samples (not the warm-up), and the database's dsn."""
    meter, dsn = cpu
    latencies = []
    async with contextlib.aclosing(worker):
        await anext(worker)
        for i in range(WARM_UP + samples):
            if i == WARM_UP:
                await meter.start(dsn)
            arrived[i] = asyncio.get_running_loop().create_future()
            before = time.perf_counter()
            await submit(i)
            await asyncio.wait_for(arrived[i], 10)
            if i >= WARM_UP:
                latencies.append((started_at[i] - before) * 1_000)
        await meter.stop(dsn, samples)
    started_at.clear()
    arrived.clear()
    return latencies


async def in_process_raw(dsn: str, samples: int, meter: CpuMeter) -> list[float]:
    """On a database with Procrastinate's schema and no ``bench_starts`` yet."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("CREATE TABLE bench_starts (i int PRIMARY KEY, t float8)")
    raw = procrastinate_app(dsn)

    async def worker() -> AsyncIterator[None]:
        async with raw.open_async():
            task = asyncio.create_task(
                raw.run_worker_async(concurrency=1, install_signal_handlers=False)
            )
            await asyncio.sleep(1.0)
            try:
                yield
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    return await back_to_back(
        lambda i: raw.tasks["probe"].defer_async(i=i), worker(), samples, (meter, dsn)
    )


async def in_process_orchestrator(dsn: str, samples: int, meter: CpuMeter) -> list[float]:
    orc = orchestrator_app(dsn)

    async def worker() -> AsyncIterator[None]:
        async with orc:
            task = asyncio.create_task(orc.run_worker(concurrency=1, install_signal_handlers=False))
            await asyncio.sleep(1.0)
            try:
                yield
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    return await back_to_back(lambda i: orc.submit("probe", i), worker(), samples, (meter, dsn))


async def run_worker(dsn: str) -> None:
    async with orchestrator_app(dsn) as orc:
        await orc.run_worker(concurrency=10)


async def wait_done(orc: Orchestrator, job_id: Any) -> Any:
    while (job := await orc.get_job(job_id)).finished_at is None:
        await asyncio.sleep(0.05)
    return job


async def cross_process(dsn: str, samples: int) -> tuple[list[float], list[float]]:
    async with orchestrator_app(dsn) as orc:
        submitted = []
        for i in range(samples + 20):
            await asyncio.sleep(GAP)  # the worker has finished and waits on LISTEN again
            submitted.append((time.time(), await orc.submit("probe", -1 - i)))
        starts = [
            ((await wait_done(orc, job_id)).result - at) * 1_000 for at, job_id in submitted[20:]
        ]
        ids = []
        for _ in range(max(50, samples // 5)):
            ids.append(await orc.submit("retry_once"))
            await asyncio.sleep(0.05)  # spread them so each retry is due at its own moment
        late: list[float] = []
        for job_id in ids:
            job = await wait_done(orc, job_id)
            events = await orc.job_events(job_id)
            due = next(e for e in events if e.kind == "job.retry_scheduled").payload["available_at"]
            late.append((job.result - datetime.fromisoformat(due).timestamp()) * 1_000)
        return starts, late


GRAPHILE = ROOT / "bench" / "graphile"
LIBPQ_ENV = {"host": "PGHOST", "port": "PGPORT", "user": "PGUSER", "password": "PGPASSWORD"}


def graphile_worker(samples: int) -> tuple[str, list[float], dict[str, float | None]]:
    """Graphile Worker's own latency on a database of its own: (its version, latencies in ms,
    CPU per job in us of its process and of the server: ``{"process": .., "server": ..}``).
    Raises RuntimeError saying why it could not be measured."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        raise RuntimeError("Node.js and npm are not installed")
    if _installed_graphile() != _pinned_graphile():
        install = subprocess.run(
            [npm, "install", "--no-package-lock", "--no-audit", "--no-fund", "--silent"],
            cwd=GRAPHILE, capture_output=True, text=True, check=False,
        )  # fmt: skip
        if install.returncode != 0:
            raise RuntimeError(f"npm install failed: {install.stderr.strip()[-300:]}")
    with fresh_database("graphile_bench", schema=None) as dsn:
        params = conninfo.conninfo_to_dict(dsn)
        env = {var: str(params[key]) for key, var in LIBPQ_ENV.items() if params.get(key)}
        run = subprocess.run(
            [node, str(GRAPHILE / "latency.js"), str(samples)],
            env={**os.environ, **env, "PGDATABASE": str(params["dbname"])},
            capture_output=True, text=True, check=False,
        )  # fmt: skip
    if run.returncode != 0:
        raise RuntimeError(f"latency.js failed: {run.stderr.strip()[-300:]}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    return str(result["version"]), [float(v) for v in result["latencies"]], result["cpu"]


def _pinned_graphile() -> str:
    return str(
        json.loads((GRAPHILE / "package.json").read_text())["dependencies"]["graphile-worker"]
    )


def _installed_graphile() -> str | None:
    installed = GRAPHILE / "node_modules" / "graphile-worker" / "package.json"
    return str(json.loads(installed.read_text())["version"]) if installed.is_file() else None


@contextlib.contextmanager
def worker_process(dsn: str) -> Iterator[None]:
    worker = subprocess.Popen([sys.executable, "-m", "bench.latency", "--worker", dsn])
    try:
        time.sleep(2.0)  # let it start and LISTEN
        yield
    finally:
        worker.terminate()
        worker.wait(timeout=60)


def track_functions(dsn: str) -> None:
    """Time every SQL function in the sessions opened from now on (see ``server_time``)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        name = sql.Identifier(str(conninfo.conninfo_to_dict(dsn)["dbname"]))
        conn.execute(sql.SQL("ALTER DATABASE {} SET track_functions = 'all'").format(name))


#: Per SQL function: (calls, milliseconds of its own time), summed over runs.
FunctionTimes = dict[str, tuple[int, float]]


def server_time(dsn: str, run: Callable[[], list[float]], into: FunctionTimes) -> list[float]:
    """``run()``'s latencies; the server's time in each SQL function during it is added to
    ``into``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_reset()")
    latencies = run()
    time.sleep(1.5)  # the closed sessions' counters reach the statistics
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT funcname, calls, self_time FROM pg_stat_user_functions"
        ).fetchall()
    for name, calls, self_ms in rows:
        total_calls, total_ms = into.get(name, (0, 0.0))
        into[name] = (total_calls + calls, total_ms + self_ms)
    return latencies


def breakdown_lines(times: FunctionTimes, jobs: int) -> list[str]:
    """The functions called at least once per job, costliest first."""
    rows = sorted(
        ((name, calls, ms) for name, (calls, ms) in times.items() if calls >= jobs),
        key=lambda row: -row[2],
    )
    total = sum(ms for _, _, ms in rows) * 1_000 / jobs
    return [f"server time in SQL functions: {total:.0f} us per job"] + [
        f"  {name:<55} {calls / jobs:4.2f} calls/job {ms * 1_000 / jobs:6.1f} us/job"
        for name, calls, ms in rows
    ]


def graphile_per_job(rounds: list[dict[str, float | None]]) -> str:
    """The CPU line for Graphile Worker's rounds (each the same number of jobs)."""
    servers = [r["server"] for r in rounds]
    return cpu_per_job(
        statistics.fmean(r["process"] or 0.0 for r in rounds),
        None if None in servers else statistics.fmean(s or 0.0 for s in servers),
    )


def summary(name: str, values: list[float]) -> str:
    return (
        f"{name}: p50 {statistics.median(values):.2f} ms, p90 {percentile(values, 90):.2f} ms, "
        f"p99 {percentile(values, 99):.2f} ms, max {max(values):.2f} ms ({len(values)} samples)"
    )


Measure = Callable[[str, int, CpuMeter], Awaitable[list[float]]]
#: The in-process runs of 1.: the schema each one's database holds, and the run.
IN_PROCESS: dict[str, tuple[Literal["procrastinate", "orchestrator"], Measure]] = {
    RAW: ("procrastinate", in_process_raw),
    ORC: ("orchestrator", in_process_orchestrator),
}


def measure_in_process(
    name: str, samples: int, *, breakdown: bool, times: FunctionTimes, meter: CpuMeter
) -> list[float]:
    """One run of 1. for ``name``, on a fresh database of its own."""
    schema, measure = IN_PROCESS[name]
    with fresh_database(schema=schema) as dsn:
        if not breakdown:
            return asyncio.run(measure(dsn, samples, meter))
        track_functions(dsn)
        return server_time(dsn, lambda: asyncio.run(measure(dsn, samples, meter)), times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=1000, help="per system and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", metavar="DSN")
    parser.add_argument("--breakdown", action="store_true", help="server time per SQL function")
    args = parser.parse_args()
    if args.worker:
        asyncio.run(run_worker(args.worker))
        return
    with fresh_database(schema=None) as dsn:
        print(f"machine: {machine()}, PostgreSQL {asyncio.run(server_version(dsn))}")
        breakdown = args.breakdown
        if breakdown:
            try:
                track_functions(dsn)
            except psycopg.Error as exc:
                print(f"breakdown: not measured ({str(exc).strip()})")
                breakdown = False
    latencies: dict[str, list[float]] = {RAW: [], ORC: [], GRAPHILE_WORKER: []}
    p50s: dict[str, list[float]] = {name: [] for name in latencies}
    times: dict[str, FunctionTimes] = {name: {} for name in IN_PROCESS}
    meters = {name: CpuMeter() for name in IN_PROCESS}
    graphile_version, graphile_missing = "", ""
    graphile_cpu: list[dict[str, float | None]] = []
    for _ in range(args.rounds):  # interleaved, so that the machine's drift touches all alike
        for name in IN_PROCESS:
            run = measure_in_process(
                name, args.samples, breakdown=breakdown, times=times[name], meter=meters[name]
            )
            latencies[name] += run
            p50s[name].append(statistics.median(run))
        if graphile_missing:
            continue
        try:
            graphile_version, run, cpu = graphile_worker(args.samples)
        except RuntimeError as exc:
            graphile_missing = str(exc)
        else:
            latencies[GRAPHILE_WORKER] += run
            graphile_cpu.append(cpu)
            p50s[GRAPHILE_WORKER].append(statistics.median(run))
    print(
        f"1. submit -> start, Graphile's method (in process, back to back, concurrency 1; "
        f"{args.rounds} rounds, each system on a fresh database of its own every round)"
    )
    orc = statistics.median(latencies[ORC])
    for name, values in latencies.items():
        label = f"{name} {graphile_version}" if name == GRAPHILE_WORKER else f"{name:<17}"
        if not values:
            print(f"   {label}: not measured ({graphile_missing})")
            continue
        rounds = " / ".join(f"{p50:.2f}" for p50 in p50s[name])
        print(f"   {summary(label, values)}; p50 by round {rounds}")
        if name in meters:
            print(f"     {meters[name].per_job()}")
        elif graphile_cpu:
            print(f"     {graphile_per_job(graphile_cpu)}")
        if breakdown and name in times:
            for line in breakdown_lines(times[name], len(values) + args.rounds * WARM_UP):
                print("     " + line)
        if name != ORC:
            print(
                f"     ratio of p50s (orchestrator / {name}): {orc / statistics.median(values):.2f}"
            )
    print("   targets p50 <= 2 ms, p99 <= 10 ms (the issue's Graphile figures: 1.7 / 8 ms)")
    with fresh_database() as dsn, worker_process(dsn):
        starts, late = asyncio.run(cross_process(dsn, max(100, args.samples // 3)))
    print("2. submit -> start, worker in another process, 25 ms idle before each submit")
    print("   " + summary("orchestrator", starts))
    print("3. " + summary("retry start after due", late) + "  (target p50 <= 100 ms)")


if __name__ == "__main__":
    main()
