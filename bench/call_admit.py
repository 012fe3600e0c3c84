"""The paired bench of an admitted call: what ``ctx.admit_call`` costs per call, the release
before against this one (issue 45: a call admitted in one statement).

    ./dev bench call_admit [--base REF] [--head REF] [--calls 1000] [--pairs 5]
                           [--history 100000]

Measured, per admitted call: the wall time, the server's CPU time (its processes serving the
database, read from /proc) and the round trips to PostgreSQL. Each side is a commit
(``--base`` default ``HEAD``, ``--head`` default the working tree), its code extracted, its own
database migrated by that code and planted with ``--history`` finished jobs, as
bench/paired.py does. A run is a child process of the side's code, using only the stable
public API: one job of a type under a limit whose window (``requests`` and ``units`` per 60 s)
is far larger than the run, so that every call goes at once; its task admits one call (the
first takes the claim's reservation: not measured), then ``--calls`` calls of
``await ctx.admit_call(units=1)``, timed. Each run's key is new (``bench:{payload.run}``), so a
run's window holds only its own calls' spends, up to ``--calls`` of them. Two limits: ``plain``
(``share_by = "tenant"``, the default, no cap) and ``tenant_share`` (``tenant_share = 0.5``:
the tenant's own spends are read and capped as well).

The child stops before and after its timed calls (it prints ``start`` / ``stop`` and waits for
this process's go-ahead), and this process reads the server's CPU there, so that the child's
start, its job's claim and its end are not counted. Round trips are counted by a proxy between
the child and PostgreSQL (bench/round_trips.py: the client's Query and Sync messages), over the
same stretch, less those of a stretch as long without a call that follows it (the worker's own
statements, its heartbeat ..., one or two a second). The proxy adds a hop to each round trip, so the
runs that count them (one per side and limit, first) are not timed; the timed runs connect
directly.

The timed runs come in pairs, one per side, the side that goes first alternating from pair to
pair; the verdict is the median of the paired differences (head - base) with their spread
(bench/paired.py's), for the wall time, the server's CPU time and the caller's, and the ratios
head/base.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.common import backend_cpu
from bench.paired import Side, child_env, planted, sides_parser, summary
from bench.round_trips import Proxy

LIMITS = ("plain", "tenant_share")

#: The retry config of a run: one limit, its window never full.
CONFIG = """
[limits.bench]
key = "bench:{{payload.run}}"
requests = 100000000
units = 2000000000
interval_seconds = 60
share_by = "tenant"
{share}
[job_types.caller]
limit = "bench"
"""

#: One run, as ``python -c CALLER DSN CONFIG CALLS IDLE`` in a side's root: that side's code runs
#: one job that admits CALLS calls, stopping before and after them for the bench's readings (it
#: prints ``start`` / ``stop`` and waits for ``go`` on its stdin); with IDLE ``idle``, then as
#: long again without a call, between ``idle`` and ``idle-end``. The last line printed: the
#: calls' wall seconds and this process's CPU seconds over them.
CALLER = """
import asyncio, json, logging, sys, time, uuid
from pathlib import Path

import orchestrator
from orchestrator import JobContext, Orchestrator, Settings

assert Path(orchestrator.__file__).resolve().is_relative_to(Path.cwd().resolve()), (
    f"imported {orchestrator.__file__}, not the code in {Path.cwd()}"
)


def handshake(word: str) -> None:
    print(word, flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit(f"the bench did not answer {word!r}")


async def main(dsn: str, config: str, calls: int, idle: bool) -> dict[str, float]:
    logging.getLogger("orchestrator").setLevel(logging.WARNING)
    orc = Orchestrator(settings=Settings(), dsn=dsn, retry_config_path=Path(config))
    timed: dict[str, float] = {}

    @orc.job_type("caller")
    async def caller(ctx: JobContext, payload: dict[str, str]) -> None:
        await ctx.admit_call(units=1)  # the first call takes the claim's reservation
        handshake("start")
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(calls):
            await ctx.admit_call(units=1)
        timed.update(seconds=time.perf_counter() - started, cpu=time.process_time() - cpu)
        handshake("stop")
        if idle:  # as long again without a call: the worker's own statements alone
            handshake("idle")
            await asyncio.sleep(timed["seconds"])
            handshake("idle-end")

    async with orc:
        job_id = await orc.submit("caller", {"run": uuid.uuid4().hex}, tenant_id="acme")
        await orc.run_worker(concurrency=1, wait=False, install_signal_handlers=False)
        job = await orc.get_job(job_id)
        kinds = [event.kind for event in await orc.job_events(job_id)]
    if job.status != "COMPLETED" or job.attempt != 1 or "job.waiting_for_capacity" in kinds:
        raise SystemExit(
            f"the job did not admit its calls at once in one attempt: {job.status}, "
            f"attempt {job.attempt}, events {kinds}"
        )
    return timed


dsn, config, calls, idle = sys.argv[1:]
print(json.dumps(asyncio.run(main(dsn, config, int(calls), idle == "idle"))))
"""


@dataclass(frozen=True)
class Run:
    """One run's figures per admitted call."""

    wall: float  # µs
    process_cpu: float  # µs, the child's
    server_cpu: float | None  # µs; None: the server is not on this machine
    round_trips: float | None  # None: not counted (a timed run)
    background: float | None  # of them, the worker's own (the idle stretch's); None: idem


def config_file(limit: str, tmp: Path) -> Path:
    path = tmp / f"retry_config_{limit}.toml"
    share = "tenant_share = 0.5\n" if limit == "tenant_share" else ""
    path.write_text(CONFIG.format(share=share))
    return path


def server_seconds(before: dict[int, int] | None, after: dict[int, int] | None) -> float | None:
    if before is None or after is None:
        return None
    return sum(ns - before.get(pid, 0) for pid, ns in after.items()) / 1e9


def run(side: Side, config: Path, calls: int, proxy: Proxy | None = None) -> Run:
    """One run of ``calls`` admitted calls by the side's code; through ``proxy`` if given."""
    dsn = side.dsn if proxy is None else proxy.client_dsn(side.dsn)
    with tempfile.TemporaryFile("w+") as stderr:
        child = subprocess.Popen(
            [sys.executable, "-c", CALLER, dsn, str(config), str(calls), "idle" if proxy else "-"],
            cwd=side.root, env={**child_env(side), "DATABASE_URL": dsn}, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
        )  # fmt: skip
        assert child.stdin is not None and child.stdout is not None
        readings: dict[str, tuple[dict[int, int] | None, int]] = {}
        last = ""
        for line in child.stdout:
            last = line.strip()
            if last in ("start", "stop", "idle", "idle-end"):
                cpu = asyncio.run(backend_cpu(side.dsn))
                readings[last] = (cpu, proxy.round_trips() if proxy else 0)
                child.stdin.write("go\n")
                child.stdin.flush()
        if child.wait(timeout=600) != 0 or not {"start", "stop"} <= set(readings):
            stderr.seek(0)
            raise SystemExit(f"{side.name}: the run failed: {stderr.read().strip()[-800:]}")
    timed = json.loads(last)
    (cpu_before, trips_before), (cpu_after, trips_after) = readings["start"], readings["stop"]
    server = server_seconds(cpu_before, cpu_after)
    idle = None if proxy is None else readings["idle-end"][1] - readings["idle"][1]
    return Run(
        timed["seconds"] / calls * 1e6, timed["cpu"] / calls * 1e6,
        None if server is None else server / calls * 1e6,
        None if proxy is None else (trips_after - trips_before) / calls,
        None if idle is None else idle / calls,
    )  # fmt: skip


def count(sides: tuple[Side, Side], configs: dict[str, Path], calls: int) -> None:
    """Round trips per admitted call, each side once per limit, through the proxy: those of
    the timed stretch less those of the idle one (the worker's own)."""
    for limit, config in configs.items():
        net, seen = {}, {}
        for side in sides:
            with Proxy(side.dsn).running() as proxy:
                counted = run(side, config, calls, proxy)
            seen[side.name] = (counted.round_trips or 0.0, counted.background or 0.0)
            net[side.name] = seen[side.name][0] - seen[side.name][1]
        base, head = net["base"], net["head"]
        ratio = f"{head / base:.3f}" if base else "-"
        raw = ", ".join(
            f"{name} {calls * t:.0f} - {calls * b:.0f}" for name, (t, b) in seen.items()
        )
        print(
            f"{limit}: round trips per admitted call: base {base:.2f}, head {head:.2f}, ratio "
            f"head/base {ratio} (the client's Query and Sync messages over {calls} calls, less "
            f"those of as long without a call: {raw})",
            flush=True,
        )


def pairs(
    sides: tuple[Side, Side], configs: dict[str, Path], args: argparse.Namespace
) -> dict[str, list[tuple[Run, Run]]]:
    """(base, head) runs of each pair and limit; odd pairs run base first."""
    results: dict[str, list[tuple[Run, Run]]] = {limit: [] for limit in configs}
    for pair in range(1, args.pairs + 1):
        order = sides if pair % 2 else sides[::-1]
        for limit, config in configs.items():
            runs = {s.name: run(s, config, args.calls) for s in order}
            b, h = runs["base"], runs["head"]
            cpu = "" if b.server_cpu is None or h.server_cpu is None else (
                f"; server CPU base {b.server_cpu:4.0f}, head {h.server_cpu:4.0f}, "
                f"delta {h.server_cpu - b.server_cpu:+4.0f}"
            )  # fmt: skip
            print(
                f"  pair {pair} ({order[0].name} first), {limit:>12}: wall base {b.wall:4.0f}, "
                f"head {h.wall:4.0f}, delta {h.wall - b.wall:+4.0f}{cpu} (µs/call)",
                flush=True,
            )
            results[limit].append((b, h))
    return results


def verdicts(results: dict[str, list[tuple[Run, Run]]]) -> None:
    for limit, runs in results.items():
        print(f"{limit}:")
        summary("  wall time", [(b.wall, h.wall) for b, h in runs], unit="call")
        if all(b.server_cpu is not None and h.server_cpu is not None for b, h in runs):
            server = [(b.server_cpu or 0.0, h.server_cpu or 0.0) for b, h in runs]
            summary("  server CPU time", server, unit="call")
        else:
            print("  server CPU time: not measured (the server is not on this machine)")
        summary("  caller's CPU time", [(b.process_cpu, h.process_cpu) for b, h in runs], "call")


def main() -> None:
    parser = sides_parser("the paired bench of an admitted call")
    parser.add_argument("--calls", type=int, default=1000, help="timed calls per run")
    args = parser.parse_args()
    if args.calls < 1 or args.pairs < 1:
        parser.error("--calls and --pairs must be at least 1")

    with planted(args, "orc_call_admit") as (base, head, tmp):
        print(
            f"history: {args.history} finished jobs planted per side; {args.calls} admitted "
            "calls per run (one job, one worker process, its window never full), limits: "
            "plain (share_by tenant), tenant_share (0.5)",
            flush=True,
        )
        configs = {limit: config_file(limit, tmp) for limit in LIMITS}
        count((base, head), configs, args.calls)
        verdicts(pairs((base, head), configs, args))


if __name__ == "__main__":
    main()
