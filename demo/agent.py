"""The demo's agent job: three checkpointed steps, the second notifying the team through the
side-effect ledger (a message service that can say whether a notification arrived).

Worker processes load it with ``orchestrator --app demo.agent:orc worker``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from demo.peers import find, send
from orchestrator import JobContext, Orchestrator


class Brief(BaseModel):
    topic: str
    notify_url: str


class Notes(BaseModel):
    lines: list[str] = []


def register(orc: Orchestrator) -> None:
    @orc.job_type("research_brief")
    async def research_brief(ctx: JobContext, brief: Brief) -> dict[str, Any]:
        steps = ctx.steps(Notes, initial=Notes(), max_steps=3)
        async for step in steps:
            if step.number == 1:
                line = f"outlined a brief on {brief.topic}"
            elif step.number == 2:
                receipt = await step.effect(
                    "notify_team",
                    lambda invocation_id: send(
                        brief.notify_url, invocation_id, f"brief on {brief.topic} drafted"
                    ),
                    reconcile=lambda invocation_id: find(brief.notify_url, invocation_id),
                    args={"topic": brief.topic},
                )
                line = f"notified the team (message {receipt['message_id']})"
            else:
                line = "published the brief"
            await step.checkpoint(Notes(lines=[*step.state.lines, line]), final=step.number == 3)
        return {"brief": steps.state.lines}


orc = Orchestrator()
register(orc)
