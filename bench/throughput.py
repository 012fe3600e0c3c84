"""Throughput: the orchestrator against raw Procrastinate and Graphile Worker, in one run, on one
database server.

    ./dev bench throughput [--jobs 20000] [--concurrency 10] [--rounds 3]

Baselines: raw Procrastinate (same version), one worker process, the same concurrency, no-op
tasks, (a) with its default connection pool, which pings every connection it hands out, and
(b) on the orchestrator's pool, which pings only connections idle for over 5 s. The ratio is
taken against the faster baseline. Each side drains N jobs that were queued beforehand; the
tables are ANALYZEd after they are filled (a freshly filled table without statistics runs
about 3x slower, for every side). The orchestrator's figure is submit -> terminal for
application jobs: claim (with its event), run, COMPLETED (with its event) together with
Procrastinate's finish, each job locked on its id. Its worker fetches one dispatch per free slot
in one statement and writes completions that arrive together in one statement (group commit);
raw Procrastinate fetches and finishes one job per statement. Each worker runs in its own
process. Both run on the orchestrator's schema, where Procrastinate's triggers that copy status
changes into procrastinate_events are off (migration 0009): the raw baseline is that much
faster than Procrastinate as shipped, so the ratio is, if anything, understated.

Graphile Worker itself (bench/graphile/throughput.js, the pinned graphile-worker 0.17.3 in a
Node.js process of its own, on a database of its own holding only its schema) drains the same N
no-op jobs with the same concurrency, the way its own perfTest times it: queued beforehand
(addJobs, 1000 per call, then ANALYZE), then ``runOnce`` (its worker pool, stopping when the
queue is empty), NO_LOG_SUCCESS=1, a pool of concurrency + 1 connections opened before the clock
starts; timed until every job is done (the run has returned and graphile_worker.jobs is empty).
Twice: with its default options (one job fetched and one completed per statement; a worker does
not wait for its job's completion before fetching the next), and batched, with the batching
options of its documented performance set-up: ``localQueue: {size: 500}`` (500 jobs fetched and
locked at once, handed out locally), ``completeJobBatchDelay: 0`` and ``failJobBatchDelay: 0``
(completions and failures that arrive together written in one statement). It needs Node.js and
npm; graphile-worker is installed into bench/graphile when it is missing, and without them the
bench says why it skipped it. All sides take turns, ``--rounds`` times (the machine's speed
drifts within minutes), and medians are compared.

Also printed: submit throughput, single and batched, against Procrastinate's defer.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import statistics
import subprocess
import sys
import time

import procrastinate
import psycopg

from bench.common import fresh_database, machine, quiet_orchestrator, run_graphile, server_version
from orchestrator import JobContext, Orchestrator, Settings
from orchestrator.storage.database import create_pool

SIDES = ["raw", "raw-our-pool", "orc", "orc-no-metrics"]
#: Graphile Worker's runs (bench/graphile/throughput.js's modes), by their label in the output.
GRAPHILE_MODES = {"gw-default": "default", "gw-batched": "batched"}
TRUNCATE = (
    "TRUNCATE orc_job_events, orc_dead_letters, orc_jobs, procrastinate_events, "
    "procrastinate_periodic_defers, procrastinate_jobs, procrastinate_workers "
    "RESTART IDENTITY CASCADE"
)


def raw_app(dsn: str, *, our_pool: bool = False) -> procrastinate.App:
    connector = (
        procrastinate.PsycopgConnector(pool_factory=lambda **_: create_pool(dsn))
        if our_pool
        else procrastinate.PsycopgConnector(conninfo=dsn)
    )
    app = procrastinate.App(connector=connector)

    @app.task(name="noop")
    async def noop(i: int) -> None:
        return None

    return app


def orc_app(dsn: str, *, metrics: bool = True) -> Orchestrator:
    orc = Orchestrator(settings=Settings(metrics=metrics), dsn=dsn)

    @orc.job_type("noop")
    async def noop(ctx: JobContext, payload: int) -> None:
        return None

    return orc


async def reset(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(TRUNCATE)


async def analyze(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("ANALYZE orc_jobs; ANALYZE orc_job_events; ANALYZE procrastinate_jobs")


async def fill_raw(dsn: str, n: int) -> None:
    app = raw_app(dsn)
    async with app.open_async():
        task = app.tasks["noop"]
        for start in range(0, n, 1000):
            await task.batch_defer_async(*({"i": i} for i in range(start, min(n, start + 1000))))


async def fill_orc(dsn: str, n: int) -> None:
    async with orc_app(dsn) as orc:
        for start in range(0, n, 1000):
            await orc.submit_many(
                {"job_type": "noop", "payload": i} for i in range(start, min(n, start + 1000))
            )


def drain(side: str, dsn: str, concurrency: int) -> float:
    """Run one worker process until the queue is empty; return its wall time for the jobs."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.throughput", "--drain", side, "--dsn", dsn,
         "--concurrency", str(concurrency)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


async def drain_here(side: str, dsn: str, concurrency: int) -> float:
    if side in ("raw", "raw-our-pool"):
        app = raw_app(dsn, our_pool=side == "raw-our-pool")
        async with app.open_async():
            started = time.perf_counter()
            await app.run_worker_async(
                concurrency=concurrency, wait=False, install_signal_handlers=False
            )
            return time.perf_counter() - started
    quiet_orchestrator()
    async with orc_app(dsn, metrics=side == "orc") as orc:
        started = time.perf_counter()
        await orc.run_worker(concurrency=concurrency, wait=False, install_signal_handlers=False)
        return time.perf_counter() - started


def graphile_drain(mode: str, dsn: str, jobs: int, concurrency: int) -> tuple[str, str, float]:
    """Graphile Worker's run on ``dsn``'s database: (its version, the worker options the mode
    sets, seconds for the jobs). Raises RuntimeError saying why it could not be measured."""
    result = run_graphile(
        "throughput.js", [str(jobs), str(concurrency), mode], dsn, timeout=max(600, jobs / 20)
    )
    options = json.dumps(result["options"], separators=(", ", ": ")) if result["options"] else ""
    return str(result["version"]), options, float(result["seconds"])


async def count_done(dsn: str, side: str) -> int:
    query = (
        "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
        if side.startswith("raw")
        else "SELECT count(*) FROM orc_jobs WHERE status = 'COMPLETED'"
    )
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        row = await (await conn.execute(query)).fetchone()
        return int(row[0]) if row else 0


async def submit_rates(dsn: str, n_single: int, n_batch: int) -> dict[str, float]:
    rates: dict[str, float] = {}
    app = raw_app(dsn)
    async with app.open_async():
        task = app.tasks["noop"]
        await reset(dsn)
        t = time.perf_counter()
        for i in range(n_single):
            await task.defer_async(i=i)
        rates["procrastinate defer (single)"] = n_single / (time.perf_counter() - t)
        await reset(dsn)
        t = time.perf_counter()
        for start in range(0, n_batch, 1000):
            await task.batch_defer_async(*({"i": i} for i in range(start, start + 1000)))
        rates["procrastinate defer (batch 1000)"] = n_batch / (time.perf_counter() - t)
    async with orc_app(dsn) as orc:
        await reset(dsn)
        t = time.perf_counter()
        for i in range(n_single):
            await orc.submit("noop", i)
        rates["orchestrator submit (single)"] = n_single / (time.perf_counter() - t)
        await reset(dsn)
        t = time.perf_counter()
        for start in range(0, n_batch, 1000):
            await orc.submit_many(
                {"job_type": "noop", "payload": i} for i in range(start, start + 1000)
            )
        rates["orchestrator submit (batch 1000)"] = n_batch / (time.perf_counter() - t)
    await reset(dsn)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=20_000, help="per side and round")
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--drain", choices=SIDES)
    parser.add_argument("--dsn")
    args = parser.parse_args()
    if args.drain:  # child process: one worker
        print(asyncio.run(drain_here(args.drain, args.dsn, args.concurrency)))
        return

    with fresh_database() as dsn, fresh_database("graphile_bench", schema=None) as graphile_dsn:
        print(f"machine: {machine()}, PostgreSQL {asyncio.run(server_version(dsn))}")
        print(f"procrastinate {importlib.metadata.version('procrastinate')}")
        print(f"{args.jobs} no-op jobs per side, 1 worker process each, "
              f"concurrency {args.concurrency}; tables ANALYZEd after each fill")  # fmt: skip
        results: dict[str, list[float]] = {side: [] for side in [*SIDES, *GRAPHILE_MODES]}
        graphile_version, graphile_missing = "", ""
        graphile_options: dict[str, str] = {}
        for round_no in range(1, args.rounds + 1):
            for side in SIDES:
                fill = fill_orc if side.startswith("orc") else fill_raw
                asyncio.run(reset(dsn))
                asyncio.run(fill(dsn, args.jobs))
                asyncio.run(analyze(dsn))
                seconds = drain(side, dsn, args.concurrency)
                done = asyncio.run(count_done(dsn, side))
                assert done == args.jobs, f"{side}: {done}/{args.jobs} jobs finished"
                rate = args.jobs / seconds
                results[side].append(rate)
                print(f"  round {round_no} {side:>12}: {rate:7.0f} jobs/s ({seconds:.2f}s)")
            for side, mode in GRAPHILE_MODES.items():
                if graphile_missing:
                    break
                try:
                    graphile_version, graphile_options[side], seconds = graphile_drain(
                        mode, graphile_dsn, args.jobs, args.concurrency
                    )
                except RuntimeError as exc:
                    graphile_missing = str(exc)
                    break
                rate = args.jobs / seconds
                results[side].append(rate)
                print(f"  round {round_no} {side:>12}: {rate:7.0f} jobs/s ({seconds:.2f}s)")
        medians = {side: statistics.median(rates) for side, rates in results.items() if rates}
        baseline = max(medians["raw"], medians["raw-our-pool"])
        print(
            f"end-to-end (median of {args.rounds} rounds): raw Procrastinate "
            f"{medians['raw']:.0f} jobs/s (default pool), {medians['raw-our-pool']:.0f} jobs/s "
            f"(our pool); orchestrator {medians['orc']:.0f} jobs/s; ratio "
            f"{medians['orc'] / baseline:.2f} against the faster baseline (goal >= 1.2)"
        )
        print(
            f"metrics: orchestrator {medians['orc']:.0f} jobs/s with them, "
            f"{medians['orc-no-metrics']:.0f} jobs/s without (ORCHESTRATOR_METRICS=false); ratio "
            f"{medians['orc'] / medians['orc-no-metrics']:.3f} (target >= 0.97)"
        )
        if graphile_missing or not all(side in medians for side in GRAPHILE_MODES):
            print(f"Graphile Worker: not measured ({graphile_missing})")
        else:
            default, batched = medians["gw-default"], medians["gw-batched"]
            print(
                f"Graphile Worker {graphile_version} (gw-*: its own Node.js process, runOnce; "
                f"median of {args.rounds} rounds): default options {default:.0f} jobs/s, "
                f"batched {graphile_options['gw-batched']} {batched:.0f} jobs/s"
            )
            print(
                f"ratio orchestrator / Graphile Worker: {medians['orc'] / default:.2f} (default; "
                f"goal >= 0.4), {medians['orc'] / batched:.2f} (batched)"
            )
        rates = asyncio.run(submit_rates(dsn, n_single=2000, n_batch=10_000))
        for name, rate in rates.items():
            print(f"  {name:<36} {rate:8.0f} jobs/s")
        ratio = (
            rates["orchestrator submit (batch 1000)"] / rates["procrastinate defer (batch 1000)"]
        )
        print(f"batch submit ratio {ratio:.2f} (target >= 0.50)")


if __name__ == "__main__":
    main()
