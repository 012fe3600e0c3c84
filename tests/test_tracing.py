"""Traces: with tracing on, a span per submit and per attempt, and within an attempt a span per
checkpointed step and per external call, all in the job's trace; a W3C traceparent given at
submit is continued, a malformed one refused; no secret in any span. The OpenTelemetry SDK's
in-memory exporter on a tracer provider given to the Orchestrator; real PostgreSQL, a real
worker in the test's event loop, real HTTP peers and the local Messages API. With tracing off,
a worker never imports opentelemetry."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode, format_span_id, format_trace_id

import tasks.llm
from demo import llm_server as llm
from orchestrator import Orchestrator, Status, SubmitError
from tests.support import http_peers, observed_app
from tests.support.harness import BASE_CONFIG, ROOT, WorkerRun

VALUE = "traced-secret-0123456789"
KEY = "sk-trace-test-0123456789"
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = "00f067aa0ba902b7"
INCOMING = f"00-{TRACE}-{CALLER}-01"


@pytest.fixture
def peers() -> Iterator[http_peers.Peers]:
    with http_peers.serve() as p:
        yield p


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> TracerProvider:
    made = TracerProvider()
    made.add_span_processor(SimpleSpanProcessor(exporter))
    return made


@pytest.fixture
async def orc(
    make_orc: Callable[..., Orchestrator], provider: TracerProvider, monkeypatch: pytest.MonkeyPatch
) -> Orchestrator:
    monkeypatch.setenv(observed_app.SECRET, VALUE)
    made = make_orc(tracer_provider=provider)
    observed_app.register(made)
    await made.open()
    return made


def named(spans: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent else None


def texts(spans: Sequence[ReadableSpan]) -> list[str]:
    """Every text a span carries: its name, status, attributes and events' attributes."""
    found = []
    for span in spans:
        found += [span.name, span.status.description or ""]
        found += [str(value) for value in (span.attributes or {}).values()]
        for event in span.events:
            found += [event.name, *(str(value) for value in (event.attributes or {}).values())]
    return found


@pytest.mark.logs_errors(r"myapp: a handled error")
async def test_a_job_s_spans_continue_the_traceparent_given_at_submit(
    orc: Orchestrator, exporter: InMemorySpanExporter, peers: http_peers.Peers
) -> None:
    async with WorkerRun(orc) as worker:
        job_id = await orc.submit("observed", {"url": peers.url}, traceparent=INCOMING)
        await worker.until_finished(job_id)
    job, spans = await orc.get_job(job_id), exporter.get_finished_spans()
    assert job.status is Status.COMPLETED
    [submit] = named(spans, "submit observed")
    assert submit.kind is SpanKind.PRODUCER and parent_of(submit) == int(CALLER, 16)
    assert submit.attributes == {
        "orchestrator.job_type": "observed",
        "orchestrator.job_id": str(job_id),
        "orchestrator.submit": "created",
    }
    assert job.trace_id == TRACE
    assert job.traceparent == f"00-{TRACE}-{format_span_id(submit.context.span_id)}-01"

    [attempt] = named(spans, "attempt observed")
    assert attempt.kind is SpanKind.CONSUMER and parent_of(attempt) == submit.context.span_id
    attributes = dict(attempt.attributes or {})
    assert attributes.pop("orchestrator.worker").startswith(job.locked_by or "")
    assert attributes == {
        "orchestrator.job_id": str(job_id),
        "orchestrator.job_type": "observed",
        "orchestrator.attempt": 1,
        "orchestrator.trace_id": TRACE,
        "orchestrator.run": 1,
        "orchestrator.outcome": "completed",
    }
    steps = [span for span in spans if span.name.startswith("step ")]
    assert sorted(span.name for span in steps) == ["step 1", "step 2"]
    assert {parent_of(span) for span in steps} == {attempt.context.span_id}
    calls = named(spans, "GET")
    assert sorted(parent_of(call) for call in calls) == sorted(s.context.span_id for s in steps)
    for call in calls:
        assert call.kind is SpanKind.CLIENT
        assert call.attributes is not None
        assert call.attributes["url.full"] == f"{peers.url}/status/observed"  # no query
        assert call.attributes["http.response.status_code"] == 200
        assert call.attributes["orchestrator.job_id"] == str(job_id)
    assert {format_trace_id(span.context.trace_id) for span in spans} == {TRACE}
    assert not [text for text in texts(spans) if VALUE in text]


@pytest.mark.logs_errors(r"myapp: a handled error")
async def test_every_attempt_is_a_child_of_the_submit_and_a_retry_is_an_error(
    orc: Orchestrator, exporter: InMemorySpanExporter, peers: http_peers.Peers
) -> None:
    peers.script("flaky", [503])  # attempt 1's call fails: TRANSIENT_APP, retried
    async with WorkerRun(orc) as worker:
        job_id = await orc.submit("observed", {"url": peers.url, "name": "flaky", "steps": 1})
        await worker.until_finished(job_id)
    job, spans = await orc.get_job(job_id), exporter.get_finished_spans()
    assert job.status is Status.COMPLETED and job.attempt == 2
    [submit] = named(spans, "submit observed")
    assert job.trace_id == format_trace_id(submit.context.trace_id)  # a new trace: the job's
    first, second = sorted(named(spans, "attempt observed"), key=lambda s: s.start_time or 0)
    assert parent_of(first) == parent_of(second) == submit.context.span_id
    assert first.attributes is not None and first.attributes["orchestrator.outcome"] == "retried"
    assert first.status.status_code is StatusCode.ERROR
    assert first.status.description is not None
    assert first.status.description.startswith("HTTP_503: ")
    assert f"[REDACTED:{observed_app.SECRET}]" in first.status.description
    failed_call, _ = sorted(named(spans, "GET"), key=lambda s: s.start_time or 0)
    assert failed_call.status.status_code is StatusCode.ERROR
    assert failed_call.attributes is not None and failed_call.attributes["error.type"] == "503"
    failed_step, _ = sorted(named(spans, "step 1"), key=lambda s: s.start_time or 0)
    assert failed_step.status.status_code is StatusCode.ERROR
    assert parent_of(failed_step) == first.context.span_id
    assert not [text for text in texts(spans) if VALUE in text]


async def test_submit_many_continues_the_caller_s_span_or_the_traceparent_given(
    orc: Orchestrator, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    caller = provider.get_tracer("a caller")
    with caller.start_as_current_span("handle request") as request:
        first, second = await orc.submit_many(
            [
                {"job_type": "observed", "payload": {"url": "http://127.0.0.1:9"}},
                {"job_type": "observed", "payload": {"url": "http://127.0.0.1:9"},
                 "traceparent": INCOMING},
            ]
        )  # fmt: skip
    spans = exporter.get_finished_spans()
    by_job = {
        (s.attributes or {}).get("orchestrator.job_id"): s for s in named(spans, "submit observed")
    }
    assert parent_of(by_job[str(first)]) == request.get_span_context().span_id
    assert parent_of(by_job[str(second)]) == int(CALLER, 16)
    assert (await orc.get_job(first)).trace_id == format_trace_id(
        request.get_span_context().trace_id
    )
    assert (await orc.get_job(second)).trace_id == TRACE


@pytest.mark.logs_errors(r"myapp: a handled error")
async def test_a_job_submitted_without_tracing_is_run_in_its_own_trace(
    orc: Orchestrator,
    make_orc: Callable[..., Orchestrator],
    exporter: InMemorySpanExporter,
    peers: http_peers.Peers,
) -> None:
    untraced = make_orc()
    observed_app.register(untraced)
    await untraced.open()
    job_id = await untraced.submit("observed", {"url": peers.url, "steps": 1})
    async with WorkerRun(orc) as worker:
        await worker.until_finished(job_id)
    job = await orc.get_job(job_id)
    assert job.traceparent is None
    [attempt] = named(exporter.get_finished_spans(), "attempt observed")
    assert format_trace_id(attempt.context.trace_id) == job.trace_id
    # Under a parent that no span has: the job's, its span id made from the job id.
    assert attempt.parent is not None and attempt.parent.is_remote
    assert attempt.parent.span_id == int.from_bytes(job_id.bytes[8:])


async def test_llm_generate_s_call_has_a_span_without_the_api_key(
    orc: Orchestrator, exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    tasks.llm.register(orc)
    with llm.serve(api_key=KEY) as server:
        monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
        monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url)
        request = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
        async with WorkerRun(orc) as worker:
            job_id = await orc.submit("llm_generate", request)
            await worker.until_finished(job_id)
    assert (await orc.get_job(job_id)).status is Status.COMPLETED
    spans = exporter.get_finished_spans()
    [attempt] = named(spans, "attempt llm_generate")
    [call] = named(spans, "chat m")
    assert call.kind is SpanKind.CLIENT and parent_of(call) == attempt.context.span_id
    assert call.attributes is not None
    assert call.attributes["gen_ai.request.model"] == "m"
    assert call.attributes["orchestrator.job_id"] == str(job_id)
    assert not [text for text in texts(spans) if KEY in text]


@pytest.mark.parametrize(
    "traceparent",
    [
        "not a traceparent",
        f"00-{TRACE.upper()}-{CALLER}-01",  # W3C: lowercase only
        f"00-{'0' * 32}-{CALLER}-01",
        f"00-{TRACE}-{'0' * 16}-01",
        f"ff-{TRACE}-{CALLER}-01",
        f"00-{TRACE}-{CALLER}-01-more",  # version 00 has four fields
    ],
)
async def test_a_malformed_traceparent_is_refused_at_submit(
    orc: Orchestrator, traceparent: str
) -> None:
    with pytest.raises(SubmitError, match=r"traceparent: .*not a W3C traceparent"):
        await orc.submit("observed", {"url": "http://127.0.0.1:9"}, traceparent=traceparent)
    with pytest.raises(SubmitError, match="trace_id differs from the trace id of traceparent"):
        await orc.submit(
            "observed", {"url": "http://127.0.0.1:9"}, traceparent=INCOMING, trace_id="mine"
        )
    assert await orc.list_jobs() == []


@pytest.mark.parametrize(("tracing", "imported"), [("off", False), ("otel", True)])
async def test_a_worker_imports_opentelemetry_only_with_tracing_on(
    dsn: str, db: psycopg.AsyncConnection[Any], peers: http_peers.Peers, tracing: str,
    imported: bool,
) -> None:  # fmt: skip
    """A fresh interpreter submits a job with steps and calls, and runs a worker until it is
    done. On, without an SDK set up, the spans cost little and are dropped."""
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "tests.support.solo_worker", peers.url],
        cwd=ROOT, capture_output=True, text=True, check=False, timeout=120,
        env={**os.environ, "DATABASE_URL": dsn, "ORCHESTRATOR_HEALTH_PORT": "0",
             "ORCHESTRATOR_RETRY_CONFIG": str(BASE_CONFIG), "ORCHESTRATOR_TRACING": tracing,
             observed_app.SECRET: VALUE},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["status"] == "COMPLETED"
    assert bool(report["opentelemetry"]) is imported, report["opentelemetry"]
