"""OpenTelemetry spans, when tracing is on (``ORCHESTRATOR_TRACING=otel``, or a tracer provider
given to the Orchestrator); docs/operations.md, "Traces".

    submit <job type>       PRODUCER, one per job submitted; its trace id is the job's trace_id,
                            and its context is stored with the job (``traceparent``)
    attempt <job type>      CONSUMER, one per attempt, a child of the submit's span (whichever
                            worker runs it, however many retries later); its outcome
      step <n>              one per checkpointed step
        <METHOD>            CLIENT, one per ``ctx.http`` request
        chat <model>        CLIENT, ``llm_generate``'s call (``ctx.span``)

Only the Orchestrator imports this module, and only when tracing is on: off, opentelemetry is
never imported and an attempt does nothing for tracing. No attribute holds a secret: a URL loses
its query and user info and is redacted, and an error is recorded by its redacted text
(OpenTelemetry's own ``record_exception`` would keep the exception's text and stack as they are).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any
from uuid import UUID

import httpx
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from checkpoints import StepClock
from orchestrator.domain.models import Claim, SubmitResult
from orchestrator.domain.secrets import redact
from orchestrator.domain.traceparent import is_trace_id
from orchestrator.runtime import current_attempt
from orchestrator.runtime.outcomes import Failed, Outcome, Retried

SCOPE = "orchestrator"
_W3C = TraceContextTextMapPropagator()
_DEFAULT_PORTS = {"http": 80, "https": 443}


class Tracing:
    def __init__(self, provider: trace.TracerProvider | None = None) -> None:
        """``provider``: None for the global one (whatever the application set up)."""
        self.tracer = trace.get_tracer(SCOPE, tracer_provider=provider)

    # -- submit ----------------------------------------------------------------------------

    @contextmanager
    def submits(
        self, rows: Sequence[dict[str, Any]], chosen: Sequence[bool]
    ) -> Iterator[list[Span]]:
        """A span per job row about to be submitted, each row's ``trace_id`` and
        ``traceparent`` set from its span. A row's parent: the traceparent given at submit;
        else, for a ``trace_id`` the caller chose (``chosen``), that trace; else the caller's
        current span (or none: a new trace, whose id becomes the job's trace_id)."""
        spans = []
        for row, trace_chosen in zip(rows, chosen, strict=True):
            parent = _parent(
                row["traceparent"], row["trace_id"] if trace_chosen else None, UUID(row["id"])
            )
            span = self.tracer.start_span(
                f"submit {row['job_type']}", context=parent, kind=SpanKind.PRODUCER,
                attributes={"orchestrator.job_type": row["job_type"]},
            )  # fmt: skip
            own = span.get_span_context()
            if own.is_valid:  # a recording span, or a sampled-out one: not the API's no-op
                if not trace_chosen:
                    row["trace_id"] = trace.format_trace_id(own.trace_id)
                row["traceparent"] = _traceparent(span)
            spans.append(span)
        try:
            yield spans
        except Exception as exc:
            for span in spans:
                _failed(span, exc)
            raise
        finally:
            for span in spans:
                span.end()

    @staticmethod
    def submitted(spans: Sequence[Span], results: Sequence[SubmitResult]) -> None:
        """Each job's id, and what its submit did (created, replaced, deduplicated)."""
        for span, result in zip(spans, results, strict=True):
            span.set_attributes(
                {"orchestrator.job_id": str(result.job_id), "orchestrator.submit": result.outcome}
            )

    # -- attempts --------------------------------------------------------------------------

    @contextmanager
    def attempt(self, claim: Claim) -> Iterator[Span]:
        """The attempt's span, current for the block; its parent is the job's stored
        traceparent (the submit's span), else the job's trace (a trace_id chosen at submit)."""
        parent = _parent(claim.traceparent, claim.trace_id, claim.id) or Context()
        span = self.tracer.start_span(
            f"attempt {claim.job_type}", context=parent, kind=SpanKind.CONSUMER,
            attributes=_attributes({"orchestrator.run": claim.dispatch_attempt}),
        )  # fmt: skip
        with _current(span):
            yield span

    @staticmethod
    def ended(span: Span, outcome: Outcome) -> None:
        """The attempt's outcome; a retry or a failure is an error, with its stored (redacted)
        message and code."""
        span.set_attribute("orchestrator.outcome", type(outcome).__name__.lower())
        error = (
            outcome.last_error if isinstance(outcome, Retried)
            else outcome.failure.last_error if isinstance(outcome, Failed)
            else None
        )  # fmt: skip
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, f"{error['code']}: {error['message']}"))
            span.set_attribute("error.type", error["code"])

    def steps(self, clock: StepClock) -> StepSpans:
        return StepSpans(self.tracer, clock)

    @contextmanager
    def span(
        self, name: str, *, client: bool, attributes: Mapping[str, AttributeValue] | None
    ) -> Iterator[None]:
        """A child of the current span (the attempt's, or its step's), for the block."""
        span = self.tracer.start_span(
            name, kind=SpanKind.CLIENT if client else SpanKind.INTERNAL,
            attributes=_attributes(attributes or {}),
        )  # fmt: skip
        with _current(span):
            yield

    def transport(self, inner: httpx.AsyncBaseTransport) -> httpx.AsyncBaseTransport:
        return TracedTransport(inner, self.tracer)


class StepSpans:
    """The attempt's step clock, with a span per checkpointed step: begun with the step, ended
    at its checkpoint, when the next step is asked for, or with the attempt (:meth:`end`). The
    step's span is current while it runs, so its calls' spans are its children."""

    def __init__(self, tracer: trace.Tracer, clock: StepClock) -> None:
        self.tracer = tracer
        self.clock = clock
        self.open: tuple[Span, object] | None = None  # the step's span, and its attach token

    def start(self, step: int) -> None:
        self.end(None)
        self.clock.start(step)
        span = self.tracer.start_span(
            f"step {step}", attributes=_attributes({"orchestrator.step": step})
        )
        self.open = (span, otel_context.attach(trace.set_span_in_context(span)))

    def stop(self) -> None:
        try:
            self.clock.stop()
        except Exception as exc:  # the step overran
            self.end(exc)
            raise
        self.end(None)

    def end(self, error: BaseException | None) -> None:
        """End the open step's span, if any: ``error`` is what ended the step, if it failed."""
        if self.open is None:
            return
        span, token = self.open
        self.open = None
        otel_context.detach(token)  # type: ignore[arg-type]
        if isinstance(error, Exception):
            _failed(span, error)
        span.end()


class TracedTransport(httpx.AsyncBaseTransport):
    """A CLIENT span per request of ``ctx.http``: method, URL (no query, no user info,
    redacted), server, and the response's status (an error from 400 up)."""

    def __init__(self, inner: httpx.AsyncBaseTransport, tracer: trace.Tracer) -> None:
        self.inner = inner
        self.tracer = tracer

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        address = url.copy_with(query=None, fragment=None, username=None, password=None)
        port = url.port or _DEFAULT_PORTS.get(url.scheme)
        span = self.tracer.start_span(
            request.method,
            kind=SpanKind.CLIENT,
            attributes=_attributes(
                {
                    "http.request.method": request.method,
                    "url.full": redact(str(address)),
                    "server.address": url.host,
                    **({"server.port": port} if port else {}),
                }
            ),
        )
        with _current(span):
            response = await self.inner.handle_async_request(request)
            span.set_attribute("http.response.status_code", response.status_code)
            if response.status_code >= 400:
                span.set_status(Status(StatusCode.ERROR))
                span.set_attribute("error.type", str(response.status_code))
            return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def _parent(traceparent: str | None, trace_id: str | None, job_id: UUID) -> Context | None:
    """The context a job's span continues: its traceparent; else, when its trace_id can be a
    W3C trace id, that trace, under a parent span id made from the job id (a job submitted
    without tracing has no span to continue, yet its spans belong in its trace); else None."""
    if traceparent:
        return _W3C.extract({"traceparent": traceparent})
    if trace_id is None or not is_trace_id(trace_id):
        return None
    root = trace.SpanContext(
        trace_id=int(trace_id, 16),
        span_id=int.from_bytes(job_id.bytes[8:]) or 1,
        is_remote=True,
        trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED),
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(root))


def _traceparent(span: Span) -> str:
    own = span.get_span_context()
    return (
        f"00-{trace.format_trace_id(own.trace_id)}-{trace.format_span_id(own.span_id)}"
        f"-{own.trace_flags:02x}"
    )


def _attributes(more: Mapping[str, AttributeValue]) -> dict[str, AttributeValue]:
    """The running attempt's fields (``orchestrator.job_id``...), and ``more``."""
    fields = current_attempt.fields() or {}
    own = {f"orchestrator.{name}": value for name, value in fields.items() if value is not None}
    return {**own, **more}


@contextmanager
def _current(span: Span) -> Iterator[None]:
    """``span`` current for the block, ended after it; an exception marks it failed."""
    with trace.use_span(span, end_on_exit=True, record_exception=False,
                        set_status_on_exception=False):  # fmt: skip
        try:
            yield
        except Exception as exc:
            _failed(span, exc)
            raise


def _failed(span: Span, exc: Exception) -> None:
    span.set_status(Status(StatusCode.ERROR, redact(f"{type(exc).__name__}: {exc}")))
    span.set_attribute("error.type", type(exc).__qualname__)
