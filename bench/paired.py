"""The paired bench against the release before: what a change costs per job, measured before it
lands.

    ./dev bench paired [--base REF] [--head REF] [--jobs 3000] [--pairs 5] [--history 100000]
                       [--concurrency 10]

Measured: the wall time per job of one worker process draining ``--jobs`` queued no-op jobs
(submit -> COMPLETED, ``--concurrency`` at once), with the head's code against the base's. The
baseline is the base commit (``--base``, default ``HEAD``: the last commit, the release before
the change in the working tree), on the same database server, in the same run. The head
(``--head``) defaults to the working tree itself, uncommitted changes included; a REF given
for either side is extracted with ``git archive`` into a temporary directory and run with this
interpreter, its root as the working directory, so that ``import orchestrator`` finds that
side's code. A change that costs 100 µs per job, or that turns a lookup into a scan, shows.

Each side has a database of its own on one server, migrated by its own code (``python -m
orchestrator migrate``), so each runs on the schema its release ships; both then get the same
planted history of ``--history`` finished jobs (bench/history.py, from this tree), which the
hot statements must stay indifferent to. A drain is a child process of that side's code,
using only the stable public API: it submits the jobs (1000 per call), ANALYZEs, and times
``run_worker(wait=False)`` until the queue is empty; every job is then checked COMPLETED. The
drains come in pairs, one per side, and the side that goes first alternates from pair to pair
(base first, then head first, ...): the machine's speed drifts within minutes, and a drift, or
the jobs earlier drains leave behind, then weighs on both sides alike. The verdict is the
median of the paired differences (head - base), with their spread, for wall time and for CPU
time (the worker process's and the server processes' together, read from /proc: steadier than
wall time on a machine that is busy with other work, since another process's load delays a
drain but does not add to its CPU time).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg

from bench.common import ROOT, fresh_database, machine, percentile, server_version
from bench.history import fill_history

#: One drain, run as ``python -c DRAIN DSN JOBS CONCURRENCY`` in a side's root: that side's
#: code submits the jobs and drains them. The last line printed: the drain's wall seconds, the
#: CPU seconds of this process and of the server's processes serving the database (read from
#: /proc before the worker's connections close; -1 when the server is not on this machine).
DRAIN = """
import asyncio, json, logging, sys, time
from pathlib import Path

import orchestrator, psycopg
from orchestrator import JobContext, Orchestrator, Settings

assert Path(orchestrator.__file__).resolve().is_relative_to(Path.cwd().resolve()), (
    f"imported {orchestrator.__file__}, not the code in {Path.cwd()}"
)


async def server_cpu(dsn: str) -> dict[int, int] | None:
    # Nanoseconds of CPU used so far by each server process serving the database (None: they
    # are not processes of this machine). Taken while the worker's pool is still open.
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT pid FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        pids = [row[0] for row in await cur.fetchall()]
    used = {}
    for pid in pids:
        try:
            if not Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"postgres"):
                return None
            used[pid] = int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])
        except FileNotFoundError:
            continue
        except (OSError, ValueError, IndexError):
            return None
    return used if used or not pids else None


def spent(before: dict[int, int] | None, after: dict[int, int] | None) -> float:
    if before is None or after is None:
        return -1.0
    return sum(ns - before.get(pid, 0) for pid, ns in after.items()) / 1e9


async def main(dsn: str, jobs: int, concurrency: int) -> dict[str, float]:
    logging.getLogger("orchestrator").setLevel(logging.WARNING)
    orc = Orchestrator(settings=Settings(), dsn=dsn)

    @orc.job_type("noop")
    async def noop(ctx: JobContext, payload: int) -> None:
        return None

    async with orc:
        for start in range(0, jobs, 1000):
            batch = range(start, min(jobs, start + 1000))
            await orc.submit_many({"job_type": "noop", "payload": i} for i in batch)
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            for table in ("orc_jobs", "orc_job_events", "procrastinate_jobs"):
                await conn.execute(f"ANALYZE {table}")
        server = await server_cpu(dsn)
        started, cpu = time.perf_counter(), time.process_time()
        await orc.run_worker(concurrency=concurrency, wait=False, install_signal_handlers=False)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        return {"seconds": seconds, "worker_cpu": cpu,
                "server_cpu": spent(server, await server_cpu(dsn))}


print(json.dumps(asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))))
"""


@dataclass
class Side:
    name: str  # "base" or "head"
    root: Path  # where its code is, the working directory of its processes
    commit: str  # what it is, for the report
    dsn: str = ""
    drains: int = 0


def git(*argv: str) -> str:
    run = subprocess.run(
        ["git", "-C", str(ROOT), *argv], capture_output=True, text=True, check=False
    )
    if run.returncode != 0:
        raise SystemExit(f"git {' '.join(argv)} failed: {run.stderr.strip()}")
    return run.stdout.strip()


def extract(ref: str, dest: Path) -> Path:
    """``ref``'s files (``git archive``) in ``dest``."""
    git_archive = ["git", "-C", str(ROOT), "archive", "--format=tar", ref]
    archive = subprocess.run(git_archive, capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"git archive {ref} failed: {archive.stderr.decode().strip()}")
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def checkout(name: str, ref: str | None, tmp: Path) -> Side:
    """The side of ``ref``, extracted into ``tmp``; without a ref, the working tree."""
    if ref is None:
        return Side(name, ROOT, f"working tree ({git('describe', '--dirty', '--always')})")
    return Side(name, extract(ref, tmp / name), git("log", "-1", "--format=%h %s", ref))


def child_env(side: Side) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(side.root), "DATABASE_URL": side.dsn}


def migrate(side: Side) -> None:
    """The side's schema, applied by its own ``orchestrator migrate``."""
    run = subprocess.run(
        [sys.executable, "-m", "orchestrator", "migrate"],
        cwd=side.root, env=child_env(side), capture_output=True, text=True, check=False,
    )  # fmt: skip
    if run.returncode != 0:
        raise SystemExit(f"{side.name}: orchestrator migrate failed: {run.stderr.strip()[-500:]}")


async def plant_history(side: Side, jobs: int) -> None:
    async with await psycopg.AsyncConnection.connect(side.dsn, autocommit=True) as conn:
        try:
            await fill_history(conn, jobs)
        except psycopg.Error as exc:
            why = str(exc).splitlines()[0]
            raise SystemExit(
                f"{side.name}: planting the history failed on its schema ({why}); "
                "an old base may lack a column bench/history.py writes: try --history 0"
            ) from exc


async def noop_counts(dsn: str) -> tuple[int, int]:
    """(COMPLETED, all) of the no-op jobs the drains submitted."""
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute(
            "SELECT count(*) FILTER (WHERE status = 'COMPLETED'), count(*)"
            " FROM orc_jobs WHERE job_type = 'noop'"
        )
        row = await cur.fetchone()
        return (int(row[0]), int(row[1])) if row else (0, 0)


@dataclass(frozen=True)
class Cost:
    """One drain's cost per job: wall time, and CPU time (the worker process and the server's
    processes together; None when the server is not on this machine)."""

    wall: float  # µs per job
    cpu: float | None  # µs per job


def drain(side: Side, jobs: int, concurrency: int) -> Cost:
    """One drain of ``jobs`` no-op jobs by the side's code."""
    run = subprocess.run(
        [sys.executable, "-c", DRAIN, side.dsn, str(jobs), str(concurrency)],
        cwd=side.root, env=child_env(side), capture_output=True, text=True, check=False,
        timeout=max(600, jobs / 10),
    )  # fmt: skip
    if run.returncode != 0:
        raise SystemExit(f"{side.name}: the drain failed: {run.stderr.strip()[-800:]}")
    side.drains += 1
    done, total = asyncio.run(noop_counts(side.dsn))
    expected = side.drains * jobs
    if done != expected or total != expected:
        raise SystemExit(f"{side.name}: {done} of {total} jobs COMPLETED, {expected} expected")
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    cpu = None if figures["server_cpu"] < 0 else figures["worker_cpu"] + figures["server_cpu"]
    return Cost(figures["seconds"] / jobs * 1e6, None if cpu is None else cpu / jobs * 1e6)


def pairs(base: Side, head: Side, args: argparse.Namespace) -> list[tuple[Cost, Cost]]:
    """(base, head) costs of each pair; odd pairs run base first."""
    results = []
    for pair in range(1, args.pairs + 1):
        order = (base, head) if pair % 2 else (head, base)
        costs = {s.name: drain(s, args.jobs, args.concurrency) for s in order}
        b, h = costs["base"], costs["head"]
        cpu = "" if b.cpu is None or h.cpu is None else (
            f"; CPU base {b.cpu:5.0f}, head {h.cpu:5.0f}, delta {h.cpu - b.cpu:+5.0f}"
        )  # fmt: skip
        print(
            f"  pair {pair} ({order[0].name} first): wall base {b.wall:5.0f}, head {h.wall:5.0f},"
            f" delta {h.wall - b.wall:+5.0f}{cpu} (µs/job)"
        )
        results.append((b, h))
    return results


def summary(measure: str, results: list[tuple[float, float]], unit: str = "job") -> None:
    """The verdict on one measure, in µs per ``unit``: the median of the paired deltas and
    their spread."""
    base = statistics.median(b for b, _ in results)
    head = statistics.median(h for _, h in results)
    deltas = [h - b for b, h in results]
    delta = statistics.median(deltas)
    iqr = (percentile(deltas, 25), percentile(deltas, 75))
    noise = "" if min(deltas) > 0 or max(deltas) < 0 else " (it includes 0: within the noise)"
    more = f"{delta:+.0f} µs/{unit} ({100 * delta / base:+.1f} %) more"
    less = f"{-delta:.0f} µs/{unit} ({-100 * delta / base:.1f} %) less"
    print(
        f"{measure}: base {base:.0f} µs/{unit}, head {head:.0f} µs/{unit} (medians of "
        f"{len(results)} pairs), ratio head/base {head / base:.3f}; head costs "
        f"{more if delta >= 0 else less} than base; paired deltas: min-max "
        f"[{min(deltas):+.0f}, {max(deltas):+.0f}], IQR [{iqr[0]:+.0f}, {iqr[1]:+.0f}]{noise}"
    )


def verdicts(results: list[tuple[Cost, Cost]]) -> None:
    summary("wall time", [(b.wall, h.wall) for b, h in results])
    if all(b.cpu is not None and h.cpu is not None for b, h in results):
        summary("CPU time", [(b.cpu or 0.0, h.cpu or 0.0) for b, h in results])
    else:
        print("CPU time: not measured (the server is not on this machine)")


@contextlib.contextmanager
def databases(*sides: Side, prefix: str = "orc_paired") -> Iterator[None]:
    """A fresh database per side (dropped afterwards), each migrated by its side's code."""
    with contextlib.ExitStack() as stack:
        for s in sides:
            s.dsn = stack.enter_context(fresh_database(f"{prefix}_{s.name}", schema=None))
            migrate(s)
        yield


def sides_parser(description: str) -> argparse.ArgumentParser:
    """The arguments of a paired bench: the two sides, the pairs, the planted history."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--base", default="HEAD", help="the baseline's commit (default HEAD)")
    parser.add_argument("--head", help="the measured commit (default: the working tree)")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--history", type=int, default=100_000, help="planted finished jobs")
    return parser


@contextlib.contextmanager
def planted(args: argparse.Namespace, prefix: str) -> Iterator[tuple[Side, Side, Path]]:
    """The base and the head of ``args``, each on a database of its own migrated by its code
    and planted with ``args.history`` finished jobs, the lines naming them printed; and a
    temporary directory, for the run's files."""
    with tempfile.TemporaryDirectory(prefix=f"{prefix}_") as tmp:
        base, head = checkout("base", args.base, Path(tmp)), checkout("head", args.head, Path(tmp))
        print(f"base: {base.commit}\nhead: {head.commit}")
        with databases(base, head, prefix=prefix):
            print(f"machine: {machine()}, PostgreSQL {asyncio.run(server_version(base.dsn))}")
            for s in (base, head):
                if args.history:
                    asyncio.run(plant_history(s, args.history))
            yield base, head, Path(tmp)


def main() -> None:
    parser = sides_parser("the paired bench against the release before")
    parser.add_argument("--jobs", type=int, default=3000, help="per drain")
    parser.add_argument("--concurrency", type=int, default=10)
    args = parser.parse_args()
    if args.jobs < 1 or args.pairs < 1:
        parser.error("--jobs and --pairs must be at least 1")

    with planted(args, "orc_paired") as (base, head, _):
        print(
            f"history: {args.history} finished jobs planted per side; {args.jobs} no-op "
            f"jobs per drain, 1 worker process, concurrency {args.concurrency}"
        )
        verdicts(pairs(base, head, args))


if __name__ == "__main__":
    main()
