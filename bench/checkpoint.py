"""Checkpoint write: one step's commit point, with the results of its side effects.

    ./dev bench checkpoint [--samples 1000] [--effects 2]

A job is claimed (RUNNING, with a lease); each sample records ``--effects`` side effects as
pending (not timed: they happen before the calls), then times ``Ledger.checkpoint``: the
checkpoint row, those ledger rows committed with their results, and a job.checkpointed event,
fenced by the lease. Target: one round trip, p50 <= 2 ms. The round trips are counted, not
assumed: the store used here counts the statements it sends (autocommit: one statement, one
round trip).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from bench.common import fresh_database, machine, percentile, server_version
from checkpoints import CheckpointStore, Fence, Ledger
from orchestrator import JobContext, Orchestrator, Settings
from orchestrator.storage.runner import Queries, Row


class CountingQueries(Queries):
    """The query runner, counting the statements it sends."""

    statements = 0

    async def rows(self, name: Any, params: Any = None, conn: Any = None) -> list[Row]:
        self.statements += 1
        return await super().rows(name, params, conn)

    async def row(self, name: Any, params: Any = None, conn: Any = None) -> Row | None:
        self.statements += 1
        return await super().row(name, params, conn)

    async def execute(self, name: Any, params: Any = None, conn: Any = None) -> int:
        self.statements += 1
        return await super().execute(name, params, conn)


async def measure(dsn: str, samples: int, effects: int) -> tuple[list[float], float]:
    orc = Orchestrator(settings=Settings(), dsn=dsn)

    @orc.job_type("stepper")
    async def stepper(ctx: JobContext, payload: None) -> None:
        return None

    async with orc:
        job_id = await orc.submit("stepper")
        async with orc.stores.queries.pool.connection() as conn:
            await conn.execute(
                "UPDATE orc_jobs SET status = 'RUNNING', lease_token = gen_random_uuid(), "
                "attempt = 1 WHERE id = %s",
                (job_id,),
            )
        lease = (await orc.get_job(job_id)).lease_token
        assert lease is not None
        counting = CountingQueries(orc.stores.queries.pool)
        ledger = Ledger(CheckpointStore(counting), Fence(job_id, lease, 1), [])
        state: dict[str, Any] = {"notes": ["a line of state"] * 5}
        latencies = []
        statements = 0
        for step in range(1, samples + 1):
            for k in range(effects):
                await ledger.effect(
                    step=step, key=f"e{k}", name="send", args={"k": k}, idempotent=True,
                    reconcile=None, result_type=Any, commit_now=False,
                    call=_receipt,
                )  # fmt: skip
            before = counting.statements
            started = time.perf_counter()
            await ledger.checkpoint(step, state, final=False)
            latencies.append((time.perf_counter() - started) * 1_000)
            statements += counting.statements - before
    return latencies, statements / samples


async def _receipt(invocation_id: str) -> dict[str, str]:
    return {"receipt": invocation_id}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--effects", type=int, default=2)
    args = parser.parse_args()
    with fresh_database() as dsn:
        print(f"machine: {machine()}, PostgreSQL {asyncio.run(server_version(dsn))}")
        latencies, per_write = asyncio.run(measure(dsn, args.samples, args.effects))
    print(
        f"checkpoint write with {args.effects} ledger rows: p50 {statistics.median(latencies):.2f} "
        f"ms, p90 {percentile(latencies, 90):.2f} ms, p99 {percentile(latencies, 99):.2f} ms "
        f"({args.samples} samples); {per_write:g} round trip(s) per write "
        "(target: one round trip, p50 <= 2 ms)"
    )


if __name__ == "__main__":
    main()
