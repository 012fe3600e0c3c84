"""The agent storm's application (bench/flow_control.py): the built-in ``run_agent`` with one
tool that costs nothing, ``note``, so that the storm measures flow control, not the tools.
Settings come from the environment (``--app bench.agent_app:orc``)."""

from __future__ import annotations

from pydantic import BaseModel

from orchestrator import JobContext, Orchestrator
from tasks import agent
from tasks.payload import Payload
from tasks.tools import ToolRegistry

TOOLS = ToolRegistry()


class NoteArgs(Payload):
    text: str


class Noted(BaseModel):
    chars: int


@TOOLS.tool("note", description="Take a note.", idempotent=True)
async def note(ctx: JobContext, args: NoteArgs, invocation_id: str) -> Noted:
    return Noted(chars=len(args.text))


orc = Orchestrator()
agent.register(orc, TOOLS)
