"""A job type that streams live output (docs/output.md), for the output tests, in this process or
in worker processes and the API server (``--app tests.support.output_app:orc``; its retry config
is CONFIG): ``streamer`` writes ``deltas`` text deltas, ``every`` seconds apart, and a progress
record; with ``fail_first``, its first attempt fails after streaming (a retry)."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel

from orchestrator import JobContext, Orchestrator, RetryLater
from tests.support.harness import config_with

TABLE = """
[job_types.streamer]
worker_max_attempts = 1
app_max_retries = 2
"""
CONFIG = config_with(TABLE)


class Stream(BaseModel):
    deltas: int = 20
    every: float = 0.0
    fail_first: bool = False


def register(orc: Orchestrator) -> None:
    @orc.job_type("streamer")
    async def streamer(ctx: JobContext, payload: Stream) -> int:
        ctx.output.progress({"attempt": ctx.attempt, "deltas": payload.deltas})
        for n in range(payload.deltas):
            ctx.output.text(f"a{ctx.attempt}d{n} ")
            await asyncio.sleep(payload.every)
        if payload.fail_first and ctx.attempt == 1:
            raise RetryLater(0, "the first attempt fails after streaming")
        return payload.deltas


orc = Orchestrator()
register(orc)
