"""Built-in job types, as decorated tasks. ``register_all(orc)`` adds them to an Orchestrator;
``tasks.app:orc`` is an Orchestrator with all of them, the CLI's default ``--app``.

    http_request, webhook_dispatch      tasks.http     one HTTP call
    llm_generate                        tasks.llm      one streamed Messages API call
    execute_tool                        tasks.tools    one tool of a ToolRegistry
    run_agent                           tasks.agent    an agent loop of checkpointed steps
    send_notification, approval_notify  tasks.notify   messages to people, with a fallback

docs/job-types.md describes each, and how to write your own.
"""

from __future__ import annotations

from orchestrator import Orchestrator
from tasks import agent, http, llm, notify, tools
from tasks.tools import TOOLS, ToolRegistry


def register_all(orc: Orchestrator, *, tool_registry: ToolRegistry = TOOLS) -> None:
    http.register(orc)
    llm.register(orc)
    tools.register(orc, tool_registry)
    agent.register(orc, tool_registry)
    notify.register(orc)


__all__ = ["TOOLS", "ToolRegistry", "register_all"]
