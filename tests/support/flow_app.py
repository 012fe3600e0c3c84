"""The flow-control tests' application (docs/flow-control.md): ``hold`` jobs that run for a
while under a concurrency limit, ``tick`` and ``late_call`` jobs under a rate limit, ``spend``
jobs (a call of a given real usage) under a metered key, ``hold_slot`` and ``hold_tokens`` under
keys that cap one tenant's share, ``in_turn`` jobs under a key of one at a time that tenants
share, the built-in ``llm_generate`` and ``run_agent`` (with the job-type tests' tools) and
``chat`` (several calls of its own client, each admitted with ``ctx.admit_call``, its reply's
rate-limit headers given to ``ctx.record_rate_limits``, one checkpointed step each) under a
per-model limit, for in-process workers and worker processes (``--app
tests.support.flow_app:orc``). Settings come from the environment; its retry config is CONFIG,
or ``config(...)``'s, given by ORCHESTRATOR_RETRY_CONFIG."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from pydantic import BaseModel

from orchestrator import JobContext, Orchestrator
from tasks import agent, llm
from tests.support import job_types_app
from tests.support.harness import config_with

TABLE = """
[limits.held]
key = "hold:{payload.pool}"
concurrency = 2

[limits.ticks]
key = "{job_type}"
requests = 5
interval_seconds = 1

[limits.anthropic]
key = "anthropic:{payload.model}"
share_by = "tenant"
@ANTHROPIC@

[limits.shared]
key = "shared"
concurrency = 2
share_by = "tenant"
weights = { heavy = 3 }

[limits.metered]
key = "metered"
concurrency = 2
units = 1000000
share_by = "tenant"

[limits.slots]
key = "slots"
concurrency = 4
share_by = "tenant"
tenant_share = 0.5

[limits.single]
key = "single"
concurrency = 1
share_by = "tenant"

[limits.tokens]
key = "tokens"
units = 100
interval_seconds = 60
share_by = "tenant"
tenant_share = 0.5

[job_types.hold]
limit = "held"

[job_types.spend]
limit = "metered"

[job_types.hold_slot]
limit = "slots"

[job_types.hold_tokens]
limit = "tokens"

[job_types.in_turn]
limit = "single"

[job_types.tick]
limit = "ticks"

[job_types.late_call]
limit = "ticks"

[job_types.fair]
limit = "shared"

[job_types.llm_generate]
limit = "anthropic"
app_max_retries = 2
@LLM_GENERATE@

[job_types.run_agent]
limit = "anthropic"

[job_types.chat]
limit = "anthropic"
"""


def config(anthropic: str = "concurrency = 4", llm_generate: str = "") -> Path:
    """The tests' retry config with these allowances for the ``anthropic`` limit (and these
    settings more for ``llm_generate``)."""
    return config_with(
        TABLE.replace("@ANTHROPIC@", anthropic).replace("@LLM_GENERATE@", llm_generate)
    )


CONFIG = config()


class Hold(BaseModel):
    pool: str = "a"
    seconds: float = 0.3


class Spend(BaseModel):
    tokens: int  # what its call really spends (its type's estimate too)
    seconds: float = 0.05


class LateCall(BaseModel):
    sent_after: float  # seconds after its claim the job's call was sent
    returned_after: float  # and returned


class Chat(BaseModel):
    model: str
    calls: int = 5
    estimate: int = 15  # each call's, in tokens
    tag: str = ""  # its prompt, so that each job's calls can be told apart


def register(orc: Orchestrator) -> None:
    @orc.job_type("hold")
    async def hold(ctx: JobContext, payload: Hold) -> None:
        await asyncio.sleep(payload.seconds)

    @orc.job_type("spend", cost=lambda spend: spend.tokens)
    async def spend(ctx: JobContext, payload: Spend) -> None:
        """A call of its own client that spends ``tokens``, whatever its submit declared."""
        await asyncio.sleep(payload.seconds)
        await ctx.record_llm_usage("m", input_tokens=payload.tokens)

    @orc.job_type("hold_slot")
    async def hold_slot(ctx: JobContext, payload: Hold) -> None:
        await asyncio.sleep(payload.seconds)

    @orc.job_type("hold_tokens")
    async def hold_tokens(ctx: JobContext, payload: Hold) -> None:
        await asyncio.sleep(payload.seconds)

    @orc.job_type("in_turn")
    async def in_turn(ctx: JobContext, payload: Hold) -> None:
        await asyncio.sleep(payload.seconds)

    @orc.job_type("tick")
    async def tick(ctx: JobContext, payload: None) -> None:
        return None

    @orc.job_type("late_call")
    async def late_call(ctx: JobContext, payload: LateCall) -> None:
        """An LLM call of its own client, sent a while after the claim."""
        await asyncio.sleep(payload.sent_after)
        sent_at = time.monotonic()
        await asyncio.sleep(payload.returned_after - payload.sent_after)
        await ctx.record_llm_usage("m", input_tokens=3, output_tokens=4, sent_at=sent_at)

    @orc.job_type("fair")
    async def fair(ctx: JobContext, payload: None) -> None:
        await asyncio.sleep(0.02)

    @orc.job_type("chat", cost=lambda chat: chat.estimate)
    async def chat(ctx: JobContext, payload: Chat) -> int:
        """``calls`` Messages calls through its own client, one checkpointed step each."""
        url = os.environ["ANTHROPIC_BASE_URL"] + "/v1/messages"
        headers = {"x-api-key": ctx.secrets.get("ANTHROPIC_API_KEY")}
        steps = ctx.steps(int, initial=0, max_steps=payload.calls)
        async for step in steps:
            await ctx.admit_call(units=payload.estimate)
            sent_at = time.monotonic()
            body = {"model": payload.model, "max_tokens": 5,
                    "messages": [{"role": "user", "content": f"{payload.tag} {step.number}"}]}  # fmt: skip
            response = await ctx.http.post(url, json=body, headers=headers)
            await ctx.record_rate_limits(response.headers)
            response.raise_for_status()
            usage = response.json()["usage"]
            await ctx.record_llm_usage(
                payload.model, input_tokens=usage["input_tokens"],
                output_tokens=usage["output_tokens"], sent_at=sent_at,
            )  # fmt: skip
            await step.checkpoint(step.number, final=step.number == payload.calls)
        return int(steps.state)

    llm.register(orc)
    agent.register(orc, job_types_app.TOOLS)


orc = Orchestrator()
register(orc)
