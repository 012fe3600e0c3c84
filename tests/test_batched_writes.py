"""A busy worker's writes, batched: one fetch claims a dispatch for each free slot (never
more), and completions that arrive together are written in one statement, each with its own
outcome.

A stop that comes during a fetch, or between a fetch of several and their start, lets the
worker start what it claimed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any
from uuid import UUID

import psycopg

from orchestrator import JobContext, Orchestrator, StaleLease, Status
from orchestrator.runtime.metrics import Metrics
from orchestrator.runtime.outcomes import OutcomeWriter
from orchestrator.storage.database import OwnConnection
from orchestrator.storage.dispatches import Completion, Dispatch
from orchestrator.storage.jobs import TASK_PREFIX
from tests.support.harness import wait_for


class Fetcher:
    """The worker's side of the fetch, driven by hand: a registered worker with ``slots`` free
    slots, on an orchestrator with a no-op job type (``start`` submits jobs)."""

    def __init__(self, make_orc: Callable[..., Orchestrator], *, slots: int) -> None:
        self.orc = make_orc()
        self.slots = slots
        self.worker_id = 0

        @self.orc.job_type("noop")
        async def noop(ctx: JobContext, payload: int) -> int:
            return payload

    async def start(self, jobs: int) -> list[UUID]:
        await self.orc.open()
        job_ids = [await self.orc.submit("noop", i) for i in range(jobs)]
        self.worker_id = await self.orc.stores.dispatches.register_worker(prune_after=30)
        return job_ids

    async def fetch(self) -> list[Dispatch]:
        stores = self.orc.stores
        async with stores.queries.connection() as conn:
            return await stores.dispatches.fetch(
                limit=self.slots, queues=None, worker_id=self.worker_id, worker="test", conn=conn
            )


async def statuses(orc: Orchestrator, job_ids: list[UUID]) -> list[Status]:
    return [(await orc.get_job(job_id)).status for job_id in job_ids]


async def dispatch_rows(db: psycopg.AsyncConnection[Any]) -> list[tuple[Any, ...]]:
    """The jobs' dispatches (not the maintenance tasks a worker defers on a minute's tick)."""
    cur = await db.execute(
        "SELECT id, status, attempts FROM procrastinate_jobs WHERE starts_with(task_name, %s) "
        "ORDER BY id",
        (TASK_PREFIX,),
    )
    return await cur.fetchall()


async def test_one_fetch_claims_a_dispatch_for_each_free_slot_and_no_more(
    make_orc: Callable[..., Orchestrator],
) -> None:
    fetcher = Fetcher(make_orc, slots=3)
    orc = fetcher.orc
    job_ids = await fetcher.start(jobs=5)

    taken = await fetcher.fetch()
    assert await statuses(orc, job_ids) == [Status.RUNNING] * 3 + [Status.PENDING] * 2
    assert [d.row["args"]["job_id"] for d in taken] == [str(i) for i in job_ids[:3]]
    assert all(d.claim is not None for d in taken)


async def test_a_fetch_of_several_honours_the_lock_of_a_job_with_two_dispatches(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    fetcher = Fetcher(make_orc, slots=5)
    job_id = (await fetcher.start(jobs=1))[0]
    async with fetcher.orc.stores.queries.transaction() as conn:
        await fetcher.orc.stores.jobs.dispatch([job_id], conn)  # a newer dispatch

    [stale] = await fetcher.fetch()  # the newer waits for the lock: one run of a job at a time
    assert stale.claim is None  # the older: not claimable
    assert [row[1] for row in await dispatch_rows(db)] == ["doing", "todo"]


def stopper_app(make_orc: Callable[..., Orchestrator], started: list[int]) -> Orchestrator:
    orc = make_orc()

    @orc.job_type("stopper")
    async def stopper(ctx: JobContext, payload: int) -> None:
        started.append(payload)
        if payload == 0:
            orc.stop_worker()  # the drain begins; the rest of the batch waits in the worker

    return orc


async def test_a_worker_stopped_mid_batch_starts_the_rest_of_it_and_fetches_no_more(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    started: list[int] = []
    orc = stopper_app(make_orc, started)
    await orc.open()
    job_ids = [await orc.submit("stopper", i) for i in range(4)]
    await orc.run_worker(concurrency=3, install_signal_handlers=False, job_types=["stopper"])

    assert sorted(started) == [0, 1, 2]  # the batch: claimed, so run (the drain let them end)
    assert await statuses(orc, job_ids) == [Status.COMPLETED] * 3 + [Status.PENDING]
    for job_id in job_ids[:3]:
        kinds = [e.kind for e in await orc.job_events(job_id)]
        assert kinds == ["job.created", "job.running", "job.completed"]
    assert [row[1] for row in await dispatch_rows(db)] == ["succeeded"] * 3 + ["todo"]


async def test_a_stop_during_a_fetch_starts_what_the_fetch_claimed(
    make_orc: Callable[..., Orchestrator], dsn: str, db: psycopg.AsyncConnection[Any]
) -> None:
    started: list[int] = []
    orc = stopper_app(make_orc, started)
    await orc.open()
    job_ids = [await orc.submit("stopper", i) for i in range(1, 4)]
    async with await psycopg.AsyncConnection.connect(dsn) as blocker:
        # The first claim's job.running waits for this lock (the fetch waits for no row lock),
        # so the fetch is under way when the stop comes.
        await blocker.execute("LOCK TABLE orc_job_events IN EXCLUSIVE MODE")
        worker = asyncio.create_task(
            orc.run_worker(concurrency=3, install_signal_handlers=False, job_types=["stopper"])
        )

        async def fetch_waits_for_the_lock() -> bool:
            cur = await db.execute(
                "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND query LIKE %s", ["%orc_fetch_dispatches_v%"],
            )  # fmt: skip
            return await cur.fetchone() is not None

        await wait_for(fetch_waits_for_the_lock)
        orc.stop_worker()
        await blocker.rollback()
        await asyncio.wait_for(worker, timeout=15)

    assert sorted(started) == [1, 2, 3]
    assert await statuses(orc, job_ids) == [Status.COMPLETED] * 3


async def test_completions_written_together_each_get_their_own_outcome(
    make_orc: Callable[..., Orchestrator], dsn: str, db: psycopg.AsyncConnection[Any]
) -> None:
    fetcher = Fetcher(make_orc, slots=4)
    orc = fetcher.orc
    job_ids = await fetcher.start(jobs=4)
    dispatches = await fetcher.fetch()
    pjob_ids = [d.id for d in dispatches]
    claims = [d.claim for d in dispatches if d.claim is not None]
    # job 2 is superseded (as by a sweep); job 3's dispatch is settled under its attempt
    await db.execute(
        "UPDATE orc_jobs SET lease_token = gen_random_uuid() WHERE id = %s", [job_ids[2]]
    )
    await db.execute("SELECT procrastinate_finish_job_v1(%s, 'failed', false)", [pjob_ids[3]])
    before = {job_id: await orc.get_job(job_id) for job_id in job_ids[2:]}
    connection = OwnConnection(dsn, "completions")
    writer = OutcomeWriter(orc.stores.dispatches, orc.stores.jobs, connection, Metrics())

    async def complete(i: int) -> None:
        claim = claims[i]
        if not await writer.complete(Completion(claim, {"n": i}, 1.0, pjob_ids[i])):
            raise await orc.stores.jobs.refusal(claim.id, Status.COMPLETED, claim.lease_token)

    # the first is written at once; the other three arrive meanwhile and go in one statement
    try:
        outcomes = await asyncio.gather(*(complete(i) for i in range(4)), return_exceptions=True)
    finally:
        await connection.close()

    assert outcomes[:2] == [None, None]
    assert isinstance(outcomes[2], StaleLease) and isinstance(outcomes[3], StaleLease)
    for n, job_id in enumerate(job_ids[:2]):
        job = await orc.get_job(job_id)
        assert (job.status, job.result) == (Status.COMPLETED, {"n": n})
        assert [e.kind for e in await orc.job_events(job_id)][-1] == "job.completed"
    for job_id in job_ids[2:]:  # refused: the job is exactly as it was
        assert await orc.get_job(job_id) == before[job_id]
        assert [e.kind for e in await orc.job_events(job_id)][-1] == "job.running"
    cur = await db.execute("SELECT status, xmin::text FROM procrastinate_jobs ORDER BY id")
    rows = await cur.fetchall()
    # the refused completion's dispatch is finished all the same, in the batch's transaction
    assert [row[0] for row in rows] == ["succeeded", "succeeded", "succeeded", "failed"]
    assert rows[0][1] != rows[1][1] == rows[2][1]
