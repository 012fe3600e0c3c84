"""Approval gates and retention, end to end on a real worker (in this process)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any
from uuid import UUID

import psycopg
import pytest

import tasks
from orchestrator import ApprovalError, ConfigError, Orchestrator, Status
from tests.support import agent_app, http_peers, log_guard
from tests.support.external import MessageService, message_service
from tests.support.harness import WorkerRun, config_with, finished, run_prune, wait_for


@pytest.fixture
def service() -> Iterator[MessageService]:
    with message_service() as svc:
        yield svc


async def waiting_for_approval(orc: Orchestrator, job_id: UUID) -> dict[str, Any]:
    async def waiting() -> bool:
        return (await orc.get_job(job_id)).status is Status.WAITING_APPROVAL

    await wait_for(waiting)
    [approval] = [a for a in await orc.approvals() if a["job_id"] == job_id]
    return approval


@pytest.fixture
async def agent(make_orc: Callable[..., Orchestrator]) -> AsyncIterator[Orchestrator]:
    orc = make_orc(retry_config=config_with(agent_app.TABLE))
    agent_app.register(orc)
    async with WorkerRun(orc):
        yield orc


def plan(service: MessageService, **options: Any) -> dict[str, Any]:
    return {"service": service.url, "approval_at": 2, **options}


async def test_approve_resumes_from_the_checkpoint_without_using_budget(
    agent: Orchestrator, service: MessageService
) -> None:
    job_id = await agent.submit("agent", plan(service))
    approval = await waiting_for_approval(agent, job_id)
    assert (approval["question"], approval["step"], approval["status"]) == (
        "go on with step 2?", 2, "pending",
    )  # fmt: skip
    job = await agent.get_job(job_id)
    assert job.lease_token is None and job.locked_by is None
    await agent.approve(approval["id"], by="alice", reason="looks right")
    job = await finished(agent, job_id)
    assert job.status is Status.COMPLETED and job.retry_count == 0
    assert job.result == {
        "log": ["step 1", "step 2 approved by alice sent 'step 2'", "step 3 sent 'step 3'"]
    }
    kinds = [e.kind for e in await agent.job_events(job_id)]
    assert kinds.index("job.waiting_approval") < kinds.index("job.approved")
    [decided] = [a for a in await agent.approvals(status=None) if a["job_id"] == job_id]
    assert (decided["status"], decided["decided_by"], decided["reason"]) == (
        "approved", "alice", "looks right",
    )  # fmt: skip
    assert agent_app.STARTS[(job_id, 1)] == 1  # step 1 was not run again


async def test_reject_fails_the_job_and_records_who_and_why(
    agent: Orchestrator, service: MessageService
) -> None:
    job_id = await agent.submit("agent", plan(service))
    approval = await waiting_for_approval(agent, job_id)
    await agent.reject(approval["id"], by="bob", reason="wrong target")
    job = await finished(agent, job_id)
    assert job.status is Status.FAILED and job.last_error is not None
    assert (job.last_error.code, job.last_error.message) == (
        "APPROVAL_REJECTED", "approval rejected by bob: wrong target",
    )  # fmt: skip
    events = await agent.job_events(job_id)
    assert [e.kind for e in events][-3:] == ["job.rejected", "job.dead_lettered", "job.failed"]
    assert events[-3].payload["decided_by"] == "bob"
    assert sum(service.deliveries.values()) == 0  # step 2's message was never sent


async def test_reject_can_resume_down_the_rejection_path(
    agent: Orchestrator, service: MessageService
) -> None:
    job_id = await agent.submit("agent", plan(service, on_reject="resume"))
    approval = await waiting_for_approval(agent, job_id)
    await agent.reject(approval["id"], by="carol", reason="not today")
    job = await finished(agent, job_id)
    assert job.status is Status.COMPLETED
    assert job.result["log"][1] == "step 2 rejected by carol sent 'step 2'"


@log_guard.fails_jobs("APPROVAL_EXPIRED")
async def test_expired_approvals_are_failed_by_the_periodic_task(
    make_orc: Callable[..., Orchestrator], service: MessageService
) -> None:
    orc = make_orc(
        retry_config=config_with(agent_app.TABLE), approvals_cron="* * * * * *"
    )  # every second (croniter's seconds field)
    agent_app.register(orc)
    async with WorkerRun(orc):
        job_id = await orc.submit("agent", plan(service, approval_expires_in=1))
        await waiting_for_approval(orc, job_id)
        job = await finished(orc, job_id)
        events = await orc.job_events(job_id)
    assert job.status is Status.FAILED and job.last_error is not None
    assert job.last_error.code == "APPROVAL_EXPIRED"
    expired = next(e for e in events if e.kind == "job.approval_expired")
    assert expired.payload["decided_by"] == "expire_approvals"


async def test_decisions_are_checked(agent: Orchestrator, service: MessageService) -> None:
    job_id = await agent.submit("agent", plan(service))
    approval = await waiting_for_approval(agent, job_id)
    with pytest.raises(ApprovalError, match="who decides"):
        await agent.approve(approval["id"], by=" ")
    with pytest.raises(ApprovalError, match="no approval with id"):
        await agent.approve(UUID(int=7), by="alice")
    await agent.approve(approval["id"], by="alice")
    with pytest.raises(ApprovalError, match="already approved"):
        await agent.reject(approval["id"], by="bob", reason="late")
    await finished(agent, job_id)


async def test_cancelling_a_waiting_job_closes_its_approval(
    agent: Orchestrator, service: MessageService
) -> None:
    job_id = await agent.submit("agent", plan(service))
    approval = await waiting_for_approval(agent, job_id)
    await agent.cancel(job_id, reason="superseded", by="dave")
    [closed] = [a for a in await agent.approvals(status=None) if a["id"] == approval["id"]]
    assert (closed["status"], closed["decided_by"]) == ("cancelled", "dave")
    assert (await agent.get_job(job_id)).status is Status.CANCELLED


async def test_retention_prunes_finished_jobs_in_bounded_batches(
    make_orc: Callable[..., Orchestrator],
    db: psycopg.AsyncConnection[Any],
    service: MessageService,
) -> None:
    retention = 2.0  # seconds; a finished job's outcome (finished_at too) cannot be backdated
    orc = make_orc(
        retry_config=config_with(agent_app.TABLE),
        checkpoint_retention_days=retention / 86_400,
        prune_batch_size=2,
    )
    agent_app.register(orc)
    async with WorkerRun(orc) as worker:
        old = [await orc.submit("agent", {"service": service.url}) for _ in range(3)]
        await worker.until_finished(*old)
        await asyncio.sleep(retention + 0.5)
        recent = await orc.submit("agent", {"service": service.url})
        await worker.until_finished(recent)
    async with orc:
        # 3 old jobs: 9 checkpoints and 6 ledger rows; 2 rows per batch, 10 batches at most.
        assert await run_prune(orc) == 9
        for job_id in old:
            assert await orc.job_steps(job_id) == []
            assert (await orc.get_job(job_id)).status is Status.COMPLETED  # the job stays
        assert len(await orc.job_steps(recent)) == 5


# -- the notice that tells a person an approval waits ----------------------------------------


@pytest.fixture
def peers() -> Iterator[http_peers.Peers]:
    with http_peers.serve() as p:
        yield p


def announcing(make_orc: Callable[..., Orchestrator], **settings: Any) -> Orchestrator:
    orc = make_orc(retry_config=config_with(agent_app.TABLE), **settings)
    tasks.register_all(orc)
    agent_app.register(orc)
    return orc


async def test_a_waiting_approval_is_announced_in_the_same_transaction(
    make_orc: Callable[..., Orchestrator],
    peers: http_peers.Peers,
    service: MessageService,
    db: psycopg.AsyncConnection[Any],
) -> None:
    orc = announcing(
        make_orc, approval_target={"channel": "webhook", "url": f"{peers.url}/hooks/ops"}
    )
    async with WorkerRun(orc):
        job_id = await orc.submit("agent", plan(service))
        approval = await waiting_for_approval(orc, job_id)
        [waiting] = [e for e in await orc.job_events(job_id) if e.kind == "job.waiting_approval"]
        notice_id = UUID(waiting.payload["notice_job_id"])
        cur = await db.execute(
            "SELECT count(DISTINCT xmin::text) FROM orc_job_events"
            " WHERE (job_id, kind) IN ((%s, 'job.waiting_approval'), (%s, 'job.created'))",
            [job_id, notice_id],
        )
        assert (await cur.fetchone()) == (1,)  # one transaction wrote both
        notice = await finished(orc, notice_id)
        assert (notice.job_type, notice.status) == ("approval_notify", Status.COMPLETED)
        [received] = peers.received["ops"]
        text = json.loads(received["body"])["text"]
        assert "go on with step 2?" in text and f"approvals approve {approval['id']}" in text
        assert json.loads(received["body"])["about_job_id"] == str(job_id)
        await orc.approve(approval["id"], by="alice", reason="fine")
        assert (await finished(orc, job_id)).status is Status.COMPLETED
    assert len(peers.received["ops"]) == 1  # the resumed step did not announce it again


async def test_a_step_names_its_own_approvers_and_without_any_target_nobody_is_told(
    make_orc: Callable[..., Orchestrator], peers: http_peers.Peers, service: MessageService
) -> None:
    orc = announcing(make_orc)  # neither an approval nor an escalation target
    team = {"channel": "webhook", "url": f"{peers.url}/hooks/team"}
    async with WorkerRun(orc):
        told = await orc.submit("agent", plan(service, approval_notify=team))
        untold = await orc.submit("agent", plan(service))
        for job_id, expected in ((told, 1), (untold, 0)):
            await waiting_for_approval(orc, job_id)
            [event] = [e for e in await orc.job_events(job_id) if e.kind == "job.waiting_approval"]
            assert (event.payload["notice_job_id"] is not None) == bool(expected)

        async def delivered() -> bool:
            return len(peers.received["team"]) == 1

        await wait_for(delivered)
    assert json.loads(peers.received["team"][0]["body"])["about_job_id"] == str(told)


async def test_a_worker_refuses_to_start_when_approval_notices_cannot_be_submitted(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc = announcing(make_orc, approval_target={"channel": "pager", "number": "1"})
    async with orc:
        with pytest.raises(ConfigError, match="ORCHESTRATOR_APPROVAL_TARGET cannot be submitted"):
            await orc.run_worker(install_signal_handlers=False)
