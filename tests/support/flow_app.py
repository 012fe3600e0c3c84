"""The flow-control tests' application (docs/flow-control.md): ``hold`` jobs that run for a
while under a concurrency limit, ``tick`` and ``late_call`` jobs under a rate limit, and the built-in
``llm_generate`` under a per-model limit, for in-process workers and worker processes
(``--app tests.support.flow_app:orc``). Settings come from the environment; its retry config
is CONFIG, or ``config(...)``'s, given by ORCHESTRATOR_RETRY_CONFIG."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from pydantic import BaseModel

from orchestrator import JobContext, Orchestrator
from tasks import llm
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

[job_types.hold]
limit = "held"

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


class LateCall(BaseModel):
    sent_after: float  # seconds after its claim the job's call was sent
    returned_after: float  # and returned


def register(orc: Orchestrator) -> None:
    @orc.job_type("hold")
    async def hold(ctx: JobContext, payload: Hold) -> None:
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

    llm.register(orc)


orc = Orchestrator()
register(orc)
