"""What a worker process counts, for Prometheus: served at ``/metrics`` on its health port.

One :class:`Metrics` per Orchestrator, with a registry of its own (never prometheus-client's
global one: several orchestrators in one process, as in the tests, would collide there). What
the workers do is counted as it happens (attempts, heartbeats, stale writes, refused
transitions, maintenance runs, LLM calls); what they are doing now (running jobs, free slots,
readiness, heartbeat age) is read from them at each scrape.

Label values are bounded, and none names a job: the application's job types, the outcomes,
error classes and layers of orchestrator.domain, the lanes, the maintenance services and their
actions, the LLM models the job types call. docs/operations.md lists every metric.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Literal, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from orchestrator.domain import states
from orchestrator.domain.metric_spec import Spec
from orchestrator.domain.models import Claim

#: Seconds: an attempt takes milliseconds (a no-op) to an hour (the default job timeout).
DURATION_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
#: Seconds a due job waits to start: milliseconds when the fleet keeps up, minutes behind a backlog.
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 15, 60, 300, 1800)
#: Seconds a heartbeat statement takes.
HEARTBEAT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
NONE = "none"  # the label value for "not applicable" (no error class, no layer)
#: Models an LLM call's series are labelled with, in the order first called; later ones are
#: counted under OTHER_MODEL (a model is a job's payload, user data: its labels stay bounded).
MAX_MODELS = 20
OTHER_MODEL = "_other"
#: Which guard refused a transition (see TRANSITIONS_REFUSED).
RefusedBy = Literal["database", "worker", "request"]
#: Maintenance services, for the series that exist at 0 from the start.
SERVICES = (
    "sweep_zombies",
    "retry_safety_net",
    "expire_approvals",
    "prune_checkpoints",
    "prune_finished",
    "rollup_jobs",
)

ATTEMPTS_STARTED = Spec(
    "orchestrator_attempts_started_total", "counter", ("job_type",), "Attempts started."
)
ATTEMPTS_FINISHED = Spec(
    "orchestrator_attempts_finished_total", "counter",
    ("job_type", "outcome", "error_class", "layer"),
    "Attempts ended, by what their end wrote (outcome), a failure's error class and a retry's"
    " layer.",
)  # fmt: skip
ATTEMPT_DURATION = Spec(
    "orchestrator_attempt_duration_seconds", "histogram", ("job_type", "outcome"),
    "Time from an attempt's start to its outcome.", DURATION_BUCKETS,
)  # fmt: skip
QUEUE_WAIT = Spec(
    "orchestrator_queue_wait_seconds", "histogram", ("job_type",),
    "A job's first attempt: time from its due time to its start.", WAIT_BUCKETS,
)  # fmt: skip
RETRY_LATENESS = Spec(
    "orchestrator_retry_lateness_seconds", "histogram", ("job_type",),
    "A retry: time from its next_retry_at to its start.", WAIT_BUCKETS,
)  # fmt: skip
HEARTBEATS = Spec(
    "orchestrator_heartbeats_total", "counter", ("result",),
    "Heartbeat statements (one per interval for all of a worker's running jobs).",
)  # fmt: skip
HEARTBEAT_DURATION = Spec(
    "orchestrator_heartbeat_duration_seconds", "histogram", (),
    "Time a heartbeat statement took.", HEARTBEAT_BUCKETS,
)  # fmt: skip
STALE_WRITES = Spec(
    "orchestrator_stale_writes_total", "counter", ("job_type", "write"),
    "Writes of a superseded attempt, refused by the lease (the job was swept, cancelled or"
    " replaced meanwhile).",
)  # fmt: skip
TRANSITIONS_REFUSED = Spec(
    "orchestrator_transitions_refused_total", "counter",
    ("from_status", "to_status", "refused_by"),
    "Transitions the state machine refused (WF_STATE_TRANSITION_INVALID), by which guard:"
    " database (a write the code never makes on purpose), worker (a write that found its job"
    " moved on), request (an operator's action on a job in another state).",
)  # fmt: skip
MAINTENANCE_RUNS = Spec(
    "orchestrator_maintenance_runs_total", "counter", ("service", "result"),
    "Runs of the maintenance services (their periodic ticks).",
)  # fmt: skip
MAINTENANCE_ROWS = Spec(
    "orchestrator_maintenance_rows_total", "counter", ("service", "action"),
    "Rows the maintenance services handled, by what they did with them.",
)  # fmt: skip
LLM_CALLS = Spec(
    "orchestrator_llm_calls_total", "counter", ("model", "outcome"),
    "LLM calls made by job types, by outcome: ok, rate_limited (the provider's 429),"
    " overloaded (its 529) or error (any other failure).",
)  # fmt: skip
#: The outcomes of an LLM call, as ``orchestrator_llm_calls_total`` counts them.
LlmOutcome = Literal["ok", "error", "rate_limited", "overloaded"]
LLM_TOKENS = Spec(
    "orchestrator_llm_tokens_total", "counter", ("model", "kind"),
    "Tokens of the LLM calls made by job types, as the provider counted them.",
)  # fmt: skip
FLOW_CALL_WAIT = Spec(
    "orchestrator_flow_call_wait_seconds_total", "counter", ("job_type",),
    "Seconds running jobs' LLM calls waited in place for room in their flow key's window, their"
    " worker slots held meanwhile (a longer wait parks the job instead).",
)  # fmt: skip
RETRY_CONFIG_RELOADS = Spec(
    "orchestrator_retry_config_reloads_total", "counter", ("result",),
    "New versions of the retry config file this process read: applied, or refused (invalid;"
    " the version in effect stays).",
)  # fmt: skip
RETRY_CONFIG_REFUSED = Spec(
    "orchestrator_retry_config_refused", "gauge", (),
    "1 while the retry config file holds a version this process refused (it runs the previous"
    " one), else 0.",
)  # fmt: skip
RETRY_CONFIG_VERSION = Spec(
    "orchestrator_retry_config_version", "gauge", ("version",),
    "1, labelled with the version (content hash) of the retry config in effect.",
)  # fmt: skip
#: Read from the workers at each scrape.
RUNNING_JOBS = Spec("orchestrator_running_jobs", "gauge", (), "Attempts this process runs now.")
SLOTS = Spec("orchestrator_slots", "gauge", ("lane",), "Slots of this process's workers, by lane.")
FREE_SLOTS = Spec("orchestrator_free_slots", "gauge", ("lane",), "Free slots, by lane.")
WORKER_READY = Spec(
    "orchestrator_worker_ready", "gauge", (),
    "1 while every worker of this process accepts work (not draining, its last fetch reached"
    " the database), else 0.",
)  # fmt: skip
HEARTBEAT_AGE = Spec(
    "orchestrator_heartbeat_age_seconds", "gauge", (),
    "Seconds since the last successful heartbeat of the jobs this process runs (0 when it runs"
    " none).",
)  # fmt: skip
WORKER_METRICS = (
    ATTEMPTS_STARTED, ATTEMPTS_FINISHED, ATTEMPT_DURATION, QUEUE_WAIT, RETRY_LATENESS,
    HEARTBEATS, HEARTBEAT_DURATION, STALE_WRITES, TRANSITIONS_REFUSED, MAINTENANCE_RUNS,
    MAINTENANCE_ROWS, LLM_CALLS, LLM_TOKENS, FLOW_CALL_WAIT, RETRY_CONFIG_RELOADS,
    RETRY_CONFIG_REFUSED, RETRY_CONFIG_VERSION, RUNNING_JOBS, SLOTS, FREE_SLOTS, WORKER_READY,
    HEARTBEAT_AGE,
)  # fmt: skip


def family(spec: Spec) -> GaugeMetricFamily:
    """An empty family of this gauge, for a collector to fill at a scrape."""
    return GaugeMetricFamily(spec.name, spec.help, labels=list(spec.labels))


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.attempts_started = self._counter(ATTEMPTS_STARTED)
        self.attempts_finished = self._counter(ATTEMPTS_FINISHED)
        self.attempt_duration = self._histogram(ATTEMPT_DURATION)
        self.queue_wait = self._histogram(QUEUE_WAIT)
        self.retry_lateness = self._histogram(RETRY_LATENESS)
        self.heartbeats = self._counter(HEARTBEATS)
        self.heartbeat_duration = self._histogram(HEARTBEAT_DURATION)
        self.stale_writes = self._counter(STALE_WRITES)
        self.transitions_refused = self._counter(TRANSITIONS_REFUSED)
        self.maintenance_runs = self._counter(MAINTENANCE_RUNS)
        self.maintenance_rows = self._counter(MAINTENANCE_ROWS)
        self.llm_calls = self._counter(LLM_CALLS)
        self.llm_tokens = self._counter(LLM_TOKENS)
        self.flow_call_wait = self._counter(FLOW_CALL_WAIT)
        self.config_reloads = self._counter(RETRY_CONFIG_RELOADS)
        self.config_refused_now = self._gauge(RETRY_CONFIG_REFUSED)
        self.config_version = self._gauge(RETRY_CONFIG_VERSION)
        self._models: set[str] = set()
        # Series an alert takes the increase() of exist from the start, at 0: the first
        # increment of a series that did not exist is invisible to increase().
        for source, target in states.illegal_pairs():
            self.transitions_refused.labels(source, target, "database")
        for terminal in sorted(states.TERMINAL):  # a finished job's outcome rewritten
            self.transitions_refused.labels(terminal.value, terminal.value, "database")
        for service in SERVICES:
            for result in ("ok", "failed"):
                self.maintenance_runs.labels(service, result)
        for result in ("applied", "refused"):
            self.config_reloads.labels(result)

    def _counter(self, spec: Spec) -> Counter:
        return Counter(
            spec.name.removesuffix("_total"), spec.help, spec.labels, registry=self.registry
        )

    def _gauge(self, spec: Spec) -> Gauge:
        return Gauge(spec.name, spec.help, spec.labels, registry=self.registry)

    def _histogram(self, spec: Spec) -> Histogram:
        return Histogram(
            spec.name, spec.help, spec.labels, buckets=spec.buckets, registry=self.registry
        )

    # -- as it happens ---------------------------------------------------------------------

    def attempt_started(self, claim: Claim, due_at: float | None) -> None:
        """An attempt starts; ``due_at`` (epoch seconds) is when its dispatch became due, if
        known."""
        self.attempts_started.labels(claim.job_type).inc()
        if due_at is None:
            return
        late = max(0.0, time.time() - due_at)
        waited = self.queue_wait if claim.attempt == 1 else self.retry_lateness
        waited.labels(claim.job_type).observe(late)

    def attempt_finished(
        self, job_type: str, outcome: str, seconds: float, *, error_class: str = NONE,
        layer: str = NONE,
    ) -> None:  # fmt: skip
        self.attempts_finished.labels(job_type, outcome, error_class, layer).inc()
        self.attempt_duration.labels(job_type, outcome).observe(seconds)

    def heartbeat(self, *, ok: bool, seconds: float) -> None:
        self.heartbeats.labels("ok" if ok else "failed").inc()
        if ok:
            self.heartbeat_duration.observe(seconds)

    def stale_write(self, job_type: str, write: str) -> None:
        self.stale_writes.labels(job_type, write).inc()

    def transition_refused(self, from_status: str, to_status: str, refused_by: RefusedBy) -> None:
        self.transitions_refused.labels(from_status, to_status, refused_by).inc()

    def maintenance_run(self, service: str, rows: dict[str, int] | None) -> None:
        """A run of ``service``: what it did (action -> rows), or None when it failed."""
        self.maintenance_runs.labels(service, "failed" if rows is None else "ok").inc()
        for action, count in (rows or {}).items():
            if count:
                self.maintenance_rows.labels(service, action).inc(count)

    def llm_call(
        self, model: str, *, outcome: LlmOutcome, tokens: dict[str, int] | None = None
    ) -> None:
        """One LLM call to the model a job asked for, and how it ended; ``tokens``: kind (input,
        output, cache_read, cache_creation) -> count."""
        if model not in self._models:
            if len(self._models) < MAX_MODELS:
                self._models.add(model)
            else:
                model = OTHER_MODEL
        self.llm_calls.labels(model, outcome).inc()
        for kind, count in (tokens or {}).items():
            if count:
                self.llm_tokens.labels(model, kind).inc(count)

    def call_waited(self, job_type: str, seconds: float) -> None:
        """A call of a running ``job_type`` job waited ``seconds`` in place for room in its
        flow key's window."""
        self.flow_call_wait.labels(job_type).inc(seconds)

    def config_applied(self, version: str) -> None:
        """The retry config ``version`` is in effect (at start-up, or applied by a reload, or
        the file back to it after a refusal)."""
        self.config_refused_now.set(0)
        self.config_version.clear()
        self.config_version.labels(version).set(1)

    def config_refused(self) -> None:
        """The file's new version was refused: the one in effect stays."""
        self.config_reloads.labels("refused").inc()
        self.config_refused_now.set(1)

    def config_reloaded(self) -> None:
        self.config_reloads.labels("applied").inc()

    # -- at a scrape -----------------------------------------------------------------------

    def watch(self, workers: Callable[[], Iterable[WorkerState]]) -> None:
        """Report what ``workers()`` are doing at each scrape."""
        self.registry.register(_Live(workers))

    async def exposition(self, accept: str) -> tuple[bytes, str]:
        """The registry, in the format the scraper's ``Accept`` header asks for (Prometheus
        text, or OpenMetrics): (body, content type)."""
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type


class WorkerState(Protocol):
    """What a scrape reads of a running worker."""

    def lane_slots(self) -> Iterable[tuple[str, int, int]]:
        """(lane, slots, free slots) of each lane."""
        ...

    @property
    def running_count(self) -> int: ...

    @property
    def ready(self) -> bool: ...

    def heartbeat_age(self) -> float:
        """Seconds since its last successful heartbeat while it runs jobs; 0 when none run."""
        ...


class _Live(Collector):
    def __init__(self, workers: Callable[[], Iterable[WorkerState]]) -> None:
        self.workers = workers

    def collect(self) -> Iterator[Metric]:
        workers = list(self.workers())
        running = family(RUNNING_JOBS)
        running.add_metric([], sum(w.running_count for w in workers))
        slots, free = family(SLOTS), family(FREE_SLOTS)
        by_lane: dict[str, list[int]] = {}
        for worker in workers:
            for lane, capacity, available in worker.lane_slots():
                total = by_lane.setdefault(lane, [0, 0])
                total[0] += capacity
                total[1] += available
        for lane, (capacity, available) in sorted(by_lane.items()):
            slots.add_metric([lane], capacity)
            free.add_metric([lane], available)
        ready = family(WORKER_READY)
        ready.add_metric([], 1 if workers and all(w.ready for w in workers) else 0)
        age = family(HEARTBEAT_AGE)
        age.add_metric([], max((w.heartbeat_age() for w in workers), default=0.0))
        yield from (running, slots, free, ready, age)


class NoMetrics(Metrics):
    """Counts nothing, serves an empty /metrics: the ``metrics`` setting turned off (what the
    metrics cost is what bench/throughput.py measures against this)."""

    def attempt_started(self, claim: Claim, due_at: float | None) -> None:
        pass

    def attempt_finished(
        self, job_type: str, outcome: str, seconds: float, *, error_class: str = NONE,
        layer: str = NONE,
    ) -> None:  # fmt: skip
        pass

    def heartbeat(self, *, ok: bool, seconds: float) -> None:
        pass

    def stale_write(self, job_type: str, write: str) -> None:
        pass

    def transition_refused(self, from_status: str, to_status: str, refused_by: RefusedBy) -> None:
        pass

    def maintenance_run(self, service: str, rows: dict[str, int] | None) -> None:
        pass

    def llm_call(
        self, model: str, *, outcome: LlmOutcome, tokens: dict[str, int] | None = None
    ) -> None:
        pass

    def call_waited(self, job_type: str, seconds: float) -> None:
        pass

    def config_applied(self, version: str) -> None:
        pass

    def config_refused(self) -> None:
        pass

    def config_reloaded(self) -> None:
        pass

    def watch(self, workers: Callable[[], Iterable[WorkerState]]) -> None:
        pass
