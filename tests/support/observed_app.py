"""A job type that does what logs and traces must show: checkpointed steps, each an HTTP call
to the test's peers (tests/support/http_peers.py), and log records from the task's own logger
(``myapp``), a task it starts and a thread it starts, a secret in each of them.

Used in process (``register(orc)``: the tracing tests) and by worker processes (``--app
tests.support.observed_app:orc``: the log tests); the secret comes from the environment.
"""

from __future__ import annotations

import asyncio
import logging

from pydantic import BaseModel

from orchestrator import JobContext, Orchestrator

SECRET = "OBSERVED_SECRET"  # the name of the secret the task reads
mine = logging.getLogger("myapp")


class Plan(BaseModel):
    url: str  # the peers' base URL
    name: str = "observed"  # the peers' script the calls answer from (/status/<name>)
    steps: int = 2


def register(orc: Orchestrator) -> None:
    @orc.job_type("observed")
    async def observed(ctx: JobContext, plan: Plan) -> dict[str, int]:
        secret = ctx.secrets.get(SECRET)
        mine.info("calling with key %s", secret, extra={"token": secret, "step_count": plan.steps})
        try:
            raise RuntimeError(f"the key {secret} was refused")
        except RuntimeError:
            mine.exception("a handled error")
        await asyncio.create_task(_child())
        await asyncio.to_thread(mine.info, "from a thread")
        steps = ctx.steps(int, initial=0, max_steps=plan.steps)
        async for step in steps:
            ctx.log.info("step %d", step.number)
            response = await ctx.http.get(
                f"{plan.url}/status/{plan.name}",
                params={"key": secret},
                headers={"authorization": f"Bearer {secret}"},
            )
            response.raise_for_status()
            await step.checkpoint(step.state + 1, final=step.number == plan.steps)
        return {"steps": steps.state}


async def _child() -> None:
    mine.info("from a task the job started")


orc = Orchestrator()  # for worker processes; settings come from their environment
register(orc)
