"""Checkpointed steps and the side-effect ledger, on real PostgreSQL, a real worker (in this
process) and a real message service on 127.0.0.1. Crashes are simulated in process (an attempt
dies at a chosen point and the zombie sweep recovers its job); tests/test_crash.py kills real
worker processes."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any
from uuid import UUID

import psycopg
import pytest

from checkpoints import CheckpointStore, Fence, Ledger
from orchestrator import ErrorClass, JobContext, Orchestrator, PermanentError, StaleLease, Status
from orchestrator.services.sweep import ZombieSweep
from tests.support import agent_app, log_guard
from tests.support.agent_app import CRASH_POINTS, RECONCILES, STARTS
from tests.support.external import MessageService, find, message_service, send
from tests.support.harness import WorkerRun, config_with


@pytest.fixture
def service() -> Iterator[MessageService]:
    with message_service() as svc:
        yield svc


@pytest.fixture
async def agent(make_orc: Callable[..., Orchestrator]) -> AsyncIterator[Orchestrator]:
    orc = make_orc(retry_config=config_with(agent_app.TABLE))
    agent_app.register(orc)
    async with WorkerRun(orc):
        yield orc


async def dispatch_status(orc: Orchestrator, job_id: UUID) -> str | None:
    async with orc.stores.queries.pool.connection() as conn:
        cur = await conn.execute(
            "SELECT p.status::text AS status FROM procrastinate_jobs p "
            "JOIN orc_jobs j ON j.procrastinate_job_id = p.id WHERE j.id = %s",
            (job_id,),
        )
        row = await cur.fetchone()
    return row["status"] if row else None


async def drive(orc: Orchestrator, job_id: UUID, timeout: float = 20) -> Any:
    """Wait for the job to finish, recovering it (as the zombie sweep would) each time an
    attempt crashed: RUNNING, no attempt alive here, its dispatch failed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (job := await orc.get_job(job_id)).finished_at is None:
        if loop.time() > deadline:
            raise AssertionError(f"job {job_id} did not finish: {job.status}")
        if (
            job.status is Status.RUNNING
            and job_id not in orc.running_jobs()
            and await dispatch_status(orc, job_id) == "failed"
        ):
            await ZombieSweep(
                stores=orc.stores,
                failures=orc.failures,
                config=orc.live_config,
                threshold=0,
                expiry_grace=60,
                batch_size=10,
                limit=10,
            ).run_once()
        await asyncio.sleep(0.01)
    return job


def plan(service: MessageService, **options: Any) -> dict[str, Any]:
    return {"service": service.url, **options}


UNINTERRUPTED = ["step 1", "step 2 sent 'step 2'", "step 3 sent 'step 3'"]


async def test_a_stepped_job_runs_each_step_once(
    agent: Orchestrator, service: MessageService
) -> None:
    job_id = await agent.submit("agent", plan(service))
    job = await drive(agent, job_id)
    assert job.status is Status.COMPLETED and job.result == {"log": UNINTERRUPTED}
    assert [STARTS[(job_id, n)] for n in (1, 2, 3)] == [1, 1, 1]
    steps = await agent.job_steps(job_id)
    assert [(s["kind"], s["step"]) for s in steps if s["kind"] == "checkpoint"] == [
        ("checkpoint", 1), ("checkpoint", 2), ("checkpoint", 3),
    ]  # fmt: skip
    effects = [s for s in steps if s["kind"] == "side_effect"]
    assert [(e["step"], e["status"], e["invocation_id"]) for e in effects] == [
        (2, "committed", f"{job_id}.2.call1"), (3, "committed", f"{job_id}.3.call1"),
    ]  # fmt: skip
    checkpointed = [
        e.payload for e in await agent.job_events(job_id) if e.kind == "job.checkpointed"
    ]
    assert checkpointed == [
        {"step": 1, "final": False, "effects_committed": 0},
        {"step": 2, "final": False, "effects_committed": 1},
        {"step": 3, "final": True, "effects_committed": 1},
    ]
    assert service.duplicates() == {} and sum(service.deliveries.values()) == 2


async def test_a_retried_job_resumes_after_its_last_checkpoint(
    agent: Orchestrator, service: MessageService
) -> None:
    job_id = await agent.submit("agent", plan(service, transient_at=[3]))
    job = await drive(agent, job_id)
    assert job.status is Status.COMPLETED and job.result == {"log": UNINTERRUPTED}
    assert job.retry_count == 1
    assert [STARTS[(job_id, n)] for n in (1, 2, 3)] == [1, 1, 2]  # steps 1-2 never run again


async def test_an_orderly_failure_commits_what_was_sent(
    agent: Orchestrator, service: MessageService
) -> None:
    # Step 3 sends, then its attempt fails (transiently) before the checkpoint: the attempt
    # commits the result it holds, so the retry gets it from the ledger, with no reconcile and
    # no second send.
    job_id = await agent.submit("agent", plan(service, transient_after_send_at=[3]))
    job = await drive(agent, job_id)
    assert job.status is Status.COMPLETED and job.result == {"log": UNINTERRUPTED}
    invocation = f"{job_id}.3.call1"
    assert service.deliveries[invocation] == 1 and RECONCILES[invocation] == 0
    assert STARTS[(job_id, 3)] == 2


@log_guard.crashes
async def test_a_crash_after_sending_is_reconciled_not_resent(
    agent: Orchestrator, service: MessageService
) -> None:
    job_id = await agent.submit("agent", plan(service, crash=["after_send:3"]))
    job = await drive(agent, job_id)
    assert job.status is Status.COMPLETED and job.result == {"log": UNINTERRUPTED}
    invocation = f"{job_id}.3.call1"
    assert service.deliveries[invocation] == 1  # sent once, never again
    assert RECONCILES[invocation] == 1  # the resumed attempt asked the service
    [effect] = [s for s in await agent.job_steps(job_id) if s["invocation_id"] == invocation]
    assert effect["status"] == "committed" and effect["detail"]["reconciled"] is True
    kinds = [e.kind for e in await agent.job_events(job_id)]
    assert "job.zombie_detected" in kinds
    assert [STARTS[(job_id, n)] for n in (1, 2, 3)] == [1, 1, 2]


@log_guard.crashes
async def test_a_crash_before_sending_sends_once(
    agent: Orchestrator, service: MessageService
) -> None:
    job_id = await agent.submit("agent", plan(service, crash=["before_send:2"]))
    job = await drive(agent, job_id)
    assert job.result == {"log": UNINTERRUPTED}
    invocation = f"{job_id}.2.call1"
    assert service.deliveries[invocation] == 1
    assert RECONCILES[invocation] == 1  # asked; the service had nothing; then sent


@log_guard.crashes
@pytest.mark.parametrize(
    ("seed", "runs"),
    [(20261121, 40), pytest.param(20261121, 200, marks=pytest.mark.slow)],
    ids=["40-runs", "200-runs"],
)
async def test_randomized_crashes_never_repeat_a_committed_side_effect(
    agent: Orchestrator, service: MessageService, seed: int, runs: int
) -> None:
    """Runs of a 4-step job (40 in the default suite, 200 in the slow one), each with up to
    three crashes at random points and, now and then, a transient failure: every run ends as
    its uninterrupted twin, and no message is ever delivered twice."""
    rng = random.Random(seed)
    crashed = 0
    for run in range(runs):
        send_at = sorted(rng.sample([1, 2, 3, 4], rng.randint(1, 3)))
        crashes = [
            f"{rng.choice(CRASH_POINTS)}:{rng.randint(1, 4)}" for _ in range(rng.randint(0, 3))
        ]
        transient = [rng.randint(1, 4)] if rng.random() < 0.3 else []
        twin = await agent.submit("agent", plan(service, steps=4, send_at=send_at))
        job = await agent.submit(
            "agent", plan(service, steps=4, send_at=send_at, crash=crashes, transient_at=transient)
        )
        expected = (await drive(agent, twin)).result
        final = await drive(agent, job)
        assert final.status is Status.COMPLETED, (run, crashes, final.last_error)
        assert final.result == expected, (run, crashes, transient)
        crashed += any(e.kind == "job.zombie_detected" for e in await agent.job_events(job))
    assert service.duplicates() == {}
    assert crashed > runs // 2  # most runs were interrupted at least once


async def test_a_plain_task_effect_commits_at_once_and_is_not_repeated(
    make_orc: Callable[..., Orchestrator], service: MessageService
) -> None:
    orc = make_orc()
    sends: list[str] = []

    @orc.job_type("notify")
    async def notify(ctx: JobContext, payload: dict[str, Any]) -> dict[str, Any]:
        async def call(invocation_id: str) -> dict[str, Any]:
            sends.append(invocation_id)
            return await send(service.url, invocation_id, payload["text"])

        receipt = await ctx.effect(
            "send", call, key="message", reconcile=lambda inv: find(service.url, inv)
        )
        if ctx.attempt == 1:
            raise RuntimeError("the database blinked after the send")  # infra: retried
        return receipt

    async with WorkerRun(orc) as worker:
        job_id = await orc.submit("notify", {"text": "hello"})
        await worker.until_finished(job_id, timeout=20)
    job = await orc.get_job(job_id)
    assert job.status is Status.COMPLETED and job.result["text"] == "hello"
    assert sends == [f"{job_id}.1.message"] and service.duplicates() == {}


@log_guard.fails_jobs("JOB_TIMEOUT", "STOPPED_AFTER_SEND")
@pytest.mark.parametrize("ending", ["timed out inside the call", "failed after it"])
async def test_a_requeued_job_never_repeats_its_dead_one_s_effects(
    make_orc: Callable[..., Orchestrator], service: MessageService, ending: str
) -> None:
    """A job dead-lettered with an effect of unknown outcome (its call timed out: pending) or
    a committed one: the checkpoint prune keeps its ledger while the letter awaits review, and
    its requeue reconciles the pending effect, or returns the committed one's result, under the
    same invocation id, instead of calling again."""
    orc = make_orc()
    sends: list[str] = []
    reconciles: list[str] = []
    first: list[UUID] = []

    @orc.job_type("notify")
    async def notify(ctx: JobContext, payload: dict[str, Any]) -> dict[str, Any]:
        async def call(invocation_id: str) -> dict[str, Any]:
            sends.append(invocation_id)
            receipt = await send(service.url, invocation_id, payload["text"])
            if ctx.job_id in first and ending == "timed out inside the call":
                await asyncio.sleep(3600)  # the job's timeout ends it here
            return receipt

        async def reconcile(invocation_id: str) -> Any:
            reconciles.append(invocation_id)
            return await find(service.url, invocation_id)

        receipt = await ctx.effect("send", call, key="message", reconcile=reconcile)
        if ctx.job_id in first:
            raise PermanentError("stopped after the send", code="STOPPED_AFTER_SEND")
        return receipt

    async with WorkerRun(orc) as worker:
        first.append(await orc.submit("notify", {"text": "hello"}, max_retries=0,
                                      timeout_seconds=2))  # fmt: skip
        await worker.until_finished(first[0], timeout=60)
        [letter] = await orc.dead_letters()
        await CheckpointStore(orc.stores.queries).prune(older_than_seconds=0, limit=1000)
        [kept] = await orc.job_steps(first[0])
        assert kept["status"] == ("pending" if ending.startswith("timed") else "committed")

        replay = await orc.requeue_dead_letter(letter.id)
        await worker.until_finished(replay, timeout=60)
    job = await orc.get_job(replay)
    assert job.status is Status.COMPLETED and job.result["text"] == "hello", job.last_error
    invocation = f"{first[0]}.1.message"
    assert sends == [invocation] and service.duplicates() == {}
    assert reconciles == ([invocation] if ending.startswith("timed") else [])
    [effect] = await orc.job_steps(replay)
    assert (effect["invocation_id"], effect["status"]) == (invocation, "committed")


@log_guard.fails_jobs("EFFECT_NOT_RECONCILABLE")
async def test_a_non_idempotent_effect_without_reconcile_is_refused_before_sending(
    make_orc: Callable[..., Orchestrator], service: MessageService
) -> None:
    orc = make_orc()

    @orc.job_type("careless")
    async def careless(ctx: JobContext, payload: None) -> Any:
        return await ctx.effect("send", lambda inv: send(service.url, inv, "x"), key="k")

    async with WorkerRun(orc) as worker:
        job_id = await orc.submit("careless")
        await worker.until_finished(job_id)
    job = await orc.get_job(job_id)
    assert job.status is Status.FAILED and job.last_error is not None
    assert job.last_error.classification is ErrorClass.PERMANENT
    assert "give reconcile=" in job.last_error.message
    assert sum(service.deliveries.values()) == 0


@log_guard.fails_jobs("CHECKPOINT_MISSING")
async def test_a_step_without_checkpoint_fails_the_job_clearly(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc = make_orc()

    @orc.job_type("forgetful")
    async def forgetful(ctx: JobContext, payload: None) -> None:
        async for _step in ctx.steps(int, initial=0):
            pass  # never checkpoints

    async with WorkerRun(orc) as worker:
        job_id = await orc.submit("forgetful")
        await worker.until_finished(job_id)
    job = await orc.get_job(job_id)
    assert job.status is Status.FAILED and job.last_error is not None
    assert job.last_error.code == "CHECKPOINT_MISSING"
    assert "step 1 ended without step.checkpoint" in job.last_error.message


async def test_a_stale_attempt_cannot_checkpoint_or_commit(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any], service: MessageService
) -> None:
    orc = make_orc(retry_config=config_with(agent_app.TABLE))
    agent_app.register(orc)
    async with orc:
        job_id = await orc.submit("agent", plan(service))
        await db.execute(
            "UPDATE orc_jobs SET status = 'RUNNING', lease_token = gen_random_uuid(), "
            "attempt = 1 WHERE id = %s",
            (job_id,),
        )
        lease = (await orc.get_job(job_id)).lease_token
        assert lease is not None
        ledger = Ledger(CheckpointStore(orc.stores.queries), Fence(job_id, lease, 1), [])

        def effect(key: str, text: str, **options: Any) -> Any:
            return ledger.effect(
                step=1, key=key, name="send", call=lambda inv: send(service.url, inv, text),
                args={"text": text}, result_type=Any, **options,
            )  # fmt: skip

        sent = await effect("k1", "x", idempotent=False, reconcile=lambda i: find(service.url, i),
                            commit_now=False)  # fmt: skip
        assert sent["text"] == "x"
        await ledger.store.record_event(ledger.fence, "job.model_fallback", {"from": "a"})
        written = [e for e in await orc.job_events(job_id) if e.kind == "job.model_fallback"]
        assert [e.payload for e in written] == [{"from": "a"}]  # while the lease is its own
        # The job is handed to another attempt (a sweep, a redispatch) ...
        await db.execute(
            "UPDATE orc_jobs SET lease_token = gen_random_uuid() WHERE id = %s", (job_id,)
        )
        # ... so this one can commit nothing: not the result it holds, not its step, and it
        # cannot even record another side effect (so it does not send it).
        with pytest.raises(StaleLease):
            await ledger.flush()
        with pytest.raises(StaleLease):
            await ledger.checkpoint(1, {"log": ["step 1"]}, final=False)
        with pytest.raises(StaleLease):
            await effect("k2", "y", idempotent=True, reconcile=None, commit_now=True)
        with pytest.raises(StaleLease):  # nor an event about its work (job.model_fallback)
            await ledger.store.record_event(ledger.fence, "job.model_fallback", {"from": "a"})
        steps = await orc.job_steps(job_id)
        kinds = [e.kind for e in await orc.job_events(job_id)]
    assert kinds.count("job.model_fallback") == 1  # the stale one wrote nothing
    assert [(s["kind"], s["invocation_id"], s["status"]) for s in steps] == [
        ("side_effect", f"{job_id}.1.k1", "pending")  # left for the next attempt to reconcile
    ]
    assert dict(service.deliveries) == {f"{job_id}.1.k1": 1}  # "y" was never sent
