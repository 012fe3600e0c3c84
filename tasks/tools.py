"""Tools an agent (or an ``execute_tool`` job) can call, and the registry that holds them.

    tools = ToolRegistry()

    @tools.tool("post_message", description="Post a message to the team channel",
                reconcile=find_message, timeout_ms=15_000)
    async def post_message(ctx: JobContext, args: PostArgs, invocation_id: str) -> Posted:
        ...  # use invocation_id as the idempotency key of the external call

Each tool declares: its input and output models (from
its annotations), its timeout (``tool_timeouts_ms`` in the type's config overrides it), and
whether it is ``idempotent`` or has a ``reconcile(ctx, args, invocation_id)`` that asks the
external system whether an interrupted call happened. Calls go through the side-effect ledger,
so a committed call is never made twice. An output that does not fit the output model is
INVALID_OUTPUT (terminal), the whole output kept in the job's ``last_error``; an unknown tool or
arguments that do not fit are PERMANENT.
"""

# No `from __future__ import annotations`: the job types' payload models are local classes,
# read from the annotations when they are registered.
import asyncio
import inspect
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from pydantic import AnyHttpUrl, BaseModel, Field, TypeAdapter, ValidationError, model_validator

from checkpoints import Reconciled
from orchestrator import InvalidOutput, JobContext, Orchestrator, PermanentError
from orchestrator.runtime.calls import call_limit
from tasks.payload import Payload

ToolFunction = Callable[[JobContext, Any, str], Awaitable[Any]]
ToolReconcile = Callable[[JobContext, Any, str], Awaitable[Reconciled | None]]


#: Where a tool call is recorded: ``step.effect`` in a stepped task, ``ctx.effect`` otherwise.
Effect = Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    fn: ToolFunction
    input: type[BaseModel]
    output: TypeAdapter[Any]
    idempotent: bool
    reconcile: ToolReconcile | None
    timeout_ms: int | None

    def definition(self) -> dict[str, Any]:
        """The tool as the Messages API describes it to the model."""
        return {
            "name": self.name,
            "description": self.description,
            "input_schema": self.input.model_json_schema(),
        }

    def timeout(self, ctx: JobContext) -> float:
        configured = ctx.config.tool_timeouts_ms.get(self.name, self.timeout_ms)
        return configured / 1_000 if configured else ctx.config.call_timeout()

    def parse_input(self, raw: Any) -> BaseModel:
        try:
            return self.input.model_validate(raw)
        except ValidationError as exc:
            raise PermanentError(
                f"tool {self.name!r}: invalid input: {exc.errors(include_url=False)}",
                code="TOOL_INPUT_INVALID",
            ) from None

    async def call(self, ctx: JobContext, args: BaseModel, invocation_id: str) -> Any:
        """Run the tool under its timeout; its output validated, as JSON."""
        async with call_limit(self.timeout(ctx), f"tool {self.name!r}"):
            output = await self.fn(ctx, args, invocation_id)
        try:
            return self.output.dump_python(self.output.validate_python(output), mode="json")
        except ValidationError as exc:
            raise InvalidOutput(
                f"tool {self.name!r} returned an output that does not fit its model: "
                f"{exc.errors(include_url=False)}",
                output=output,
            ) from None


class ToolRegistry:
    def __init__(self) -> None:
        self.tools: dict[str, Tool] = {}

    def tool(
        self,
        name: str,
        *,
        description: str,
        idempotent: bool = False,
        reconcile: ToolReconcile | None = None,
        timeout_ms: int | None = None,
    ) -> Callable[[ToolFunction], ToolFunction]:
        """Register ``async def fn(ctx, args: InputModel, invocation_id) -> OutputModel``."""
        if not idempotent and reconcile is None:
            raise ValueError(f"tool {name!r}: declare idempotent=True or give reconcile=")

        def decorate(fn: ToolFunction) -> ToolFunction:
            if name in self.tools:
                raise ValueError(f"tool {name!r} is already registered")
            hints = inspect.get_annotations(fn, eval_str=True)
            params = list(inspect.signature(fn).parameters)
            input_model = hints.get(params[1]) if len(params) == 3 else None
            if not (isinstance(input_model, type) and issubclass(input_model, BaseModel)):
                raise TypeError(f"tool {name!r}: take (ctx, args: <pydantic model>, invocation_id)")
            if "return" not in hints:
                raise TypeError(f"tool {name!r}: annotate its output model")
            self.tools[name] = Tool(
                name, description, fn, input_model, TypeAdapter(hints["return"]),
                idempotent, reconcile, timeout_ms,
            )  # fmt: skip
            return fn

        return decorate

    def get(self, name: str) -> Tool:
        tool = self.tools.get(name)
        if tool is None:
            raise PermanentError(
                f"unknown tool {name!r}; registered tools: {', '.join(sorted(self.tools))}",
                code="TOOL_UNKNOWN",
            )
        return tool

    async def run(
        self, ctx: JobContext, effect: Effect, name: str, raw_args: Any, *, key: str
    ) -> Any:
        """Call tool ``name`` through the ledger (``effect``: ``step.effect`` or ``ctx.effect``)."""
        tool = self.get(name)
        args = tool.parse_input(raw_args)
        reconcile = tool.reconcile

        async def ask(invocation_id: str) -> Reconciled | None:
            assert reconcile is not None
            return await reconcile(ctx, args, invocation_id)

        return await effect(
            f"tool:{name}",
            lambda invocation_id: tool.call(ctx, args, invocation_id),
            key=key,
            args=args.model_dump(mode="json"),
            idempotent=tool.idempotent,
            reconcile=ask if reconcile is not None else None,
        )


# -- built-in tools ---------------------------------------------------------------------------

TOOLS = ToolRegistry()


class FetchArgs(Payload):
    url: AnyHttpUrl


class Fetched(BaseModel):
    status: int
    body: str


@TOOLS.tool("http_fetch", description="GET a URL; its status and text.", idempotent=True)
async def http_fetch(ctx: JobContext, args: FetchArgs, invocation_id: str) -> Fetched:
    response = await ctx.http.get(str(args.url))
    response.raise_for_status()
    return Fetched(status=response.status_code, body=response.text[:20_000])


WORKSPACE = ".orchestrator/tool-workspace"


class WriteArgs(Payload):
    path: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")
    content: str


class Written(BaseModel):
    path: str
    bytes: int


@TOOLS.tool(
    "file_write",
    description="Write a text file under the tool workspace (ORCHESTRATOR_TOOL_WORKSPACE).",
    idempotent=True,  # writing the same content again leaves the same file
    timeout_ms=10_000,
)
async def file_write(ctx: JobContext, args: WriteArgs, invocation_id: str) -> Written:
    return await asyncio.to_thread(_write, args)


def _write(args: WriteArgs) -> Written:
    root = Path(os.environ.get("ORCHESTRATOR_TOOL_WORKSPACE", WORKSPACE)).resolve()
    target = (root / args.path).resolve()
    if ".." in Path(args.path).parts or root not in target.parents:
        raise PermanentError(f"path {args.path!r} leaves the workspace", code="TOOL_PATH_INVALID")
    target.parent.mkdir(parents=True, exist_ok=True)
    data = args.content.encode()
    target.write_bytes(data)
    return Written(path=args.path, bytes=len(data))


class ToolRequest(Payload):
    tool: str = Field(min_length=1)
    args: dict[str, Any] = Field(default_factory=dict)


def register(orc: Orchestrator, tools: ToolRegistry = TOOLS) -> None:
    class Request(ToolRequest):
        """Checked at submit: the tool exists and the arguments fit its input model."""

        @model_validator(mode="after")
        def _known_tool(self) -> Self:
            try:
                tools.get(self.tool).parse_input(self.args)
            except PermanentError as exc:
                raise ValueError(str(exc)) from None
            return self

    @orc.job_type(
        "execute_tool",
        exhausted_message="Tool execution failed after all retries. Manual intervention required.",
    )
    async def execute_tool(ctx: JobContext, request: Request) -> Any:
        return await tools.run(ctx, ctx.effect, request.tool, request.args, key="tool")
