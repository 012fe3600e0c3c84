"""``llm_generate``: one streamed Messages API call on the official ``anthropic`` SDK.

The LLM branch of the timeout tree (docs/contracts.md): connect ``connect_timeout_ms`` (30 s), the
whole call ``call_timeout_ms`` (300 s) and ``inter_chunk_timeout_ms`` (60 s) between two stream
events, both TRANSIENT_APP. Ping events do not count as chunks (the SDK drops them): a stream that
only pings has stalled. The SDK's retries are off (``max_retries=0``) and so are its transport's,
so the orchestrator's two layers are the only retries and each attempt makes exactly one request.
Errors classify by orchestrator.domain.classification (429 and 529 TRANSIENT_APP with the server's
``retry-after`` honoured, 401/400 PERMANENT, connection errors TRANSIENT_INFRA).

The reply is validated: its shape always, and, when the
request gives an ``output_schema`` (a JSON Schema, checked at submit), its text must be JSON
that the schema accepts; the parsed value is the result's ``output``. A reply that does not fit
is INVALID_OUTPUT, terminal, its text kept in the job's ``last_error``.

Model fallback (the type's ``fallback_models`` and ``fallback_after_seconds``): when the model is
overloaded (529, or an ``overloaded_error`` inside the stream) or rate-limited (429) with a
server hint longer than ``fallback_after_seconds``, the call moves at once, within the same
attempt, to the next model of ``[model, *fallback_models]``; each model is tried at most once per
call, and once the list is spent the last error propagates and is classified as usual. Each move
is a ``job.model_fallback`` event; each call is counted under its own model; the reply's
``answered_by`` names the model that answered, as asked (``model`` is the name the provider
answered with). A new attempt starts again from the requested model.

Each reply's headers, a failed call's included, go to ``ctx.record_rate_limits``: under a limit
that learns, the provider's rate-limit headers keep the job's flow key in step with its limits
(docs/flow-control.md, "Limits learned from the provider").

The API key is the secret ``ANTHROPIC_API_KEY`` (environment or mounted secret); the endpoint
is ``ANTHROPIC_BASE_URL`` when set (the bundled local server, a proxy), else Anthropic's.
With tracing on, the call has a span, ``chat <model>`` (docs/operations.md, "Traces").

Every text delta of every call is the job's live output as it arrives (``ctx.output``,
docs/output.md), for ``llm_generate`` and ``run_agent`` alike. A call that fails and is retried
streams again, after the marker its attempt's failure writes; a call that falls back to another
model within the attempt streams again after what the failed call streamed, with no marker.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, computed_field, field_validator

from orchestrator import Classified, InvalidOutput, JobContext, Orchestrator
from orchestrator.runtime.calls import within_gaps
from tasks.payload import Payload

if TYPE_CHECKING:  # the SDK is imported when a call is made: most of a second, saved elsewhere
    import anthropic

API_KEY_SECRET = "ANTHROPIC_API_KEY"


class Message(Payload):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class LlmRequest(Payload):
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(1024, gt=0)
    system: str | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    output_schema: dict[str, Any] | None = None  # JSON Schema the reply's text must meet

    @field_validator("output_schema")
    @classmethod
    def _valid_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is not None:
            import jsonschema  # only with a schema: every process would pay ~20 ms to load it

            try:
                jsonschema.validators.validator_for(schema).check_schema(schema)
            except jsonschema.SchemaError as exc:
                raise ValueError(f"not a valid JSON Schema: {exc.message}") from None
        return schema


class Usage(BaseModel):
    input_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=0)
    cache_read_input_tokens: int | None = Field(None, ge=0)
    cache_creation_input_tokens: int | None = Field(None, ge=0)


class LlmResponse(BaseModel):
    """What is kept of a reply (validated: a reply of another shape is INVALID_OUTPUT)."""

    id: str
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    usage: Usage
    #: The model that answered, by the name it was asked by (after any fallback); None for a
    #: reply kept before fallbacks existed.
    answered_by: str | None = None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def text(self) -> str:
        return "".join(b.get("text", "") for b in self.content if b.get("type") == "text")


class LlmResult(LlmResponse):
    """``llm_generate``'s result: the reply, and its text parsed when a schema was given."""

    output: Any = None

    @classmethod
    def checked(cls, reply: LlmResponse, schema: dict[str, Any] | None) -> LlmResult:
        if schema is None:
            return cls(**reply.model_dump(exclude={"text"}))
        import jsonschema  # only with a schema (above)

        try:
            output = json.loads(reply.text)
            jsonschema.validators.validator_for(schema)(schema).validate(output)
        except ValueError as exc:
            problem = f"its text is not JSON ({exc})"
        except jsonschema.ValidationError as exc:
            where = "/".join(str(part) for part in exc.absolute_path) or "the top level"
            problem = f"its JSON does not meet output_schema at {where}: {exc.message}"
        else:
            return cls(**reply.model_dump(exclude={"text"}), output=output)
        raise InvalidOutput(
            f"the reply of {reply.model} (stop_reason {reply.stop_reason}): {problem}",
            output=reply.text,
        )


@dataclass
class LlmClient:
    """The SDK client a worker's attempts share (``ctx.shared``)."""

    sdk: anthropic.AsyncAnthropic

    async def aclose(self) -> None:
        await self.sdk.close()


def client(ctx: JobContext) -> anthropic.AsyncAnthropic:
    import anthropic
    import httpx2

    api_key = ctx.secrets.get(API_KEY_SECRET)
    base_url = os.environ.get("ANTHROPIC_BASE_URL")
    config = ctx.config
    timeout = httpx2.Timeout(config.call_timeout(), connect=config.connect_timeout_ms / 1_000)

    def make() -> LlmClient:
        http = httpx2.AsyncClient(
            timeout=timeout,
            # No retries in the transport either, and no connection cap (the worker's
            # concurrency bounds the calls).
            transport=httpx2.AsyncHTTPTransport(
                retries=0, limits=httpx2.Limits(max_connections=None)
            ),
        )
        sdk = anthropic.AsyncAnthropic(
            api_key=api_key, base_url=base_url, max_retries=0, timeout=timeout, http_client=http
        )
        return LlmClient(sdk)

    key = ("anthropic", ctx.job_type, base_url, api_key, config.call_timeout())
    return ctx.shared(key, make).sdk


async def generate(ctx: JobContext, **params: Any) -> LlmResponse:
    """One streamed Messages call (``params`` as ``messages.stream`` takes them), under the
    type's total and inter-chunk limits, once the token budgets allow it
    (``ctx.check_token_budget``); its tokens recorded for the job (``ctx.record_llm_usage``) and
    counted; with tracing, in a span of its own (the SDK's own span, when it makes one, is its
    child)."""
    await ctx.check_token_budget()  # TOKEN_BUDGET_EXHAUSTED (PERMANENT) once a budget is spent
    sdk = client(ctx)
    model = str(params.get("model"))
    await ctx.admit_call(call_estimate(params), model=model)  # in its model's key, before sent
    call = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "anthropic",
            "gen_ai.request.model": model}  # fmt: skip
    try:
        with ctx.span(f"chat {model}", client=True, attributes=call):
            sent_at = time.monotonic()
            async with ctx.call_limit(), sdk.messages.stream(**params) as stream:
                headers = stream.response.headers
                async for event in within_gaps(stream, ctx.config.inter_chunk_timeout(), "LLM"):
                    if event.type == "text":  # each text delta, live (docs/output.md)
                        ctx.output.text(event.text)
                final = await stream.get_final_message()
        reply = LlmResponse.model_validate(final.model_dump(mode="json"))
    except BaseException as exc:
        ctx.record_llm_call(model, ok=False, failure=ctx.classify(exc))
        if isinstance(exc, Exception) and (said := reply_headers(exc)) is not None:
            await ctx.record_rate_limits(said, model=model)  # a 429's too
        raise
    await ctx.record_rate_limits(headers, model=model)
    usage = reply.usage
    await ctx.record_llm_usage(  # under the model asked for, as a failed call is
        model, input_tokens=usage.input_tokens, output_tokens=usage.output_tokens,
        cache_read_tokens=usage.cache_read_input_tokens or 0,
        cache_creation_tokens=usage.cache_creation_input_tokens or 0, call_id=reply.id,
        sent_at=sent_at,
    )  # fmt: skip
    return reply


def reply_headers(exc: Exception) -> Mapping[str, str] | None:
    """The headers of the reply a failed call got (an HTTP error's, or a stream's that failed
    mid-way), if it got one."""
    headers = getattr(getattr(exc, "response", None), "headers", None)
    return headers if isinstance(headers, Mapping) else None


def estimated_tokens(request: LlmRequest) -> int:
    """A job's cost before its call is made, in tokens (:func:`call_estimate`)."""
    return call_estimate(request.model_dump(mode="json", exclude_none=True))


def call_estimate(params: dict[str, Any]) -> int:
    """A call's cost before it is made, in tokens: its input (messages, system prompt, tools) at
    about four characters a token, plus ``max_tokens`` (what the provider reserves for the
    output). Reconciled with the usage the reply reports (docs/flow-control.md)."""
    text = json.dumps(params.get("messages", [])) + str(params.get("system") or "")
    if params.get("tools"):
        text += json.dumps(params["tools"])
    return len(text) // 4 + 1 + int(params.get("max_tokens", 0))


def fallback_chain(model: str, fallback: Sequence[str]) -> list[str]:
    """The models a call may try, in order: ``model``, then ``fallback``, each once."""
    return list(dict.fromkeys([model, *fallback]))


def fallback_reason(failure: Classified, after_seconds: float) -> str | None:
    """Why a failed call moves to the next model (``overloaded``, ``rate_limited``), or None
    when it does not: an overload always moves it; a rate limit only when the server's hint is
    longer than ``after_seconds`` (without a hint it is retried on the same model)."""
    if failure.throttle == "overloaded":
        return "overloaded"
    if failure.throttle == "rate_limited" and (failure.retry_after or 0) > after_seconds:
        return "rate_limited"
    return None


async def generate_with_fallback(
    ctx: JobContext, *, fallback: Sequence[str] | None = None, step: int | None = None,
    on_job_key: bool = True, **params: Any,
) -> LlmResponse:  # fmt: skip
    """:func:`generate` on ``params["model"]``, moving to the next model of ``fallback`` (the
    type's ``fallback_models`` when None) as the module says, each move recorded with the
    agent's ``step`` if any; the reply's ``answered_by`` names the model that answered.
    ``on_job_key``: ``params["model"]`` is the model the job's flow key is for (the payload's);
    while that key is paused by its provider for longer than ``fallback_after_seconds`` (as
    the database reads it: the claim let the job through for that), the call starts on the
    next model."""
    models = fallback_chain(
        str(params.get("model")), ctx.config.fallback_models if fallback is None else fallback
    )
    if on_job_key and len(models) > 1:
        paused_for = await ctx.flow_key_passable_for()
        if paused_for is not None:
            ctx.log.warning("model %s's key is paused: moving to %s", models[0], models[1])
            await ctx.record_model_fallback(
                models[0], models[1], None, step=step, paused_for=paused_for
            )
            models = models[1:]
    for current, following in zip(models, [*models[1:], None], strict=True):
        try:
            reply = await generate(ctx, **{**params, "model": current})
        except Exception as exc:
            if following is None:
                raise
            failure = ctx.classify(exc)
            if fallback_reason(failure, ctx.config.fallback_after_seconds) is None:
                raise
            ctx.log.warning("model %s is %s: moving to %s", current, failure.throttle, following)
            await ctx.record_model_fallback(current, following, failure, step=step)
            continue
        return reply.model_copy(update={"answered_by": current})
    raise AssertionError("the loop returns or raises")  # pragma: no cover


def register(orc: Orchestrator) -> None:
    @orc.job_type("llm_generate", cost=estimated_tokens)
    async def llm_generate(ctx: JobContext, request: LlmRequest) -> LlmResult:
        params = request.model_dump(mode="json", exclude_none=True, exclude={"output_schema"})
        reply = await generate_with_fallback(ctx, **params)
        return LlmResult.checked(reply, request.output_schema)
