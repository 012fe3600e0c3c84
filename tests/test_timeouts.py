"""The timeout hierarchy (docs/contracts.md, "Timeouts"), innermost first: a call, a step, the job, and
the backstop for an attempt that outlives its job timeout. Real PostgreSQL, a real worker in
this process, real slow peers on 127.0.0.1; limits shortened in TABLES below and tests/support/retry_config.toml."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any
from uuid import UUID

import httpx
import pytest
from pydantic import BaseModel

import tasks
from orchestrator import CallTimedOut, ErrorClass, JobContext, Orchestrator, Status
from orchestrator.runtime.calls import http_client
from retry_config import JobRetryConfig
from tests.support import log_guard
from tests.support.harness import WorkerRun, config_with, run_sweep, wait_for
from tests.support.slow_peers import trickle_server, unreachable

STEP_RUNS: Counter[tuple[UUID, int]] = Counter()
STUBBORN: Counter[UUID] = Counter()  # cancellations a stubborn attempt swallowed


class StepPlan(BaseModel):
    steps: int = 3
    hang_step: int = 2
    hang_attempts: int = 1  # the step hangs in the job's first N attempts
    swallow: bool = False  # hang by swallowing the cancellation, then try to commit
    block_seconds: float = 0  # first block the event loop this long (a synchronous call)


class ToolCall(BaseModel):
    tool: str
    seconds: float


#: The retry config tables of the job types below.
TABLES = """
[job_types.stepper]
step_timeout_seconds = 1
call_timeout_ms = 500
connect_timeout_ms = 100

[job_types.tool_user]
tool_timeouts_ms = { slow_tool = 200 }

[job_types.stubborn]
app_max_retries = 3
"""


def register(orc: Orchestrator) -> None:
    tasks.register_all(orc)

    @orc.job_type("stepper")
    async def stepper(ctx: JobContext, plan: StepPlan) -> list[int]:
        steps = ctx.steps(list[int], initial=[], max_steps=plan.steps)
        async for step in steps:
            STEP_RUNS[(ctx.job_id, step.number)] += 1
            if step.number == plan.hang_step and ctx.attempt <= plan.hang_attempts:
                time.sleep(plan.block_seconds)  # noqa: ASYNC251 (the point: a blocked loop)
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    if not plan.swallow:
                        raise
            await step.checkpoint([*step.state, step.number])
        return steps.state

    @orc.job_type("tool_user")
    async def tool_user(ctx: JobContext, call: ToolCall) -> dict[str, Any]:
        async with ctx.call_limit(call.tool):
            await asyncio.sleep(call.seconds)
        return {"tool": call.tool, "limit": ctx.config.call_timeout(call.tool)}

    @orc.job_type("stubborn")
    async def stubborn(ctx: JobContext, payload: None) -> dict[str, int]:
        """Its first attempt ignores cancellation (as a library that swallows it would) and
        keeps running, heartbeats and all, until it learns it lost its job."""
        while ctx.attempt == 1 and not ctx.should_abort():
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                STUBBORN[ctx.job_id] += 1
        return {"attempt": ctx.attempt}


@pytest.fixture
def orc(make_orc: Callable[..., Orchestrator]) -> Orchestrator:
    app = make_orc(
        retry_config=config_with(TABLES),
        heartbeat_interval=0.1,
        zombie_threshold=1.0,
        job_expiry_grace_seconds=0.5,
    )
    register(app)
    return app


def failures(events: list[Any]) -> list[dict[str, Any]]:
    return [e.payload for e in events if e.kind == "job.failed"]


# -- call ---------------------------------------------------------------------------------------


async def test_the_total_call_timeout_cuts_a_response_that_trickles_in() -> None:
    """httpx's read timeout is per chunk; the total limit bounds the whole call."""
    config = JobRetryConfig(call_timeout_ms=500, connect_timeout_ms=100)
    with trickle_server() as peer:
        async with http_client(config) as client:
            started = time.monotonic()
            with pytest.raises(httpx.ReadTimeout, match=r"total timeout of 0\.5 s"):
                await client.get(f"{peer.url}/trickle?chunks=20&every=0.1")
            assert time.monotonic() - started < 1.5  # the server needed 2 s to finish
            # a call inside its limit is untouched, body included
            response = await client.get(f"{peer.url}/trickle?chunks=2&every=0.05")
            assert response.text == "chunk 0\nchunk 1\n"
        assert peer.requests["/trickle"] == 2  # no transport retries
        assert peer.chunks_sent["/trickle"] < 20


async def test_the_total_call_timeout_bounds_a_streamed_body_too() -> None:
    # The body takes 4 s, the call may take 1 (a connect on a loaded machine may take more
    # than a few milliseconds: the test is of the body's time, not the connect's).
    config = JobRetryConfig(call_timeout_ms=1_000, connect_timeout_ms=1_000)
    with trickle_server() as peer:
        async with (
            http_client(config) as client,
            client.stream("GET", f"{peer.url}/trickle?chunks=40&every=0.1") as response,
        ):
            with pytest.raises(httpx.ReadTimeout):
                async for _ in response.aiter_bytes():
                    pass


@log_guard.fails_jobs("RESPONSE_TIMEOUT")
async def test_a_response_timeout_is_transient_app_and_retried_by_the_app_layer(
    orc: Orchestrator,
) -> None:
    with trickle_server() as peer:
        async with WorkerRun(orc) as worker:
            job_id = await orc.submit(
                "http_request", {"url": f"{peer.url}/trickle?chunks=30&every=0.1"}, max_retries=1
            )
            await worker.until_finished(job_id)
        job, events = await orc.get_job(job_id), await orc.job_events(job_id)
        assert job.status is Status.FAILED and (job.attempt, job.retry_count) == (2, 1)
        first, last = failures(events)
        assert first["error"]["code"] == "RESPONSE_TIMEOUT" and first["layer"] == "app"
        assert first["error"]["classification"] == "TRANSIENT_APP" and not first["terminal"]
        assert last["terminal"]
        assert job.last_error is not None and "total timeout of 1 s" in job.last_error.message
        assert peer.requests["/trickle"] == 2  # one request per attempt


@log_guard.fails_jobs("CONNECT_TIMEOUT")
async def test_a_connect_timeout_is_transient_infra(orc: Orchestrator) -> None:
    with unreachable() as url:
        async with WorkerRun(orc) as worker:
            job_id = await orc.submit("http_request", {"url": url})
            await worker.until_finished(job_id)
    job = await orc.get_job(job_id)
    assert job.status is Status.FAILED and job.last_error is not None
    assert job.last_error.code == "CONNECT_TIMEOUT"
    assert job.last_error.classification is ErrorClass.TRANSIENT_INFRA


@log_guard.fails_jobs("CALL_TIMEOUT")
async def test_each_tool_has_its_own_call_limit(orc: Orchestrator) -> None:
    async with WorkerRun(orc) as worker:
        slow = await orc.submit("tool_user", {"tool": "slow_tool", "seconds": 5}, max_retries=0)
        other = await orc.submit("tool_user", {"tool": "other_tool", "seconds": 0.4})
        await worker.until_finished(slow, other)
    job = await orc.get_job(slow)
    assert job.status is Status.FAILED and job.last_error is not None
    assert job.last_error.message == "tool 'slow_tool' timed out after 0.2 seconds"
    assert (job.last_error.code, job.last_error.classification) == (
        "CALL_TIMEOUT", ErrorClass.TRANSIENT_APP,
    )  # fmt: skip
    # 0.4 s is over slow_tool's limit but inside the type's call_timeout_ms (10 s)
    assert (await orc.get_job(other)).result == {"tool": "other_tool", "limit": 10.0}


async def test_call_limit_does_not_claim_timeouts_raised_inside_it() -> None:
    from orchestrator.runtime.calls import call_limit

    with pytest.raises(CallTimedOut, match=r"inner timed out after 0\.05"):
        async with call_limit(5, "outer"), call_limit(0.05, "inner"):
            await asyncio.sleep(1)


# -- step ---------------------------------------------------------------------------------------


async def test_a_step_that_overruns_is_retried_from_the_last_checkpoint(
    orc: Orchestrator,
) -> None:
    async with WorkerRun(orc) as worker:
        job_id = await orc.submit("stepper", {})
        await worker.until_finished(job_id)
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    assert job.status is Status.COMPLETED and job.result == [1, 2, 3]
    [failed] = failures(events)
    assert failed["error"] == {
        "message": "Step 2 timed out after 1 seconds", "code": "STEP_TIMEOUT",
        "classification": "TRANSIENT_APP",
    }  # fmt: skip
    assert failed["layer"] == "app" and not failed["terminal"]
    assert (job.attempt, job.retry_count) == (2, 1)
    # step 1 was committed and never ran again; step 2 ran again in the second attempt
    assert [STEP_RUNS[(job_id, n)] for n in (1, 2, 3)] == [1, 2, 1]


async def test_a_step_that_swallows_its_cancellation_still_does_not_commit(
    orc: Orchestrator,
) -> None:
    async with WorkerRun(orc) as worker:
        job_id = await orc.submit("stepper", {"swallow": True})
        await worker.until_finished(job_id)
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    assert job.status is Status.COMPLETED and job.result == [1, 2, 3]
    assert [f["error"]["code"] for f in failures(events)] == ["STEP_TIMEOUT"]
    assert [STEP_RUNS[(job_id, n)] for n in (1, 2, 3)] == [1, 2, 1]
    history = await orc.job_steps(job_id)
    assert [(s["step"], s["attempt"]) for s in history] == [(1, 1), (2, 2), (3, 2)]


@log_guard.fails_jobs("STEP_TIMEOUT")
async def test_steps_that_keep_overrunning_spend_the_budget_and_fail(
    orc: Orchestrator,
) -> None:
    async with WorkerRun(orc) as worker:
        job_id = await orc.submit("stepper", {"hang_attempts": 9}, max_retries=1)
        await worker.until_finished(job_id)
    job = await orc.get_job(job_id)
    assert job.status is Status.FAILED and job.last_error is not None
    assert job.last_error.code == "STEP_TIMEOUT" and job.last_error.terminal
    assert [await orc.dead_letters()][0][0].job_id == job_id


# -- job and backstop ---------------------------------------------------------------------------


@log_guard.fails_jobs("JOB_TIMEOUT")
@pytest.mark.parametrize("block_seconds", [0, 1.5], ids=["awaiting", "loop-blocked"])
async def test_a_timeout_given_at_submit_shortens_the_job_and_its_steps(
    orc: Orchestrator, block_seconds: float
) -> None:
    """The step limit never outlasts the job: with the job's own timeout at 1 s, the job
    timeout (terminal) is what fires, with the design's message. Also when both limits come
    due in the same turn of the event loop (a step blocking it past both), as they may on a
    loaded machine: the step's timer then fires too, and the job's timeout still wins."""
    plan = {"hang_attempts": 9, "block_seconds": block_seconds}
    async with WorkerRun(orc) as worker:
        job_id = await orc.submit("stepper", plan, timeout_seconds=1)
        await worker.until_finished(job_id)
    job = await orc.get_job(job_id)
    assert job.status is Status.FAILED and job.last_error is not None
    assert job.last_error.message == "Job timed out after 1 seconds"
    assert (job.last_error.code, job.retry_count) == ("JOB_TIMEOUT", 0)


async def test_the_backstop_sweeps_an_attempt_that_outlives_its_timeout_while_heartbeating(
    orc: Orchestrator,
) -> None:
    """The job timeout fires but the task swallows it and runs on, heartbeats included. Once
    past its deadline plus the expiry grace, the sweep takes the job all the same; the heartbeat
    then finds the lease gone and stops the attempt, which writes nothing."""
    async with WorkerRun(orc) as worker:
        job_id = await orc.submit("stubborn", None, timeout_seconds=1)

        async def swept() -> bool:
            await run_sweep(orc)  # what the periodic task does each tick
            return (await orc.get_job(job_id)).retry_count == 1

        await wait_for(swept, timeout=10, interval=0.1)
        await worker.until_finished(job_id)
        await asyncio.sleep(0.3)  # a stale write, if any were let through, would land here
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    assert job.status is Status.COMPLETED and job.result == {"attempt": 2}
    assert STUBBORN[job_id] >= 2  # the job timeout's cancellation, then the heartbeat's
    [zombie] = [e.payload for e in events if e.kind == "job.zombie_detected"]
    assert zombie["reason"] == "deadline" and zombie["attempt"] == 1
    kinds = [e.kind for e in events]
    assert kinds.index("job.retry_scheduled") == kinds.index("job.zombie_detected") + 1
    assert kinds.count("job.completed") == 1 and not failures(events)
