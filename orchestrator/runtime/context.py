"""What a task sees of its own attempt: ``async def fn(ctx: JobContext, payload)``."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Hashable, Mapping
from contextlib import AbstractAsyncContextManager, AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar
from uuid import UUID

import httpx

from checkpoints import ApprovalGate, Children, Ledger, StepClock, Steps
from checkpoints.ledger import Call, Reconcile
from orchestrator.domain import events
from orchestrator.domain.classification import Classified, classify
from orchestrator.domain.models import Awaited
from orchestrator.domain.secrets import Secrets
from orchestrator.runtime.calls import call_limit
from orchestrator.runtime.metrics import LlmOutcome, Metrics
from orchestrator.runtime.output import Output
from retry_config import JobRetryConfig

if TYPE_CHECKING:
    from orchestrator.runtime.tracing import Tracing
    from orchestrator.runtime.usage import Accounting

C = TypeVar("C")
S = TypeVar("S")
T = TypeVar("T")


@dataclass(frozen=True)
class JobContext:
    job_id: UUID
    job_type: str
    attempt: int  # every claim of this job so far, this one included (never reset)
    run: int  # run of the current dispatch (infrastructure retries)
    retry_count: int  # application retries used before this attempt
    max_retries: int
    lease_token: UUID  # this attempt's run id; every write it makes is fenced by it
    worker: str
    trace_id: str
    agent_id: str | None
    tenant_id: str | None  # whose job this is (docs/contracts.md, "Tenants")
    config: JobRetryConfig
    log: logging.LoggerAdapter[logging.Logger]
    #: HTTP client with the type's connect and total call timeouts (see orchestrator.runtime.calls).
    http: httpx.AsyncClient = field(repr=False)
    #: Secrets by name, from the environment or the mounted secrets directory; their values
    #: are redacted from stored errors and logs (orchestrator.domain.secrets).
    secrets: Secrets = field(repr=False)
    #: Its live output, read by clients as it is written (docs/output.md):
    #: ``ctx.output.text(delta)``, ``ctx.output.progress({"tool": "search"})``.
    output: Output = field(repr=False)
    _should_abort: Callable[[], bool] = field(repr=False)
    _shared: Callable[[Hashable, Callable[[], Any]], Any] = field(repr=False)
    _parents: Callable[[], Awaitable[list[Awaited]]] = field(repr=False)
    _children: Children = field(repr=False)
    _ledger: Ledger = field(repr=False)
    _gate: ApprovalGate = field(repr=False)
    _step_clock: StepClock = field(repr=False)
    _metrics: Metrics = field(repr=False)
    _tracing: Tracing | None = field(repr=False)
    _accounting: Accounting | None = field(default=None, repr=False)

    def should_abort(self) -> bool:
        """True once this attempt should stop: a drain, a cancel, its step overran, or its job
        was handed to another attempt.

        Long tasks check it between steps; an ``await`` is cancelled anyway when it happens.
        """
        return self._should_abort()

    def shared(self, key: Hashable, make: Callable[[], C]) -> C:
        """A client shared by this worker's attempts (made once per ``key`` by ``make()``,
        closed with ``aclose()`` when the worker stops; see orchestrator.runtime.clients)."""
        client: C = self._shared(key, make)
        return client

    async def parents(self) -> list[Awaited]:
        """The jobs this one depends on (its ``depends_on``, in order), each with its result,
        typed as its job type declares it, or, under the ``run`` policy, its failure
        (docs/workflows.md); [] for a job without."""
        return await self._parents()

    def classify(self, exc: BaseException) -> Classified:
        """How the attempt would classify ``exc`` (the application's classifiers first), e.g.
        to tell a provider's rate limit or overload (``.throttled``) from other failures."""
        return classify(exc, self._ledger.classifiers)

    def record_llm_call(
        self, model: str, *, ok: bool, failure: Classified | None = None, input_tokens: int = 0,
        output_tokens: int = 0, cache_read_tokens: int = 0, cache_creation_tokens: int = 0,
    ) -> None:  # fmt: skip
        """Count one LLM call made by the task and its tokens, as the provider reported them
        (``orchestrator_llm_calls_total``, ``orchestrator_llm_tokens_total``): the built-in
        ``llm_generate`` does; a task calling a model through its own client can too. A failed
        call's ``failure`` (``ctx.classify(exc)``) counts a rate limit as ``rate_limited`` and an
        overload as ``overloaded``; any other failure, or none given, is ``error``."""
        outcome: LlmOutcome = "ok" if ok else (failure and failure.throttle) or "error"
        self._metrics.llm_call(
            model, outcome=outcome,
            tokens={"input": input_tokens, "output": output_tokens,
                    "cache_read": cache_read_tokens, "cache_creation": cache_creation_tokens},
        )  # fmt: skip

    async def record_model_fallback(
        self, from_model: str, to_model: str, failure: Classified | None, *,
        step: int | None = None, paused_for: float | None = None,
    ) -> None:  # fmt: skip
        """Record in the job's events (``job.model_fallback``) that an LLM call moved from
        ``from_model`` to ``to_model`` after ``failure``, or, with none, before its call, its
        flow key paused for ``paused_for`` seconds more; fenced by the attempt's lease (a
        superseded attempt raises StaleLease)."""
        payload = events.model_fallback(
            from_model, to_model, failure, step=step, paused_for=paused_for
        )
        await self._ledger.store.record_event(self._ledger.fence, "job.model_fallback", payload)

    async def record_llm_usage(
        self, model: str, *, input_tokens: int = 0, output_tokens: int = 0,
        cache_read_tokens: int = 0, cache_creation_tokens: int = 0, call_id: str | None = None,
        sent_at: float | None = None,
    ) -> None:  # fmt: skip
        """Record one LLM call that returned, with its tokens as the provider reported them:
        written at once for this job (its tenant, agent and type; totals and budgets read it),
        and counted as ``record_llm_call(ok=True, ...)`` counts it. ``call_id`` (the provider's
        message id) makes it written once however often it is tried; ``sent_at`` (the
        ``time.monotonic()`` at which the request was sent) dates its spend in its flow key's
        window from then, as the provider counts it. The built-in ``llm_generate`` and
        ``run_agent`` call it, and a task calling a model through its own client should too."""
        if self._accounting is None:  # not run by a worker's attempt: count it only
            self.record_llm_call(
                model, ok=True, input_tokens=input_tokens, output_tokens=output_tokens,
                cache_read_tokens=cache_read_tokens, cache_creation_tokens=cache_creation_tokens,
            )  # fmt: skip
            return
        await self._accounting.record(
            model, input_tokens=input_tokens, output_tokens=output_tokens,
            cache_read_tokens=cache_read_tokens, cache_creation_tokens=cache_creation_tokens,
            call_id=call_id, sent_at=sent_at,
        )  # fmt: skip

    async def record_rate_limits(
        self, headers: Mapping[str, str], *, model: str | None = None
    ) -> None:
        """After each reply of a model's provider, a success or an error: its ``headers``. Under a
        limit that learns (``learn = true``), their rate-limit headers
        (``anthropic-ratelimit-*``, or ``x-ratelimit-*`` of OpenAI-compatible servers) keep the
        job's flow key in step with the provider's limits, for the whole fleet: a lower
        provider limit lowers the key's, and a limit with nothing remaining holds the key until
        its reset (docs/flow-control.md, "Limits learned from the provider"). The built-in
        ``llm_generate`` and ``run_agent`` do it for each of their calls. Nothing for a reply
        without them, or a job whose limit does not learn. ``model``: the model the call was
        admitted for (``admit_call(model=...)``), so a fallback model's headers go to its own
        key::

            response = await ctx.http.post(url, json=body)
            await ctx.record_rate_limits(response.headers)
        """
        if self._accounting is not None:
            await self._accounting.learn(headers, model)

    async def admit_call(self, units: int = 1, *, model: str | None = None) -> None:
        """Before each LLM call the task sends through its own client: admit it in its job's
        flow key's window (``requests`` and ``units`` per interval, fleet-wide), ``units`` its
        estimate in the limit's units (e.g. its input at about four characters a token plus
        ``max_tokens``), corrected to the reply's usage by ``record_llm_usage`` after. A call
        that fits goes at once; one whose room comes within a couple of seconds waits for it
        here; one that would wait longer ends the attempt: the job gives its worker slot back
        and waits in its key's line, then resumes from its last checkpoint, at this call. The
        built-in ``llm_generate`` and ``run_agent`` admit each of their calls. ``model``: the
        model the call goes to, when it is not the one the job's key is for (a fallback model):
        the call is admitted against that model's key, its usage reconciled there. Nothing for
        a job whose limit has no window (docs/flow-control.md, "Every call admitted")::

            await ctx.admit_call(units=estimate)
            sent_at = time.monotonic()
            reply = await client.messages.create(...)
            await ctx.record_llm_usage(model, input_tokens=..., output_tokens=..., sent_at=sent_at)
        """
        if self._accounting is not None:
            await self._accounting.admit(units, model)

    async def flow_key_passable_for(self) -> float | None:
        """Seconds the job's flow key stays paused from now when the job may pass the pause on
        a fallback model (None: it may not, the key is not paused, or the job runs under no
        limit): a provider's pause longer than the type's ``fallback_after_seconds`` as the
        fleet's config has it, the database deciding as the claim that let the job through
        did. The job then calls the next model, admitted against that model's key."""
        return None if self._accounting is None else await self._accounting.key_passable_for()

    async def check_token_budget(self) -> None:
        """Before an LLM call: raise :class:`~orchestrator.domain.errors.TokenBudgetExhausted`
        (PERMANENT, ``TOKEN_BUDGET_EXHAUSTED``) once the job's own token budget, or its
        tenant's for the current period, is spent."""
        if self._accounting is not None:
            await self._accounting.check()

    def call_limit(self, tool: str | None = None) -> AbstractAsyncContextManager[None]:
        """Bound one call (a tool run, a subprocess...) by the type's limit for ``tool``
        (``tool_timeouts_ms``, else ``call_timeout_ms``); overrunning raises CallTimedOut.

            async with ctx.call_limit("kubectl"):
                await run_kubectl(args)
        """
        what = f"tool {tool!r}" if tool else "call"
        return call_limit(self.config.call_timeout(tool), what)

    def span(
        self,
        name: str,
        *,
        client: bool = False,
        attributes: Mapping[str, str | bool | int | float] | None = None,
    ) -> AbstractContextManager[None]:
        """A span of this attempt's trace around the block, a child of the current step's (or
        the attempt's): ``client=True`` for a call to another service. Nothing when tracing is
        off. Never put a secret in ``attributes``.

            with ctx.span("render", attributes={"pages": 3}):
                render(doc)
        """
        if self._tracing is None:
            return nullcontext()
        return self._tracing.span(name, client=client, attributes=attributes)

    def steps(
        self, state_type: Any = Any, *, initial: Any = None, max_steps: int | None = None
    ) -> Steps[Any]:
        """Checkpointed steps, from the one after the last checkpoint (see checkpoints.steps),
        each under the step timeout.

        ``state_type`` (a pydantic model, or any type pydantic knows) validates the state
        written by ``step.checkpoint`` and read back on resume; ``initial`` is step 1's state.
        """
        return Steps(
            self._ledger, self._gate, state_type, initial, max_steps, self._step_clock,
            self._children,
        )  # fmt: skip

    async def effect(
        self,
        name: str,
        call: Call[T],
        *,
        key: str,
        args: Any = None,
        idempotent: bool = False,
        reconcile: Reconcile | None = None,
        result_type: Any = Any,
    ) -> T:
        """A side effect in a plain task (its single implicit step): recorded pending before the
        call, committed as soon as it returns, never made twice (see checkpoints.ledger)."""
        return await self._ledger.effect(
            step=1, key=key, name=name, call=call, args=args, idempotent=idempotent,
            reconcile=reconcile, result_type=result_type, commit_now=True,
        )  # fmt: skip
