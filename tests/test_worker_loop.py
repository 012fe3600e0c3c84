"""The worker's fetch loop (orchestrator.runtime.worker.Worker): slots (each freed once, when
its attempt ends, while its outcome is written; the writes in flight bounded), stops, an empty
queue, two workers in one process, and the log line of each job's outcome.

The polling interval is a minute throughout: whatever these tests wait for must come from the
loop's own wake-ups (a slot freed, a stop), never from a poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any
from uuid import UUID

import psycopg
import pytest

from orchestrator import JobContext, Orchestrator, Status
from orchestrator.runtime.worker import UNKNOWN_TASK_TURNS
from tests.support import scripted
from tests.support.harness import WorkerRun, config_with, wait_for


async def queued(make_orc: Callable[..., Orchestrator], n: int) -> tuple[Orchestrator, list[UUID]]:
    """An orchestrator polling once a minute, with ``n`` jobs waiting that succeed."""
    orc = make_orc(retry_config=config_with(scripted.TABLE), fetch_polling_interval=60)
    scripted.register(orc)
    await orc.open()
    return orc, [await orc.submit("scripted", {"script": ["ok"]}) for _ in range(n)]


async def assert_completed(orc: Orchestrator, job_ids: list[UUID]) -> None:
    for job_id in job_ids:
        assert (await orc.get_job(job_id)).status is Status.COMPLETED


async def test_queued_jobs_start_one_after_another_as_the_slot_frees(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc, job_ids = await queued(make_orc, 5)
    async with WorkerRun(orc, concurrency=1) as worker:
        await worker.until_finished(*job_ids, timeout=10)
    await assert_completed(orc, job_ids)


async def test_a_worker_never_runs_more_jobs_than_its_concurrency(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc = make_orc(fetch_polling_interval=60)
    running = 0
    most = 0

    @orc.job_type("nap")
    async def nap(ctx: JobContext, payload: None) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.1)
        running -= 1

    await orc.open()
    job_ids = [await orc.submit("nap") for _ in range(7)]
    async with WorkerRun(orc, concurrency=2) as worker:
        await worker.until_finished(*job_ids, timeout=10)
    assert most == 2


async def test_every_slot_is_freed_once_when_its_dispatch_ends(
    make_orc: Callable[..., Orchestrator],
) -> None:
    # Only the jobs' dispatches count: a worker running across a minute's tick also runs its
    # maintenance tasks, which take slots as well (and free them).
    orc, job_ids = await queued(make_orc, 3)
    async with WorkerRun(orc, concurrency=2) as worker:
        await worker.until_finished(*job_ids, timeout=10)
        [running] = orc.workers

        async def all_free() -> bool:
            return running.free_slots == 2

        await wait_for(all_free, timeout=5)  # never more than there are: none released twice
    await assert_completed(orc, job_ids)


async def test_a_slot_frees_when_its_attempt_ends_and_the_writes_in_flight_are_bounded(
    make_orc: Callable[..., Orchestrator], dsn: str
) -> None:
    """The next job starts while the last one's outcome is still being written (here: held up
    by a lock on its row); a lane holds at most twice its concurrency in dispatches, running or
    being written, so writes the database holds up stop the fetches."""
    orc = make_orc(fetch_polling_interval=60)
    gates = [asyncio.Event() for _ in range(3)]

    @orc.job_type("gated")
    async def gated(ctx: JobContext, payload: int) -> None:
        await gates[payload].wait()

    await orc.open()
    job_ids = [await orc.submit("gated", i) for i in range(3)]

    def running(i: int) -> Callable[[], Any]:
        async def check() -> bool:
            return (await orc.get_job(job_ids[i])).status is Status.RUNNING

        return check

    async with WorkerRun(orc, concurrency=1) as worker:
        async with contextlib.AsyncExitStack() as holders:
            for i in range(2):
                await wait_for(running(i), timeout=10)
                row = await holders.enter_async_context(await psycopg.AsyncConnection.connect(dsn))
                await row.execute("SELECT 1 FROM orc_jobs WHERE id = %s FOR UPDATE", (job_ids[i],))
                gates[i].set()  # its attempt ends; its completion waits for the row

            [lane, *_] = orc.workers[0].lanes

            async def full() -> bool:
                return len(lane.tasks) == 2 and not lane.holding

            await wait_for(full, timeout=10)
            statuses = [(await orc.get_job(job_id)).status for job_id in job_ids]
            assert statuses == [Status.RUNNING, Status.RUNNING, Status.PENDING]
        gates[2].set()  # the rows' locks are gone: the writes land, the third job starts
        await worker.until_finished(*job_ids, timeout=10)
    await assert_completed(orc, job_ids)


async def test_a_stop_ends_an_idle_worker_at_once(make_orc: Callable[..., Orchestrator]) -> None:
    orc = make_orc(retry_config=config_with(scripted.TABLE), fetch_polling_interval=60)
    scripted.register(orc)
    async with WorkerRun(orc, concurrency=1) as worker:
        job_id = await orc.submit("scripted", {"script": ["ok"]})
        await worker.until_finished(job_id, timeout=10)
        await asyncio.sleep(0.5)  # past its last fetch: it waits for work now
        assert worker.task is not None
        orc.stop_worker()
        await asyncio.wait_for(worker.task, 5)


async def test_without_wait_the_worker_returns_once_the_queue_is_empty(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc, job_ids = await queued(make_orc, 3)
    await asyncio.wait_for(
        orc.run_worker(concurrency=1, wait=False, install_signal_handlers=False), 10
    )
    await assert_completed(orc, job_ids)


async def test_each_job_outcome_is_logged_with_its_fields(
    make_orc: Callable[..., Orchestrator], caplog: pytest.LogCaptureFixture
) -> None:
    orc = make_orc(retry_config=config_with(scripted.TABLE), fetch_polling_interval=60)
    scripted.register(orc)
    with caplog.at_level(logging.INFO, logger="orchestrator.worker"):
        async with WorkerRun(orc, concurrency=1) as worker:
            job_id = await orc.submit("scripted", {"script": ["ok"]})
            await worker.until_finished(job_id, timeout=10)
    [record] = [r for r in caplog.records if getattr(r, "job_id", None) == str(job_id)]
    assert (record.__dict__["job_type"], record.__dict__["attempt"]) == ("scripted", 1)
    assert record.getMessage() == f"job {job_id} (scripted) attempt 1: completed"
    started = [r for r in caplog.records if r.getMessage().startswith("worker orchestrator")]
    assert len(started) == 1 and "concurrency 1" in started[0].getMessage()


async def test_two_workers_in_one_process_run_side_by_side_and_stop_apart(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc = make_orc(fetch_polling_interval=60)

    # Each job answers with its worker, and whether its worker's HTTP client is still open
    # (one worker's exit must not close another's clients).
    @orc.job_type("left")
    async def left(ctx: JobContext, payload: int) -> str:
        return ctx.worker if not ctx.http.is_closed else "closed"

    @orc.job_type("right")
    async def right(ctx: JobContext, payload: int) -> str:
        return ctx.worker if not ctx.http.is_closed else "closed"

    async def results(job_ids: list[UUID]) -> set[str]:
        return {(await orc.get_job(job_id)).result for job_id in job_ids}

    async def done(job_ids: list[UUID]) -> bool:
        return all([(await orc.get_job(j)).status is Status.COMPLETED for j in job_ids])

    await orc.open()
    workers = {
        side: asyncio.create_task(
            orc.run_worker(
                job_types=[side], name=side, concurrency=2, install_signal_handlers=False
            )
        )
        for side in ("left", "right")
    }
    try:
        lefts = [await orc.submit("left", i) for i in range(4)]
        rights = [await orc.submit("right", i) for i in range(4)]
        await wait_for(lambda: done(lefts + rights), timeout=10)
        [ran_left], [ran_right] = await results(lefts), await results(rights)
        assert ran_left != ran_right  # each queue's jobs ran on its own worker

        workers["left"].cancel()  # stop one: it drains and returns
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(workers["left"], 10)
        assert [w.name for w in orc.workers] == ["right"]
        later_left = await orc.submit("left", 9)
        later_rights = [await orc.submit("right", i) for i in range(4)]
        await wait_for(lambda: done(later_rights), timeout=10)  # the other keeps working
        assert await results(later_rights) == {ran_right}
        assert (await orc.get_job(later_left)).status is Status.PENDING
    finally:
        for task in workers.values():
            task.cancel()
        await asyncio.gather(*workers.values(), return_exceptions=True)


async def test_the_zombie_sweep_runs_on_time_behind_a_backlog_of_10000_jobs(
    make_orc: Callable[..., Orchestrator], db: Any
) -> None:
    # Every job slot is taken by a long job and 10,000 more wait: the sweep, ticking every
    # second, must still recover a zombie, in the maintenance lane's own slot, while those slots
    # stay busy (in the jobs' lane it would wait hours behind the backlog).
    threshold = 2.0
    orc = make_orc(
        sweep_cron="* * * * * *", zombie_threshold=threshold, heartbeat_interval=0.5,
        drain_seconds=0.5, fetch_polling_interval=60,
    )  # fmt: skip

    @orc.job_type("long")
    async def long(ctx: JobContext, payload: None) -> None:
        await asyncio.sleep(600)

    await orc.open()
    await orc.submit_many([{"job_type": "long", "timeout_seconds": 3600}] * 10_000)
    zombie = await db.execute(
        "INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts, max_retries, "
        "trace_id, lease_token, locked_by, attempt, dispatch_attempt, heartbeat_at, started_at, "
        "deadline_at) VALUES (gen_random_uuid(), 'long', 'RUNNING', 'null', 'long', 3, 3, 't', "
        "gen_random_uuid(), 'gone/1/w1', 1, 1, now(), now(), now() + interval '1 hour') "
        "RETURNING id, heartbeat_at"
    )
    zombie_id, _ = await zombie.fetchone()
    async with WorkerRun(orc, concurrency=2):

        async def recovered() -> bool:
            events = await orc.job_events(zombie_id)
            return any(e.kind == "job.zombie_detected" for e in events)

        await wait_for(recovered, timeout=120)  # in the jobs' lane: never
        detected = next(
            e for e in await orc.job_events(zombie_id) if e.kind == "job.zombie_detected"
        )
    # The backlog kept every job slot busy meanwhile: two long jobs ran across the detection.
    busy = await db.execute(
        "SELECT count(*) FROM orc_jobs WHERE id <> %s AND started_at < %s"
        " AND (finished_at IS NULL OR finished_at > %s)",
        (zombie_id, detected.at, detected.at),
    )
    assert (await busy.fetchone())[0] == 2


async def test_a_task_this_worker_does_not_know_is_left_for_one_that_does(
    make_orc: Callable[..., Orchestrator], db: Any
) -> None:
    """A newer release's maintenance tick, fetched by a worker of the release before during a
    rolling deploy: given back for later, not failed ("no task named"); a worker that knows the
    task runs it."""
    name = "orchestrator.from_the_future"
    ran: list[int] = []
    older = make_orc(fetch_polling_interval=0.2)
    newer = make_orc(fetch_polling_interval=0.2)

    @newer.procrastinate.task(name=name, queue="maintenance")
    async def from_the_future(timestamp: int) -> None:
        ran.append(timestamp)

    cur = await db.execute(
        "INSERT INTO procrastinate_jobs (queue_name, task_name, args)"
        " VALUES ('maintenance', %s, '{\"timestamp\": 1}') RETURNING id",
        (name,),
    )
    (dispatch_id,) = await cur.fetchone()

    async def dispatch() -> tuple[str, int, bool]:
        row = await (
            await db.execute(
                "SELECT status::text, attempts, scheduled_at > now() FROM procrastinate_jobs"
                " WHERE id = %s",
                (dispatch_id,),
            )
        ).fetchone()
        return row[0], row[1], row[2]

    async with WorkerRun(older):

        async def given_back() -> bool:
            return (await dispatch())[1] >= 1

        await wait_for(given_back, timeout=60)
    status, _, later = await dispatch()
    assert (status, later, ran) == ("todo", True, [])

    await db.execute("UPDATE procrastinate_jobs SET scheduled_at = now() WHERE id = %s",
                     (dispatch_id,))  # fmt: skip
    async with WorkerRun(newer):

        async def succeeded() -> bool:
            return (await dispatch())[0] == "succeeded"

        await wait_for(succeeded, timeout=60)
    assert ran == [1]


async def test_a_task_no_worker_has_known_for_an_hour_of_turns_ends_failed(
    make_orc: Callable[..., Orchestrator], db: Any
) -> None:
    """The turns an unknown task is given back are bounded: after UNKNOWN_TASK_TURNS of them
    (an hour), no worker of the fleet knows it, and it ends failed rather than circling."""
    orc = make_orc(fetch_polling_interval=0.2)
    cur = await db.execute(
        "INSERT INTO procrastinate_jobs (queue_name, task_name, args, attempts)"
        " VALUES ('maintenance', 'orchestrator.nobody_knows', '{}', %s) RETURNING id",
        (UNKNOWN_TASK_TURNS,),
    )
    (dispatch_id,) = await cur.fetchone()

    async def ended() -> bool:
        row = await (
            await db.execute(
                "SELECT status::text FROM procrastinate_jobs WHERE id = %s", (dispatch_id,)
            )
        ).fetchone()
        return row[0] not in ("todo", "doing")

    async with WorkerRun(orc):
        await wait_for(ended, timeout=60)
    status = await (
        await db.execute(
            "SELECT status::text FROM procrastinate_jobs WHERE id = %s", (dispatch_id,)
        )
    ).fetchone()
    assert status == ("failed",)
