"""Fairness no one can game (docs/flow-control.md, "Fairness"; issue 35, item 5), held by worker
processes on a real database: a tenant's shares follow what its calls really spent, whatever
cost its submits declare, a key's ``tenant_share`` caps what one tenant holds of it, and
``priority`` orders the jobs within a tenant's share."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
from collections.abc import Callable
from typing import Any

import psycopg

from orchestrator import Orchestrator
from tests.support import flow_app
from tests.support.harness import wait_for
from tests.support.workers import WorkerProcess

APP = "tests.support.flow_app:orc"
ENV = {"ORCHESTRATOR_RETRY_CONFIG": flow_app.CONFIG, "ORCHESTRATOR_WORKER_CONCURRENCY": 5}


async def unfinished(db: psycopg.AsyncConnection[Any], ids: list[Any]) -> int:
    cur = await db.execute(
        "SELECT count(*) FROM orc_jobs WHERE id = ANY(%s) AND finished_at IS NULL", (ids,)
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def running(db: psycopg.AsyncConnection[Any], key: str, tenant: str) -> int:
    cur = await db.execute(
        "SELECT count(*) FROM orc_jobs WHERE flow_key = %s AND tenant_id = %s"
        " AND status = 'RUNNING'",
        (key, tenant),
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def test_a_declared_cost_of_zero_does_not_buy_the_key(
    dsn: str, make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    """Two worker processes, a key of two at once metering units. Tenant a submits 60 jobs
    declaring ``cost = 0``, then tenant b 6 (their type's estimate, 10); every call really
    spends 10. Shares follow the real spend, so the tenants take turns: b's last job starts
    among the first 20 (a declared 0 made a's share free: 60 of a's started before b's last)."""
    orc = make_orc(retry_config=flow_app.CONFIG)
    flow_app.register(orc)
    await orc.open()
    greedy = [await orc.submit("spend", {"tokens": 10}, tenant_id="a", cost=0) for _ in range(60)]
    honest = [await orc.submit("spend", {"tokens": 10}, tenant_id="b") for _ in range(6)]
    with contextlib.ExitStack() as stack:
        for _ in range(2):
            stack.enter_context(WorkerProcess(dsn, APP, **ENV))
        await wait_for(lambda: _none_left(db, honest), timeout=60)
    starts = sorted(
        [(await _started(orc, job_id), "a") for job_id in greedy if await _started(orc, job_id)]
        + [(await _started(orc, job_id), "b") for job_id in honest]
    )
    last_b = max(i for i, (_, who) in enumerate(starts) if who == "b")
    assert last_b < 20, [who for _, who in starts]
    assert (await orc.get_job(greedy[0])).flow_cost == 1  # a declared 0 is an estimate of 1


async def _none_left(db: psycopg.AsyncConnection[Any], ids: list[Any]) -> bool:
    return await unfinished(db, ids) == 0


async def _started(orc: Orchestrator, job_id: Any) -> float | None:
    return next(
        (e.at.timestamp() for e in await orc.job_events(job_id) if e.kind == "job.running"), None
    )


async def test_one_tenant_holds_no_more_of_a_key_than_its_share(
    dsn: str, make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    """``tenant_share = 0.5``. On a key of four at once, tenant a's eight jobs never run more
    than two at once, and b's two, submitted after them, start at once beside them. On a key of
    100 units a minute, a's jobs each declaring a billion units are each taken as 50 (the most
    one tenant may hold): one runs, the next waits for its share, and b's job starts at once (a
    declared billion held the whole window for a minute)."""
    orc = make_orc(retry_config=flow_app.CONFIG)
    flow_app.register(orc)
    await orc.open()
    with contextlib.ExitStack() as stack:
        for _ in range(2):
            stack.enter_context(WorkerProcess(dsn, APP, **ENV))
        hold = {"seconds": 1.0}
        slots_a = [await orc.submit("hold_slot", hold, tenant_id="a") for _ in range(8)]
        await wait_for(lambda: _running_at_least(db, "slots", "a", 2), timeout=30)
        slots_b = [await orc.submit("hold_slot", hold, tenant_id="b") for _ in range(2)]
        await wait_for(lambda: _running_at_least(db, "slots", "b", 2), timeout=10)
        most = 0
        while await unfinished(db, slots_a):
            most = max(most, await running(db, "slots", "a"))
            await asyncio.sleep(0.02)
        assert most == 2
        await wait_for(lambda: _none_left(db, slots_b), timeout=10)

        quick = {"seconds": 0.1}
        huge = [await orc.submit("hold_tokens", quick, tenant_id="a", cost=10**9) for _ in range(3)]
        await wait_for(lambda: _none_left(db, huge[:1]), timeout=30)
        fair = await orc.submit("hold_tokens", quick, tenant_id="b", cost=10)
        await wait_for(lambda: _none_left(db, [fair]), timeout=10)
        assert await unfinished(db, huge) == 2
        waiting = {(await orc.get_job(j)).waiting_for for j in huge[1:]}
        assert waiting == {"waiting for capacity on tokens (its share of the key (tenant_share)"
                           " is in use)"}, waiting  # fmt: skip
        [key] = await orc.flow_keys("tokens")
        assert key.units_used == 50 + 10


async def _running_at_least(
    db: psycopg.AsyncConnection[Any], key: str, tenant: str, n: int
) -> bool:
    return await running(db, key, tenant) >= n


async def test_priority_orders_the_jobs_within_a_share_and_tenants_still_take_turns(
    dsn: str,
    make_orc: Callable[..., Orchestrator],
    db: psycopg.AsyncConnection[Any],
) -> None:
    """A key of one at a time, shared by tenants a and b of equal weights, held by tenant c's
    job while a and b submit, each job parked before the next is submitted (so the line holds
    them in submission order). Once c's job is cancelled, the tenants take turns, and within each
    tenant's share the jobs start by priority (lower first), equal priorities in submission
    order; b's priorities, all lower than a's (higher numbers), do not put b behind a."""
    orc = make_orc(retry_config=flow_app.CONFIG)
    flow_app.register(orc)
    await orc.open()
    submitted = [("a", 5), ("b", 10), ("a", 0), ("a", 5), ("b", 10), ("a", -3), ("b", 9),
                 ("a", 0), ("a", 5)]  # fmt: skip
    with contextlib.ExitStack() as stack:
        for _ in range(2):
            stack.enter_context(WorkerProcess(dsn, APP, **ENV))
        holder = await orc.submit("in_turn", {"seconds": 600}, tenant_id="c")
        await wait_for(lambda: _running_at_least(db, "single", "c", 1), timeout=30)
        jobs: list[tuple[str, int, Any]] = []
        for tenant, priority in submitted:
            job_id = await orc.submit("in_turn", QUICK, tenant_id=tenant, priority=priority)
            await wait_for(functools.partial(_parked, orc, job_id), timeout=30)
            jobs.append((tenant, priority, job_id))
        await orc.cancel(holder, reason="its slot goes to the line")
        await wait_for(lambda: _none_left(db, [j for _, _, j in jobs]), timeout=60)
    starts = sorted([(await _start(orc, j), who, priority, i)
                     for i, (who, priority, j) in enumerate(jobs)])  # fmt: skip
    order = [who for _, who, _, _ in starts]
    assert all(x != y for x, y in itertools.pairwise(order[:6])), order
    assert order[6:] == ["a", "a", "a"], order
    for tenant in ("a", "b"):
        # (priority, submitted as) in the order they started: by priority, then submission
        started = [(priority, i) for _, who, priority, i in starts if who == tenant]
        assert started == sorted(started), (tenant, started)


QUICK = {"seconds": 0.05}


async def _parked(orc: Orchestrator, job_id: Any) -> bool:
    return (await orc.get_job(job_id)).waiting_for is not None


async def _start(orc: Orchestrator, job_id: Any) -> tuple[float, int]:
    """When the job started: its job.running event's time, then its id (one order for all)."""
    return next((e.at.timestamp(), e.id) for e in await orc.job_events(job_id)
                if e.kind == "job.running")  # fmt: skip
