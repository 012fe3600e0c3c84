"""The application the dashboard tests serve and run: the scripted and agent job types, and
``paced``, whose first attempt is rate limited with a retry 4 s later and whose second runs for
a moment, so a browser sees its countdown, then RUNNING, then COMPLETED; and ``metered``, under
a flow-control limit (one at a time per model), for the Flow page."""

from __future__ import annotations

import asyncio

from orchestrator import JobContext, Orchestrator
from tests.support import agent_app, scripted
from tests.support.harness import config_with

TABLE = """
[job_types.paced]
app_max_retries = 2
backoff = { base_ms = 4000, cap_ms = 4000, multiplier = 1, jitter = "none" }

[limits.provider]
key = "provider:{payload.model}"
concurrency = 1

[job_types.metered]
limit = "provider"
"""
CONFIG = config_with(scripted.TABLE, agent_app.TABLE, TABLE)


class RateLimited(Exception):
    status_code = 429


def register(orc: Orchestrator) -> None:
    scripted.register(orc)
    agent_app.register(orc)

    @orc.job_type("paced")
    async def paced(ctx: JobContext, payload: None) -> dict[str, int]:
        if ctx.attempt == 1:
            raise RateLimited("429 Too Many Requests")
        await asyncio.sleep(1.5)
        return {"attempt": ctx.attempt}

    @orc.job_type("metered")
    async def metered(ctx: JobContext, payload: dict[str, str]) -> None:
        return None


orc = Orchestrator(retry_config_path=CONFIG)
register(orc)
