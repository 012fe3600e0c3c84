"""Job types that make graphs (docs/workflows.md), for the dependency tests, in this process
or in worker processes (``orchestrator --app tests.support.graph_app:orc worker``; its retry
config is CONFIG). A ``node`` returns its name and what it read of its parents; it fails for
good while its name is in FAILING (in this process), or when its payload says ``fail``."""

from __future__ import annotations

import asyncio
from typing import Any
from uuid import UUID

from pydantic import BaseModel

from orchestrator import JobContext, Orchestrator, PermanentError
from tests.support.harness import config_with

TABLE = """
[job_types.node]
worker_max_attempts = 2
app_max_retries = 2

[job_types.node_runs_anyway]
worker_max_attempts = 2
app_max_retries = 2

[job_types.intruder]
worker_max_attempts = 1
app_max_retries = 0

[job_types.planner]
worker_max_attempts = 3
app_max_retries = 2
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


class Plan(BaseModel):
    topics: list[str]
    #: On its first attempt, the planner sleeps this long once its children are spawned (a
    #: test kills its worker then).
    hold_after_spawn: float = 0.0
    child_sleep: float = 0.0
    child_budget: int | None = None  # each child's token budget


class Found(BaseModel):
    children: list[str] = []
    report: list[str] = []


async def planner(ctx: JobContext, payload: Plan) -> Found:
    """Spawns a node per topic in its first step and waits for them; its second step writes
    what they found, failures included."""
    steps = ctx.steps(Found, initial=Found())
    async for step in steps:
        if step.number == 1:
            children = await step.spawn([
                {"job_type": "node", "payload": {"name": t, "sleep": payload.child_sleep},
                 "token_budget": payload.child_budget}
                for t in payload.topics
            ])  # fmt: skip
            if payload.hold_after_spawn and ctx.attempt == 1:
                ctx.log.info("spawned %s", [str(c) for c in children])
                await asyncio.sleep(payload.hold_after_spawn)
            outcomes = await step.wait_for(children)
            report = [
                o.result.name if isinstance(o.result, Done) else f"{o.status}" for o in outcomes
            ]
            await step.checkpoint(Found(children=[str(c) for c in children], report=report))
        else:
            await step.checkpoint(step.state, final=True)
    return steps.state


class Intrusion(BaseModel):
    spawn_into: str | None = None  # a tenant to spawn a child into
    wait_on: str | None = None  # a job (not its child) to wait for


async def intruder(ctx: JobContext, payload: Intrusion) -> None:
    """Tries to reach past its own: a child of another tenant, or a wait on a job it did not
    spawn. Both are refused (SubmitError, PERMANENT)."""
    async for step in ctx.steps():
        if payload.spawn_into is not None:
            await step.spawn([{"job_type": "node", "payload": {"name": "planted"},
                               "tenant_id": payload.spawn_into}])  # fmt: skip
        if payload.wait_on is not None:
            await step.wait_for([UUID(payload.wait_on)])
        await step.checkpoint(None, final=True)


def register(orc: Orchestrator) -> None:
    orc.job_type("node")(node)
    orc.job_type("node_runs_anyway", on_parent_failure="run")(node)
    orc.job_type("planner")(planner)
    orc.job_type("intruder")(intruder)


orc = Orchestrator()
register(orc)
