"""Job types that make graphs (docs/workflows.md), for the dependency tests, in this process
or in worker processes (``orchestrator --app tests.support.graph_app:orc worker``; its retry
config is CONFIG). A ``node`` returns its name and what it read of its parents; it fails for
good while its name is in FAILING (in this process), or when its payload says ``fail``."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel

from orchestrator import JobContext, Orchestrator, PermanentError
from tests.support.harness import config_with

TABLE = """
[job_types.node]
worker_max_attempts = 2
app_max_retries = 0

[job_types.node_runs_anyway]
worker_max_attempts = 2
app_max_retries = 0
"""
CONFIG = config_with(TABLE)
FAILING: set[str] = set()


class Node(BaseModel):
    name: str
    fail: bool = False
    sleep: float = 0.0


class Done(BaseModel):
    name: str
    parents: list[dict[str, Any]]


async def node(ctx: JobContext, payload: Node) -> Done:
    if payload.sleep:
        await asyncio.sleep(payload.sleep)
    if payload.fail or payload.name in FAILING:
        raise PermanentError(f"{payload.name} told to fail")
    seen = []
    for parent in await ctx.parents():
        seen.append({
            "ended": parent.ended,
            "name": parent.result.name if isinstance(parent.result, Done) else None,
            "error": parent.last_error.code if parent.last_error else None,
        })  # fmt: skip
    return Done(name=payload.name, parents=seen)


def register(orc: Orchestrator) -> None:
    orc.job_type("node")(node)
    orc.job_type("node_runs_anyway", on_parent_failure="run")(node)


orc = Orchestrator()
register(orc)
