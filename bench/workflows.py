"""Workflows (docs/workflows.md): what a graph costs on top of its jobs.

    ./dev bench workflows [--rounds 3] [--pairs 300] [--chain 1000] [--children 10000]

Each part runs ``--rounds`` times, each round on a fresh database, and prints the median of
the rounds with their spread (min-max), with the goal and the baseline it is a ratio of:

1. unblock latency: a parent and a child that depends on it, submitted together, one pair at a
   time, on an in-process worker of 2 slots; the child's start (its ``job.running``, written by
   its claim) after its parent's end (its ``job.completed``), both stamped by the database's
   clock as they are written (``clock_timestamp()``: a claim in the completion's own statement
   counts from the completion's row, not from the transaction's start). Goal: p50 <= 10 ms.
2. fan-in resume: a planner spawns ``--children`` no-op children and waits for them
   (``step.wait_for``), holding no slot; its resumed attempt's start after the last child's
   end. Goal: <= 1 s (5x Temporal's cap of 2,000 pending children at the default 10,000).
3. a chain: ``--chain`` jobs, each depending on the one before, submitted in one batch, against
   as many independent jobs, both on a worker of 1 slot (a chain runs one job at a time
   whatever the slots: the same single slot is the fair baseline) and on the default 10 (the
   independent jobs' best); the chain's rate over each. Goal: >= 0.5 of the independent jobs'
   rate on one slot.
4. fan-out: a parent whose end releases ``--children`` children (each depends on it): the wall
   time of the transaction that ends it, from its UPDATE to its COMMIT, after which every
   child is claimable. Goal: <= 1 s.

Jobs without dependencies are measured by ``./dev bench paired`` against the release before.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import psycopg
from pydantic import BaseModel

from bench.common import fresh_database, machine, percentile, quiet_orchestrator, server_version
from orchestrator import JobContext, Orchestrator, Settings


class Spread(BaseModel):
    name: str
    values: list[float]

    def median(self) -> float:
        return statistics.median(self.values)

    def __str__(self) -> str:
        return (
            f"{self.median():.2f} (rounds {min(self.values):.2f}-{max(self.values):.2f}, "
            f"n={len(self.values)})"
        )


def application(dsn: str, concurrency: int = 10) -> Orchestrator:
    orc = Orchestrator(settings=Settings(worker_concurrency=concurrency), dsn=dsn)

    @orc.job_type("noop")
    async def noop(ctx: JobContext, payload: Any) -> None:
        return None

    @orc.job_type("fan_in")
    async def fan_in(ctx: JobContext, payload: dict[str, int]) -> int:
        async for step in ctx.steps():
            children = await step.spawn([{"job_type": "noop"}] * payload["children"])
            await step.wait_for(children)
            await step.checkpoint(None, final=True)
        return payload["children"]

    return orc


@contextlib.asynccontextmanager
async def working(orc: Orchestrator) -> AsyncIterator[None]:
    """A worker of ``orc`` in this process while the block runs, drained after it."""
    worker = asyncio.create_task(orc.run_worker(install_signal_handlers=False))
    try:
        yield
    finally:
        orc.stop_worker()
        await worker


async def until(condition: Callable[[], Awaitable[bool]], within: float = 600) -> None:
    deadline = time.monotonic() + within
    while not await condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the bench's jobs did not finish")
        await asyncio.sleep(0.01)


async def unfinished(conn: psycopg.AsyncConnection[Any]) -> int:
    cur = await conn.execute("SELECT count(*) FROM orc_jobs WHERE finished_at IS NULL")
    (n,) = await cur.fetchone() or (0,)
    return int(n)


async def unblock_latency(dsn: str, pairs: int) -> list[float]:
    """Milliseconds from each parent's end to its child's start."""
    orc = application(dsn, concurrency=2)
    async with orc, await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        async with working(orc):
            for _ in range(pairs):
                _, child = await orc.submit_many(
                    [{"job_type": "noop"}, {"job_type": "noop", "depends_on": [0]}]
                )
                await until(functools.partial(_finished, conn, child))
        cur = await conn.execute(
            "SELECT extract(epoch FROM r.at - e.at) * 1000 FROM orc_job_dependencies AS d"
            "  JOIN orc_job_events AS e ON e.job_id = d.awaited_id AND e.kind = 'job.completed'"
            "  JOIN orc_job_events AS r ON r.job_id = d.job_id AND r.kind = 'job.running'"
        )
        return [float(row[0]) for row in await cur.fetchall()]


async def _finished(conn: psycopg.AsyncConnection[Any], job_id: Any) -> bool:
    cur = await conn.execute(
        "SELECT finished_at IS NOT NULL FROM orc_jobs WHERE id = %s", (job_id,)
    )
    row = await cur.fetchone()
    return bool(row and row[0])


async def fan_in_resume(dsn: str, children: int) -> float:
    """Seconds from the last child's end to the planner's resumed start."""
    orc = application(dsn)
    async with orc, await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        planner = await orc.submit("fan_in", {"children": children})
        async with working(orc):
            await until(functools.partial(_finished, conn, planner))
        cur = await conn.execute(
            "SELECT extract(epoch FROM (SELECT max(e.at) FROM orc_job_events AS e"
            "                            WHERE e.job_id = %s AND e.kind = 'job.running')"
            "       - (SELECT max(j.finished_at) FROM orc_jobs AS j WHERE j.job_type = 'noop'))",
            (planner,),
        )
        (seconds,) = await cur.fetchone() or (None,)
        job = await orc.get_job(planner)
        assert job.status.value == "COMPLETED", job.last_error
        return float(seconds)


async def drained(dsn: str, jobs: int, *, chain: bool, concurrency: int) -> float:
    """Jobs per second: ``jobs`` no-ops, a chain or independent, from the worker's start to
    the last one's end."""
    orc = application(dsn, concurrency=concurrency)
    specs = [
        {"job_type": "noop", **({"depends_on": [n - 1]} if chain and n else {})}
        for n in range(jobs)
    ]
    async with orc, await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for start in range(0, jobs, 1000):  # a chain's links reach back into the same batch
            assert not chain or jobs <= 1000, "a chain is submitted in one batch"
            await orc.submit_many(specs[start : start + 1000])
        started = time.perf_counter()
        async with working(orc):
            await until(lambda: _none_left(conn))
        return jobs / (time.perf_counter() - started)


async def _none_left(conn: psycopg.AsyncConnection[Any]) -> bool:
    return await unfinished(conn) == 0


async def fan_out(dsn: str, children: int) -> float:
    """Seconds of the transaction that ends a parent of ``children`` (UPDATE to COMMIT)."""
    orc = application(dsn)
    async with orc, await psycopg.AsyncConnection.connect(dsn) as conn:
        parent = await orc.submit("noop")
        for start in range(0, children, 1000):
            await orc.submit_many(
                [{"job_type": "noop", "depends_on": [parent]}] * min(1000, children - start)
            )
        await conn.execute(
            "UPDATE orc_jobs SET status = 'RUNNING', lease_token = gen_random_uuid() WHERE id = %s",
            (parent,),
        )
        await conn.commit()
        started = time.perf_counter()
        await conn.execute(
            "UPDATE orc_jobs SET status = 'COMPLETED', lease_token = NULL WHERE id = %s", (parent,)
        )
        await conn.commit()
        seconds = time.perf_counter() - started
        cur = await conn.execute(
            "SELECT count(*) FROM procrastinate_jobs WHERE status = 'todo' AND lock <> %s",
            (str(parent),),
        )
        assert (await cur.fetchone() or (0,))[0] == children, "every child has its dispatch"
        return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=300)
    parser.add_argument("--chain", type=int, default=1000)
    parser.add_argument("--children", type=int, default=10_000)
    args = parser.parse_args()
    quiet_orchestrator()
    p50s, p90s, resumes, outs = [], [], [], []
    chain_1, free_1, chain_10, free_10 = [], [], [], []
    for round_ in range(1, args.rounds + 1):
        with fresh_database("orc_bench_wf") as dsn:
            if round_ == 1:
                print(f"machine: {machine()}, PostgreSQL {asyncio.run(server_version(dsn))}")
            latencies = asyncio.run(unblock_latency(dsn, args.pairs))
            p50s.append(statistics.median(latencies))
            p90s.append(percentile(latencies, 90))
        with fresh_database("orc_bench_wf") as dsn:
            resumes.append(asyncio.run(fan_in_resume(dsn, args.children)))
        for rates, chain, slots in (
            (chain_1, True, 1), (free_1, False, 1), (chain_10, True, 10), (free_10, False, 10),
        ):  # fmt: skip
            with fresh_database("orc_bench_wf") as dsn:
                rates.append(asyncio.run(drained(dsn, args.chain, chain=chain, concurrency=slots)))
        with fresh_database("orc_bench_wf") as dsn:
            outs.append(asyncio.run(fan_out(dsn, args.children)))
        print(f"round {round_} done", flush=True)
    print(
        f"1. a child's start after its parent's end, ms: p50 {Spread(name='', values=p50s)}, "
        f"p90 {Spread(name='', values=p90s)} (goal: p50 <= 10 ms; {args.pairs} pairs a round)"
    )
    print(
        f"2. a planner of {args.children:,} children resumed after the last ended, s: "
        f"{Spread(name='', values=resumes)} (goal: <= 1 s)"
    )
    ratio_1 = [c / f for c, f in zip(chain_1, free_1, strict=True)]
    ratio_10 = [c / f for c, f in zip(chain_10, free_10, strict=True)]
    print(
        f"3. a chain of {args.chain:,}, jobs/s: {Spread(name='', values=chain_1)} on 1 slot, "
        f"{Spread(name='', values=chain_10)} on 10; {args.chain:,} independent jobs: "
        f"{Spread(name='', values=free_1)} on 1 slot, {Spread(name='', values=free_10)} on 10; "
        f"chain / independent: {Spread(name='', values=ratio_1)} on 1 slot (goal >= 0.5), "
        f"{Spread(name='', values=ratio_10)} against 10 slots"
    )
    print(
        f"4. a parent's end releasing {args.children:,} children, s (UPDATE to COMMIT): "
        f"{Spread(name='', values=outs)} (goal: <= 1 s)"
    )


if __name__ == "__main__":
    main()
