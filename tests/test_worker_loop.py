"""The worker's fetch loop (orchestrator.worker.Worker._fetch_and_process_jobs), which replaces
Procrastinate's: slots (freed as soon as a dispatch is finished), stops, an empty queue, and the
upstream loop it was copied from; and
Procrastinate's log records, whose fields the worker builds only when a record is made.

The polling interval is a minute throughout: whatever these tests wait for must come from the
loop's own wake-ups (a slot freed, a stop), never from a poll.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
from collections.abc import Callable
from typing import Any
from uuid import UUID

import pytest
from procrastinate import worker as procrastinate_worker

from orchestrator import JobContext, Orchestrator, Status
from orchestrator.store import TASK_PREFIX
from orchestrator.worker import Worker
from tests import scripted
from tests.conftest import WorkerRun

#: sha256 of procrastinate 3.10's Worker._fetch_and_process_jobs, which ours replaces.
UPSTREAM_LOOP = "2963aa354dfda4d6bc639d907cbabb23c69d1381382b2560fb7735b0429117cb"


def test_the_upstream_loop_is_the_one_this_worker_was_written_against() -> None:
    source = inspect.getsource(procrastinate_worker.Worker._fetch_and_process_jobs)
    assert hashlib.sha256(source.encode()).hexdigest() == UPSTREAM_LOOP, (
        "Procrastinate's fetch loop changed: compare it with "
        "orchestrator.worker.Worker._fetch_and_process_jobs and _start (how a job's context and "
        "task are made, when a slot is released), then record the new digest here"
    )


async def queued(make_orc: Callable[..., Orchestrator], n: int) -> tuple[Orchestrator, list[UUID]]:
    """An orchestrator polling once a minute, with ``n`` jobs waiting that succeed."""
    orc = make_orc(fetch_polling_interval=60)
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


async def test_a_slot_is_free_once_its_dispatch_is_finished_before_its_task_ends(
    make_orc: Callable[..., Orchestrator], monkeypatch: pytest.MonkeyPatch
) -> None:
    # As each job's task ends: whether its slot was still taken. Only the jobs' dispatches: a
    # worker running across a minute's tick also runs its maintenance tasks.
    still_held = []
    ended = Worker._ended

    def spy(self: Worker, task: asyncio.Task[Any]) -> None:
        dispatch = self._running_jobs[task].job
        if dispatch.task_name.startswith(TASK_PREFIX):
            still_held.append(dispatch.id in self._slots_held)
        ended(self, task)
        # Nothing released twice: the semaphore never counts more slots than there are.
        assert self._job_semaphore._value <= self.concurrency  # type: ignore[attr-defined]

    monkeypatch.setattr(Worker, "_ended", spy)
    orc, job_ids = await queued(make_orc, 3)
    async with WorkerRun(orc, concurrency=2) as worker:
        await worker.until_finished(*job_ids, timeout=10)
    await assert_completed(orc, job_ids)
    assert still_held == [False, False, False]


async def test_a_stop_ends_an_idle_worker_at_once(make_orc: Callable[..., Orchestrator]) -> None:
    orc = make_orc(fetch_polling_interval=60)
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


async def test_procrastinate_log_records_still_carry_their_fields(
    make_orc: Callable[..., Orchestrator], caplog: pytest.LogCaptureFixture
) -> None:
    # The worker builds them only for records that are made (orchestrator.worker._LazyExtra).
    orc = make_orc(fetch_polling_interval=60)
    scripted.register(orc)
    with caplog.at_level(logging.INFO, logger="procrastinate.worker"):
        async with WorkerRun(orc, concurrency=1) as worker:
            job_id = await orc.submit("scripted", {"script": ["ok"]})
            await worker.until_finished(job_id, timeout=10)
    ours = [r for r in caplog.records if getattr(r, "job", {}).get("task_name") == "orc.scripted"]
    started = [r for r in ours if r.__dict__["action"] == "start_job"]
    succeeded = [r for r in ours if r.__dict__["action"] == "job_success"]
    assert len(started) == len(succeeded) == 1
    assert started[0].__dict__["job"]["task_kwargs"] == {"job_id": str(job_id)}
    assert started[0].__dict__["worker"]["name"] == "orchestrator"
    assert succeeded[0].__dict__["start_timestamp"] <= succeeded[0].__dict__["end_timestamp"]
