"""``run_agent``: an agent loop of checkpointed steps.

One step = one LLM reply plus the tool calls it asks for, then the step's checkpoint (the
transcript so far). The reply is recorded in the ledger as soon as it arrives (idempotent,
committed at once), so a step resumed after a crash or a drain makes the same tool calls under
the same keys; each tool call goes through the ledger too (reconciled if it was interrupted,
never repeated once committed). Every step runs under the step timeout; an abort (drain,
timeout) stops the step before its next tool call, and the job resumes from its last
checkpoint. The loop ends when the model stops asking for tools; reaching ``max_steps`` first is
PERMANENT (``AGENT_STEP_LIMIT``). A tool the model names but the job did not offer, or arguments
that do not fit, go back to the model as an error result (it can correct itself); a tool output
that does not fit the tool's model is INVALID_OUTPUT.

Each reply's text is written to the job's live output (docs/output.md) once per attempt that
gets it: streamed delta by delta as the call makes it (tasks/llm.py), or, when a resumed step
takes its reply from the ledger (the attempt that asked died before the step's checkpoint, so
what it streamed is superseded), written whole as the step takes it.

Model fallback (tasks/llm.py, the type's ``fallback_models``): a step's LLM call that moves to a
fallback model keeps it: the agent stays on the model it switched to for the rest of the job,
resumed attempts included (the transcript from then on is that model's), and falls further down
the same list if that one fails in turn; it never goes back up. Each checkpointed turn records
which model answered (``Transcript.turns``), so a resumed agent starts its next step with the
last turn's model.
"""

# No `from __future__ import annotations`: the job type's payload model is a local class, read
# from the annotations when it is registered.
import asyncio
import functools
import json
from typing import Any, Self

from pydantic import BaseModel, Field, model_validator

from orchestrator import JobContext, Orchestrator, PermanentError
from tasks.llm import LlmResponse, Usage, call_estimate, fallback_chain, generate_with_fallback
from tasks.payload import Payload
from tasks.tools import TOOLS, ToolRegistry


class AgentRequest(Payload):
    prompt: str = Field(min_length=1)
    model: str = Field(min_length=1)
    system: str | None = None
    tools: list[str] = Field(default_factory=list)  # names in the tool registry
    max_steps: int = Field(10, ge=1, le=200)
    max_tokens: int = Field(1024, gt=0)


def first_call(request: AgentRequest, offered: list[dict[str, Any]]) -> dict[str, Any]:
    """The agent's first call's parameters (but its model): the prompt, the tools offered."""
    return {
        "max_tokens": request.max_tokens,
        "messages": [{"role": "user", "content": request.prompt}],
        **({"system": request.system} if request.system else {}),
        **({"tools": offered} if offered else {}),
    }


class ToolCallRecord(BaseModel):
    step: int
    id: str
    tool: str
    args: dict[str, Any]
    output: Any
    error: str | None = None


class Turn(BaseModel):
    step: int
    model: str  # the model that answered the step, by the name it was asked by


class Transcript(BaseModel):
    """The state each step checkpoints, and the job's result."""

    messages: list[dict[str, Any]]
    turns: list[Turn] = Field(default_factory=list)  # one per step: which model answered
    tool_calls: list[ToolCallRecord] = Field(default_factory=list)
    steps: int = 0
    answer: str | None = None  # the model's last text, once it stopped asking for tools
    usage: Usage = Usage(input_tokens=0, output_tokens=0)


def register(orc: Orchestrator, tools: ToolRegistry = TOOLS) -> None:
    class Request(AgentRequest):
        @model_validator(mode="after")
        def _known_tools(self) -> Self:
            unknown = sorted(set(self.tools) - set(tools.tools))
            if unknown:
                raise ValueError(
                    f"unknown tools {unknown}; registered tools: {sorted(tools.tools)}"
                )
            return self

    def estimated_tokens(request: AgentRequest) -> int:
        """The job's cost, in tokens: its first call's estimate (each later call is admitted
        on its own estimate before it is sent; docs/flow-control.md)."""
        offered = [tools.get(name).definition() for name in request.tools]
        return call_estimate(first_call(request, offered))

    @orc.job_type("run_agent", cost=estimated_tokens)
    async def run_agent(ctx: JobContext, request: Request) -> Transcript:
        offered = [tools.get(name).definition() for name in request.tools]
        start = Transcript(messages=first_call(request, offered)["messages"])
        steps = ctx.steps(Transcript, initial=start, max_steps=request.max_steps)
        async for step in steps:
            before = step.state
            model = before.turns[-1].model if before.turns else request.model
            params: dict[str, Any] = {
                "model": model,
                "max_tokens": request.max_tokens,
                "messages": before.messages,
                **({"system": request.system} if request.system else {}),
                **({"tools": offered} if offered else {}),
            }
            asked: list[LlmResponse] = []  # the reply of this attempt's call, if it made one
            ask = functools.partial(_ask, ctx, params, request.model, step.number, asked)
            reply: LlmResponse = await step.effect(
                "llm", ask, key="llm", idempotent=True, result_type=LlmResponse, commit_now=True,
            )  # fmt: skip
            if not asked:  # the ledger's: streamed by an attempt that died before the checkpoint
                ctx.output.text(reply.text)
            calls: list[ToolCallRecord] = []
            results: list[dict[str, Any]] = []
            uses = [b for b in reply.content if b.get("type") == "tool_use"]
            for n, use in enumerate(uses, start=1):
                if ctx.should_abort():  # no new tool call once aborted
                    raise asyncio.CancelledError("aborted before a tool call")
                call = await _call(ctx, step.effect, tools, request.tools, use, step.number, n)
                calls.append(call)
                results.append(_result(call))
            usage = Usage(
                input_tokens=before.usage.input_tokens + reply.usage.input_tokens,
                output_tokens=before.usage.output_tokens + reply.usage.output_tokens,
            )
            messages = [*before.messages, {"role": "assistant", "content": reply.content}]
            if results:
                messages.append({"role": "user", "content": results})
            await step.checkpoint(
                Transcript(
                    messages=messages,
                    turns=[*before.turns, Turn(step=step.number, model=reply.answered_by or model)],
                    tool_calls=[*before.tool_calls, *calls],
                    steps=step.number,
                    answer=None if uses else reply.text,
                    usage=usage,
                ),
                final=not uses,
            )
        if not steps.finished:
            raise PermanentError(
                f"the agent was still calling tools after {request.max_steps} steps",
                code="AGENT_STEP_LIMIT",
            )
        transcript: Transcript = steps.state
        return transcript


async def _ask(
    ctx: JobContext, params: dict[str, Any], requested: str, step: int,
    asked: list[LlmResponse], invocation_id: str,
) -> LlmResponse:  # fmt: skip
    """The step's call, on ``params["model"]`` (the model the agent is on), falling back to the
    models after it in ``[requested, *fallback_models]`` (all of those others if the config no
    longer names it); its reply, whose text was streamed as it came, added to ``asked``."""
    chain = fallback_chain(requested, ctx.config.fallback_models)
    model = params["model"]
    rest = chain[chain.index(model) + 1 :] if model in chain else chain
    reply = await generate_with_fallback(
        ctx, fallback=rest, step=step, on_job_key=model == requested, **params
    )
    asked.append(reply)
    return reply


async def _call(
    ctx: JobContext,
    effect: Any,
    tools: ToolRegistry,
    offered: list[str],
    use: dict[str, Any],
    step: int,
    n: int,
) -> ToolCallRecord:
    name, args = use["name"], use.get("input") or {}
    record = ToolCallRecord(step=step, id=use["id"], tool=name, args=args, output=None)
    if name not in offered:
        return record.model_copy(update={"error": f"no tool named {name!r} is available"})
    try:
        tools.get(name).parse_input(args)
    except PermanentError as exc:
        return record.model_copy(update={"error": str(exc)})
    output = await tools.run(ctx, effect, name, args, key=f"tool{n}")
    return record.model_copy(update={"output": output})


def _result(call: ToolCallRecord) -> dict[str, Any]:
    if call.error is not None:
        return {"type": "tool_result", "tool_use_id": call.id, "content": call.error,
                "is_error": True}  # fmt: skip
    return {"type": "tool_result", "tool_use_id": call.id, "content": json.dumps(call.output)}
