"""Real worker processes, killed with SIGKILL: the sweep recovers their jobs, which resume from
their last checkpoint on another worker without repeating a committed side effect."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator

import pytest

from orchestrator import Orchestrator, Status
from tests.support import agent_app
from tests.support.external import MessageService, message_service
from tests.support.harness import config_with, finished
from tests.support.workers import WorkerProcess


@pytest.fixture
def service() -> Iterator[MessageService]:
    with message_service() as svc:
        yield svc


async def test_a_worker_killed_after_sending_is_resumed_elsewhere_without_resending(
    make_orc: Callable[..., Orchestrator], dsn: str, service: MessageService
) -> None:
    orc = make_orc(retry_config=config_with(agent_app.TABLE))
    agent_app.register(orc)
    async with orc:
        with WorkerProcess(dsn) as first:
            twin = await orc.submit("agent", {"service": service.url})
            expected = (await finished(orc, twin)).result
            service.hold("step 3")  # record step 3's message, then keep the request open
            job_id = await orc.submit("agent", {"service": service.url})
            await asyncio.to_thread(service.held.wait, 30)
            first.signal(signal.SIGKILL)  # sent, and not yet committed
            assert first.wait() == -signal.SIGKILL
            service.release()
        assert (await orc.get_job(job_id)).status is Status.RUNNING
        with WorkerProcess(dsn) as second:
            job = await finished(orc, job_id)
            events = await orc.job_events(job_id)
            steps = await orc.job_steps(job_id)
            assert job.status is Status.COMPLETED, second.output()[-3000:]
    assert job.result == expected
    step3 = f"{job_id}.3.call1"
    assert service.deliveries[step3] == 1  # the message was not sent again
    [ledger] = [s for s in steps if s["invocation_id"] == step3]
    assert ledger["status"] == "committed" and ledger["detail"]["reconciled"] is True
    assert ledger["attempt"] == 2
    # Steps 1 and 2 were committed by the killed attempt and never ran again.
    assert [(s["step"], s["attempt"]) for s in steps if s["kind"] == "checkpoint"] == [
        (1, 1), (2, 1), (3, 2),
    ]  # fmt: skip
    kinds = [e.kind for e in events]
    assert kinds.count("job.zombie_detected") == 1
    # The sweep moved it to RETRY (budget used: a crash is a transient failure), then it ran again.
    detected = kinds.index("job.zombie_detected")
    assert kinds[detected : detected + 3] == [
        "job.zombie_detected",
        "job.retry_scheduled",
        "job.running",
    ]
    assert job.retry_count == 1
    running = [e.payload["worker"] for e in events if e.kind == "job.running"]
    assert len(running) == 2 and running[0] != running[1]  # resumed on another worker
