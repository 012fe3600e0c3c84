"""A job type whose payload scripts the outcome of each attempt, for end-to-end tests.

``{"script": ["app", "infra", "ok"]}``: attempt 1 fails transiently at the app layer (an HTTP
429 without a hint), attempt 2 at the infrastructure layer (ECONNRESET), attempt 3 succeeds.
Steps: ok, app, infra, permanent, invalid, block (wait for a release), sleep:<seconds>.
"""

from __future__ import annotations

import asyncio
import errno
from collections import Counter
from typing import Any
from uuid import UUID

from pydantic import BaseModel

from orchestrator import JobContext, Orchestrator, PermanentError
from orchestrator.domain.states import Status

#: Its retry config table (tests/support/harness.py: config_with).
TABLE = """
[job_types.scripted]
worker_max_attempts = 4
"""
RUNS: Counter[UUID] = Counter()  # task invocations per job, in this process
RELEASE: dict[UUID, asyncio.Event] = {}
STARTED: dict[UUID, asyncio.Event] = {}


class Script(BaseModel):
    script: list[str]


class Shaped(BaseModel):
    status: int
    body: str


class RateLimited(Exception):
    status_code = 429


def register(orc: Orchestrator) -> None:
    @orc.job_type("scripted")
    async def scripted(ctx: JobContext, payload: Script) -> dict[str, Any]:
        RUNS[ctx.job_id] += 1
        STARTED.setdefault(ctx.job_id, asyncio.Event()).set()
        step = payload.script[min(ctx.attempt, len(payload.script)) - 1]
        match step.split(":"):
            case ["ok"]:
                return {"attempt": ctx.attempt, "retry_count": ctx.retry_count}
            case ["app"]:
                raise RateLimited("429 Too Many Requests")
            case ["infra"]:
                raise ConnectionResetError(errno.ECONNRESET, "connection reset by peer")
            case ["permanent"]:
                raise PermanentError("400 Bad Request", code="HTTP_400")
            case ["block"]:
                await RELEASE.setdefault(ctx.job_id, asyncio.Event()).wait()
                return {"attempt": ctx.attempt, "unblocked": True}
            case ["sleep", seconds]:
                await asyncio.sleep(float(seconds))
                return {"slept": float(seconds)}
        raise AssertionError(f"unknown step {step!r}")

    @orc.job_type("shaped")
    async def shaped(ctx: JobContext, payload: dict[str, Any]) -> Shaped:
        return payload  # type: ignore[return-value]  # validated against Shaped on return


STATUS_OF_EVENT = {
    "job.created": Status.PENDING,
    "job.running": Status.RUNNING,
    "job.retry_scheduled": Status.RETRY,
    "job.completed": Status.COMPLETED,
    "job.cancelled": Status.CANCELLED,
    "job.interrupted": Status.PENDING,
}


def status_path(events: list[Any]) -> list[str]:
    """The statuses a job went through, read back from its history (the replay view of docs/contracts.md)."""
    path = []
    for event in events:
        if event.kind == "job.failed" and event.payload["terminal"]:
            path.append(Status.FAILED.value)
        elif event.kind in STATUS_OF_EVENT:
            path.append(STATUS_OF_EVENT[event.kind].value)
    return path
