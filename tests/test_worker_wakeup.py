"""The worker starts scheduled work when it is due, not at Procrastinate's next poll.

These tests set the polling interval to a minute: without the wake-ups (orchestrator.runtime.
wakeups: one listener, one due-time timer), the retries below would wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from orchestrator import Orchestrator, Status
from orchestrator.runtime import wakeups
from orchestrator.runtime.wakeups import Wakeups
from orchestrator.storage.database import create_pool
from orchestrator.storage.stores import Stores
from tests.support import scripted
from tests.support.harness import WorkerRun, config_with, wait_for


async def test_app_retries_start_when_due_not_at_the_next_poll(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc = make_orc(retry_config=config_with(scripted.TABLE), fetch_polling_interval=60)
    scripted.register(orc)
    async with WorkerRun(orc) as worker:
        job_id = await orc.submit("scripted", {"script": ["app", "app", "ok"]})
        await worker.until_finished(job_id, timeout=10)
    events = await orc.job_events(job_id)
    assert (await orc.get_job(job_id)).status is Status.COMPLETED
    due = [e.payload["available_at"] for e in events if e.kind == "job.retry_scheduled"]
    started = [e.at for e in events if e.kind == "job.running"][1:]
    for due_at, start in zip(due, started, strict=True):
        assert datetime.fromisoformat(due_at) <= start  # never early


async def test_a_job_submitted_for_later_starts_then(make_orc: Callable[..., Orchestrator]) -> None:
    orc = make_orc(retry_config=config_with(scripted.TABLE), fetch_polling_interval=60)
    scripted.register(orc)
    async with WorkerRun(orc) as worker:
        run_at = datetime.now(UTC) + timedelta(seconds=0.5)
        job_id = await orc.submit("scripted", {"script": ["ok"]}, run_at=run_at)
        await worker.until_finished(job_id, timeout=10)
    running = next(e for e in await orc.job_events(job_id) if e.kind == "job.running")
    assert running.at >= run_at


async def test_an_immediate_retry_starts_once_the_failed_run_has_finished(
    make_orc: Callable[..., Orchestrator],
) -> None:
    # RetryLater(0): the new dispatch is due at once but shares the lock of the run that is
    # still finishing; the worker must fetch again when that run ends.
    from orchestrator import JobContext, RetryLater

    orc = make_orc(fetch_polling_interval=60)
    calls: list[int] = []

    @orc.job_type("again")
    async def again(ctx: JobContext, payload: None) -> int:
        calls.append(ctx.attempt)
        if ctx.attempt < 3:
            raise RetryLater(0)
        return ctx.attempt

    async with WorkerRun(orc) as worker:
        job_id = await orc.submit("again")
        await worker.until_finished(job_id, timeout=10)
    assert calls == [1, 2, 3]


async def test_a_dispatch_waiting_for_its_lock_starts_on_another_worker_once_it_is_free(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    # A job's dispatch is queued while an earlier dispatch of the job still holds its lock (a
    # run that has not finished ending; here a row standing for it, on no worker of this test).
    # The worker hears the insert, its fetch skips the locked dispatch; when the lock comes
    # free, it must hear of that too, not find out at its poll a minute later.
    orc = make_orc(retry_config=config_with(scripted.TABLE), fetch_polling_interval=60)
    scripted.register(orc)
    await orc.open()
    job_id = await orc.submit("scripted", {"script": ["ok"]})
    cur = await db.execute(
        "INSERT INTO procrastinate_jobs (queue_name, task_name, lock, args, status) "
        "VALUES ('elsewhere', 'orc.scripted', %s, '{}', 'doing') RETURNING id",
        (str(job_id),),
    )
    row = await cur.fetchone()
    assert row is not None
    async with WorkerRun(orc) as worker:
        await asyncio.sleep(0.5)  # the worker has fetched, and skipped the job
        assert (await orc.get_job(job_id)).status is Status.PENDING
        await db.execute("SELECT procrastinate_finish_job_v1(%s, 'succeeded', false)", (row[0],))
        await worker.until_finished(job_id, timeout=5)  # not at the 60 s poll
    assert (await orc.get_job(job_id)).status is Status.COMPLETED


async def test_the_waker_arms_a_timer_for_the_next_job_while_another_is_overdue(
    dsn: str, db: psycopg.AsyncConnection[Any]
) -> None:
    # One job came due but has not been fetched yet (its fetch is under way, or it waits for a
    # lock); another is due in 0.3 s. The overdue one must not hide the next one's due time.
    for offset in ("-1 second", "0.3 seconds"):
        await db.execute(
            "INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts, "
            "max_retries, trace_id, next_retry_at) VALUES (gen_random_uuid(), 'x', 'RETRY', "
            "'null', 'x', 1, 1, 't', now() + %s::interval)",
            (offset,),
        )
    loop = asyncio.get_running_loop()
    wakes: list[float] = []
    pool = create_pool(dsn, min_size=1, max_size=2)
    await pool.open()

    def notified(channel: str, notification: dict[str, Any]) -> None:
        pass  # inserted jobs: none here

    waker = Wakeups(
        dsn=dsn,
        liveness=Stores.on(pool).liveness,
        wake=lambda: wakes.append(loop.time()),
        notified=notified,
        refresh_interval=30,
    )
    started = loop.time()
    task = asyncio.create_task(waker.run())

    async def woken_for_the_next_job() -> bool:
        return any(at - started > 0.25 for at in wakes)

    try:
        await wait_for(woken_for_the_next_job, timeout=2)  # when due, not at the 30 s refresh
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await pool.close()
    assert wakes[0] - started < 1  # the overdue job: at once


async def test_staggered_retries_each_start_when_due(make_orc: Callable[..., Orchestrator]) -> None:
    # After the timer fires for one retry, the next one (due 50 ms later) must get its own
    # timer, even while the first is still overdue and being fetched.
    orc = make_orc(retry_config=config_with(scripted.TABLE), fetch_polling_interval=60)
    scripted.register(orc)
    async with WorkerRun(orc) as worker:
        jobs = []
        for _ in range(6):
            jobs.append(await orc.submit("scripted", {"script": ["app", "ok"]}))
            await asyncio.sleep(0.05)
        await worker.until_finished(*jobs, timeout=10)
    for job_id in jobs:
        events = await orc.job_events(job_id)
        due = next(e for e in events if e.kind == "job.retry_scheduled").payload["available_at"]
        start = [e.at for e in events if e.kind == "job.running"][1]
        assert (start - datetime.fromisoformat(due)).total_seconds() < 2  # not the 60 s poll


@contextlib.asynccontextmanager
async def listening_waker(
    dsn: str, db: psycopg.AsyncConnection[Any]
) -> AsyncIterator[list[tuple[str, dict[str, Any]]]]:
    """A due-time waker whose listener is up; yields the Procrastinate notifications it hands
    on, as (channel, payload)."""
    heard: list[tuple[str, dict[str, Any]]] = []

    def notified(channel: str, notification: dict[str, Any]) -> None:
        heard.append((channel, notification))

    pool = create_pool(dsn, min_size=1, max_size=2)
    await pool.open()
    waker = Wakeups(
        dsn=dsn,
        liveness=Stores.on(pool).liveness,
        wake=lambda: None,
        refresh_interval=30,
        notified=notified,
    )
    task = asyncio.create_task(waker.run())
    try:
        await wait_for(lambda: _listener(db))
        yield heard
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await pool.close()


async def _listener(db: psycopg.AsyncConnection[Any], *, besides: int | None = None) -> int | None:
    """The backend of a listener that listens on all its channels (it last ran its last LISTEN,
    or a connection check), other than ``besides``."""
    cur = await db.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        "AND (query LIKE 'LISTEN \"procrastinate_any_queue_v1\"%%' OR query LIKE 'SELECT 1 AS ok%%') "
        "AND pid <> pg_backend_pid() AND pid IS DISTINCT FROM %s",
        (besides,),
    )
    row = await cur.fetchone()
    return int(row[0]) if row else None


async def _insert_dispatch(db: psycopg.AsyncConnection[Any]) -> int:
    cur = await db.execute(
        "INSERT INTO procrastinate_jobs (queue_name, task_name, args) "
        "VALUES ('q', 't', '{}') RETURNING id"
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def test_the_waker_hands_procrastinate_notifications_to_the_worker(
    dsn: str, db: psycopg.AsyncConnection[Any]
) -> None:
    # The waker's connection is the worker's only listener (Procrastinate's own is off): an
    # inserted job and an abort request must reach the worker through it.
    async with listening_waker(dsn, db) as heard:
        job = await _insert_dispatch(db)
        await db.execute("UPDATE procrastinate_jobs SET status = 'doing' WHERE id = %s", (job,))
        await db.execute(
            "UPDATE procrastinate_jobs SET abort_requested = true WHERE id = %s", (job,)
        )
        await wait_for(lambda: _at_least(heard, 2))
    assert heard == [
        ("procrastinate_any_queue_v1", {"type": "job_inserted", "job_id": job}),
        ("procrastinate_any_queue_v1", {"type": "abort_job_requested", "job_id": job}),
    ]


async def test_a_malformed_notification_does_not_stop_the_listener(
    dsn: str, db: psycopg.AsyncConnection[Any]
) -> None:
    async with listening_waker(dsn, db) as heard:
        await db.execute("SELECT pg_notify('procrastinate_any_queue_v1', 'not json')")
        job = await _insert_dispatch(db)
        await wait_for(lambda: _at_least(heard, 1))
    assert heard == [("procrastinate_any_queue_v1", {"type": "job_inserted", "job_id": job})]


async def test_a_quiet_listener_checks_its_connection_and_comes_back_when_it_is_lost(
    dsn: str, db: psycopg.AsyncConnection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wakeups, "LISTEN_CHECK_SECONDS", 0.1)

    async def checked(pid: int | None = None) -> bool:
        cur = await db.execute(
            "SELECT 1 FROM pg_stat_activity WHERE query LIKE 'SELECT 1 AS ok%%' AND pid = %s",
            (pid,),
        )
        return await cur.fetchone() is not None

    async with listening_waker(dsn, db) as heard:
        first = await _listener(db)
        await wait_for(lambda: checked(first))  # quiet: it checked its connection
        await db.execute("SELECT pg_terminate_backend(%s)", (first,))
        await wait_for(lambda: _listener(db, besides=first), timeout=5)  # back, listening
        job = await _insert_dispatch(db)
        await wait_for(lambda: _at_least(heard, 1))
    assert heard == [("procrastinate_any_queue_v1", {"type": "job_inserted", "job_id": job})]


async def _at_least(items: list[Any], n: int) -> bool:
    return len(items) >= n


async def test_a_cancel_reaches_a_running_job_through_the_listener_not_the_abort_poll(
    make_orc: Callable[..., Orchestrator],
) -> None:
    # Procrastinate polls for abort requests every 5 s, from the worker's start; its own
    # listener is off, so a prompt abort shows that the waker handed the request on.
    orc = make_orc(retry_config=config_with(scripted.TABLE))
    scripted.register(orc)
    async with WorkerRun(orc):
        job_id = await orc.submit("scripted", {"script": ["block"]})
        await asyncio.wait_for(scripted.STARTED.setdefault(job_id, asyncio.Event()).wait(), 3)
        await orc.cancel(job_id, reason="stop")

        async def attempt_gone() -> bool:
            return job_id not in orc.running_jobs()

        await wait_for(attempt_gone, timeout=1.5)
    assert (await orc.get_job(job_id)).status is Status.CANCELLED
