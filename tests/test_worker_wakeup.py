"""The worker starts scheduled work when it is due, not at Procrastinate's next poll.

These tests set the polling interval to a minute: without the due-time waker, the retries below
would wait for it. They also guard the two Procrastinate internals the worker relies on.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from orchestrator import Orchestrator, Status
from tests import scripted
from tests.conftest import WorkerRun


async def test_app_retries_start_when_due_not_at_the_next_poll(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc = make_orc(fetch_polling_interval=60)
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
    orc = make_orc(fetch_polling_interval=60)
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
