"""Tracing's cost per attempt, off and on.

    ./dev bench tracing [--attempts 20000] [--jobs 3000] [--rounds 3]

1. In process, no database: what a worker adds around each attempt, for an attempt of two
   checkpointed steps with one call each. Off: the attempt's log fields (a context variable
   set and reset) and the empty span context, all that tracing off costs. On: the attempt's
   span, two step spans, two call spans and the outcome, through the OpenTelemetry SDK (a
   TracerProvider whose SimpleSpanProcessor exports to memory), and through the API alone (no
   SDK set up: ``ORCHESTRATOR_TRACING=otel`` in an application that configured nothing).
2. End to end: one worker in this process drains N queued no-op jobs, tracing off and on (the
   SDK, a BatchSpanProcessor exporting to memory: a production set-up's shape), taking turns
   ``--rounds`` times on one database; wall time per job, medians.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time
import uuid
from datetime import UTC, datetime

import psycopg
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bench.common import fresh_database, machine
from orchestrator import JobContext, Orchestrator, Settings
from orchestrator.domain.models import Claim
from orchestrator.runtime import current_attempt
from orchestrator.runtime.outcomes import Completed
from orchestrator.runtime.tracing import Tracing
from orchestrator.runtime.worker import NO_SPAN

TRUNCATE = (
    "TRUNCATE orc_job_events, orc_dead_letters, orc_jobs, procrastinate_events, "
    "procrastinate_periodic_defers, procrastinate_jobs, procrastinate_workers "
    "RESTART IDENTITY CASCADE"
)


class _Clock:
    """A step clock that does nothing (the deadline's own cost is not tracing's)."""

    def start(self, step: int) -> None:
        pass

    def stop(self) -> None:
        pass


def claim() -> Claim:
    return Claim(
        id=uuid.uuid4(), job_type="noop", tenant_id=None, payload=None, attempt=1, max_attempts=3,
        dispatch_attempt=1, retry_count=0, max_retries=3, lease_token=uuid.uuid4(),
        locked_by="bench/1/w1", queue="noop", priority=0, timeout_seconds=60,
        trace_id=uuid.uuid4().hex, agent_id=None, started_at=datetime.now(UTC),
        run_at=datetime.now(UTC),
        traceparent=f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01",
    )  # fmt: skip


def per_attempt_us(tracing: Tracing | None, attempts: int) -> float:
    """CPU microseconds a worker adds around one attempt (two steps, one call each)."""
    claims = [claim() for _ in range(attempts)]
    outcome = Completed(None, {})
    started = time.process_time()
    for one in claims:
        with current_attempt.running(one):
            if tracing is None:
                with NO_SPAN:
                    pass
                continue
            with tracing.attempt(one) as span:
                steps = tracing.steps(_Clock())
                for number in (1, 2):
                    steps.start(number)
                    with tracing.span("GET", client=True, attributes={"url.full": "http://x/"}):
                        pass
                    steps.stop()
                steps.end(None)
                tracing.ended(span, outcome)
    return (time.process_time() - started) / attempts * 1e6


def sdk(processor: str) -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter(max_spans=10_000)
    provider = TracerProvider()
    made = SimpleSpanProcessor(exporter) if processor == "simple" else BatchSpanProcessor(exporter)
    provider.add_span_processor(made)
    return provider, exporter


def make_orc(dsn: str, provider: TracerProvider | None) -> Orchestrator:
    orc = Orchestrator(settings=Settings(health_port=0), dsn=dsn, tracer_provider=provider)

    @orc.job_type("noop")
    async def noop(ctx: JobContext, payload: int) -> None:
        return None

    return orc


async def drain_us(dsn: str, jobs: int, traced: bool) -> float:
    """Wall microseconds per job for one worker draining ``jobs`` queued no-op jobs."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(TRUNCATE)
    provider = sdk("batch")[0] if traced else None
    async with make_orc(dsn, provider) as orc:
        for start in range(0, jobs, 1000):
            await orc.submit_many(
                {"job_type": "noop", "payload": i} for i in range(start, min(jobs, start + 1000))
            )
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute("ANALYZE orc_jobs; ANALYZE procrastinate_jobs")
        started = time.perf_counter()
        await orc.run_worker(wait=False, install_signal_handlers=False)
        elapsed = time.perf_counter() - started
    if provider is not None:
        provider.shutdown()
    return elapsed / jobs * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--attempts", type=int, default=20_000)
    parser.add_argument("--jobs", type=int, default=3_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    logging.getLogger("orchestrator").setLevel(logging.WARNING)  # no line per job
    print(machine())
    print(f"1. around one attempt (2 steps, 2 calls), CPU per attempt, {args.attempts} attempts")
    per_attempt_us(None, 1_000)  # warm up
    print(f"   off:                    {per_attempt_us(None, args.attempts):8.1f} us")
    print(f"   on, API only (no SDK):  {per_attempt_us(Tracing(), args.attempts):8.1f} us")
    provider, _ = sdk("simple")
    print(f"   on, SDK (6 spans):      {per_attempt_us(Tracing(provider), args.attempts):8.1f} us")
    print(f"2. one worker drains {args.jobs} no-op jobs, wall time per job, {args.rounds} rounds")
    times: dict[bool, list[float]] = {False: [], True: []}
    with fresh_database("orc_bench_tracing") as dsn:
        for _ in range(args.rounds):
            for traced in (False, True):
                times[traced].append(asyncio.run(drain_us(dsn, args.jobs, traced)))
    for traced, label in ((False, "off"), (True, "on, SDK (batch)")):
        rounds = ", ".join(f"{t:.0f}" for t in times[traced])
        print(f"   {label:<22}  median {statistics.median(times[traced]):6.0f} us ({rounds})")


if __name__ == "__main__":
    main()
