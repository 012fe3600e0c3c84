"""The agent job of the checkpoint tests: numbered steps, some sending a message through the
side-effect ledger to the test's message service (tests/support/external.py).

Used in process (``register(orc)``) and by worker processes (``--app tests.support.agent_app:orc``).
In process, ``crash`` points make an attempt die where it stands: a BaseException that nothing
catches, so nothing after it runs and nothing is written (as if the process had been killed);
each fires once per job. The transcript a job returns depends only on its plan, so a job that
was interrupted can be compared with an uninterrupted twin.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import timedelta
from typing import Any, Literal
from uuid import UUID

from pydantic import BaseModel

from orchestrator import JobContext, Orchestrator, RetryLater
from tests.support.external import find, send

CRASH_POINTS = ("start", "before_send", "after_send", "before_checkpoint", "after_checkpoint")

#: Its retry config table (tests/support/harness.py: config_with).
TABLE = """
[job_types.agent]
worker_max_attempts = 1   # a crash leaves a zombie for the sweep, not a Procrastinate retry
app_max_retries = 50
"""
FIRED: set[tuple[UUID, str]] = set()  # crash points and one-off failures already fired
STARTS: Counter[tuple[UUID, int]] = Counter()  # how often each step of each job started
RECONCILES: Counter[str] = Counter()  # reconcile() calls per invocation id


class Plan(BaseModel):
    service: str
    steps: int = 3
    send_at: list[int] = [2, 3]
    crash: list[str] = []  # "<point>:<step>", see CRASH_POINTS
    transient_at: list[int] = []  # steps that fail once with a transient error (an orderly end)
    transient_after_send_at: list[int] = []  # ... the same, once the step's message was sent
    approval_at: int | None = None
    on_reject: Literal["fail", "resume"] = "fail"
    approval_expires_in: float = 3600
    approval_notify: dict[str, Any] | None = None  # the step's own notice target
    step_seconds: float = 0.0  # time each step takes before its checkpoint
    #: In a step that sends: wait this long, then send a second message (two side effects in one
    #: step: the first one's result is held, not yet committed, while the second is made).
    second_send_after: float | None = None
    slow_step: int | None = None  # in the job's first attempt, this step takes slow_seconds
    slow_seconds: float = 30.0


class State(BaseModel):
    log: list[str] = []


class SimulatedCrash(BaseException):
    """The attempt dies here."""


def _once(job_id: UUID, what: str) -> bool:
    if (job_id, what) in FIRED:
        return False
    FIRED.add((job_id, what))
    return True


def register(orc: Orchestrator) -> None:
    @orc.job_type("agent")
    async def agent(ctx: JobContext, plan: Plan) -> dict[str, Any]:
        def crash(point: str, step: int) -> None:
            if f"{point}:{step}" in plan.crash and _once(ctx.job_id, f"{point}:{step}"):
                raise SimulatedCrash(f"{point}:{step}")

        steps = ctx.steps(State, initial=State(), max_steps=plan.steps)
        async for step in steps:
            n = step.number
            STARTS[(ctx.job_id, n)] += 1
            crash("start", n)
            if n in plan.transient_at and _once(ctx.job_id, f"transient:{n}"):
                raise RetryLater(0.01, f"step {n} hit a rate limit")
            line = f"step {n}"
            if plan.approval_at == n:
                decision = await step.approval(
                    f"go on with step {n}?",
                    expires_in=timedelta(seconds=plan.approval_expires_in),
                    details={"step": n},
                    on_reject=plan.on_reject,
                    notify=plan.approval_notify,
                )
                line += f" {decision.status} by {decision.decided_by}"
            if n in plan.send_at:

                async def call(invocation_id: str, n: int = n) -> dict[str, Any]:
                    crash("before_send", n)
                    receipt = await send(plan.service, invocation_id, f"step {n}")
                    crash("after_send", n)  # delivered, but the ledger does not know yet
                    return receipt

                async def reconcile(invocation_id: str) -> Any:
                    RECONCILES[invocation_id] += 1
                    return await find(plan.service, invocation_id)

                receipt = await step.effect("send", call, args={"step": n}, reconcile=reconcile)
                line += f" sent {receipt['text']!r}"
                if plan.second_send_after is not None:
                    await asyncio.sleep(plan.second_send_after)
                    await step.effect("send", call, args={"step": n}, reconcile=reconcile)
                if n in plan.transient_after_send_at and _once(ctx.job_id, f"after_send:{n}"):
                    raise RetryLater(0.01, f"step {n} hit a rate limit after sending")
            seconds = plan.step_seconds
            if ctx.attempt == 1 and plan.slow_step == n:
                seconds = plan.slow_seconds
            if seconds:
                await asyncio.sleep(seconds)
            crash("before_checkpoint", n)
            await step.checkpoint(State(log=[*step.state.log, line]), final=n == plan.steps)
            crash("after_checkpoint", n)
        return {"log": steps.state.log}


orc = Orchestrator()  # for worker processes; settings come from their environment
register(orc)
