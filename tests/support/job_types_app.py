"""The built-in job types, with the tools of the job-type tests (tests/test_job_types.py).

Used in process (``register(orc)``) and by worker processes (``--app tests.support.job_types_app:orc``).
``send_message`` posts to the test's message service (``TEST_MESSAGE_SERVICE_URL``): a side
effect that is not idempotent, reconciled by asking the service.
"""

from __future__ import annotations

import asyncio
import errno
import os
from typing import Any

from pydantic import BaseModel

import tasks
from checkpoints import Reconciled
from orchestrator import JobContext, Orchestrator
from tasks import ToolRegistry
from tests.support.external import find, send

TOOLS = ToolRegistry()


class MessageArgs(BaseModel):
    text: str


class Sent(BaseModel):
    delivered: bool
    text: str


def service_url() -> str:
    return os.environ["TEST_MESSAGE_SERVICE_URL"]


async def find_message(ctx: JobContext, args: Any, invocation_id: str) -> Reconciled | None:
    found = await find(service_url(), invocation_id)
    if found is None:
        return None
    return Reconciled(Sent(delivered=True, text=found.result["text"]).model_dump())


@TOOLS.tool("send_message", description="Send a message to the team.", reconcile=find_message)
async def send_message(ctx: JobContext, args: MessageArgs, invocation_id: str) -> Sent:
    record = await send(service_url(), invocation_id, args.text)
    return Sent(delivered=True, text=record["text"])


class Query(BaseModel):
    query: str


class Answer(BaseModel):
    answer: str


@TOOLS.tool("lookup", description="Look something up.", idempotent=True)
async def lookup(ctx: JobContext, args: Query, invocation_id: str) -> Answer:
    return Answer(answer=f"answer to {args.query}")


class Rows(BaseModel):
    rows: list[int]


@TOOLS.tool("bad_output", description="Returns the wrong shape.", idempotent=True)
async def bad_output(ctx: JobContext, args: Query, invocation_id: str) -> Rows:
    return {"rows": "three rows", "query": args.query}  # type: ignore[return-value]


@TOOLS.tool("slow", description="Takes too long.", idempotent=True, timeout_ms=200)
async def slow(ctx: JobContext, args: Query, invocation_id: str) -> Answer:
    await asyncio.sleep(5)
    return Answer(answer="late")


@TOOLS.tool("denied", description="Not allowed.", idempotent=True)
async def denied(ctx: JobContext, args: Query, invocation_id: str) -> Answer:
    raise PermissionError(errno.EACCES, "Permission denied", "/etc/shadow")


SLOW_ONCE_CALLS: dict[str, int] = {}


@TOOLS.tool("slow_once", description="Too slow the first time.", idempotent=True, timeout_ms=200)
async def slow_once(ctx: JobContext, args: Query, invocation_id: str) -> Answer:
    SLOW_ONCE_CALLS[args.query] = SLOW_ONCE_CALLS.get(args.query, 0) + 1
    if SLOW_ONCE_CALLS[args.query] == 1:
        await asyncio.sleep(5)  # past its 200 ms limit: the step fails, to be resumed
    return Answer(answer=f"answer to {args.query}")


FLAKY_CALLS: dict[str, int] = {}


@TOOLS.tool("flaky", description="The network drops the first call.", idempotent=True)
async def flaky(ctx: JobContext, args: Query, invocation_id: str) -> Answer:
    FLAKY_CALLS[args.query] = FLAKY_CALLS.get(args.query, 0) + 1
    if FLAKY_CALLS[args.query] == 1:
        raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
    return Answer(answer=f"answer to {args.query}")


def register(orc: Orchestrator) -> None:
    tasks.register_all(orc, tool_registry=TOOLS)


orc = Orchestrator()
register(orc)
