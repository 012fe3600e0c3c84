"""The fleet's state, read from the database for Prometheus, once for the whole fleet.

Served by ``orchestrator exporter`` (one process: a worker's own /metrics counts what that worker
did; the fleet is one set of rows, and every worker exporting it would multiply the queries and
the series). One scrape is one read-only transaction of five grouped queries, each on indexes
(orc_jobs_unfinished_counts, orc_jobs_pending_run_at, orc_jobs_retry_due,
orc_jobs_running_heartbeat, orc_dead_letters_state_tenant, orc_approvals_pending_expiry,
orc_llm_usage_recorded_at: the last hour's LLM calls): ``bench/fleet_scrape.py`` times it at
1,000,000 jobs (before the LLM tokens were added; their read grows with the calls of the last
hour, not with the jobs); and the rollups' and retention's lags, a row each (the rollups'
watermark, the point retention caught up to: orchestrator.services.retention). A scrape within
``min_interval`` of the last one is answered from it, so several Prometheus replicas cost the
database no more than one.

Tenants are user data: past the ``max_tenants`` largest, the rest are summed under the tenant
``_other``, so the series stay bounded; so are models (``orchestrator_llm_tokens_recent``: past
the ``MAX_MODELS`` most used, under ``_other``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from orchestrator.domain.errors import DatabaseUnavailable, TransactionConflict
from orchestrator.domain.metric_spec import Spec
from orchestrator.domain.usage import KINDS
from orchestrator.storage.fleet import FleetRows, FleetStore
from orchestrator.storage.runner import Row

OTHER_TENANTS = "_other"

JOBS = Spec(
    "orchestrator_jobs", "gauge", ("status", "job_type", "tenant"),
    "Unfinished jobs (PENDING, RUNNING, RETRY, WAITING_APPROVAL, BLOCKED), by status, type "
    "and tenant.",
)  # fmt: skip
RETRYING_RATIO = Spec(
    "orchestrator_jobs_retrying_ratio", "gauge", (),
    "Jobs in RETRY among the unfinished ones (0 when there are none).",
)  # fmt: skip
QUEUE_DEPTH = Spec(
    "orchestrator_queue_depth", "gauge", ("queue",),
    "Jobs due and waiting to start (PENDING past run_at, RETRY past next_retry_at), by queue.",
)  # fmt: skip
QUEUE_OLDEST_AGE = Spec(
    "orchestrator_queue_oldest_age_seconds", "gauge", ("queue",),
    "How long the queue's oldest due-and-waiting job has been due.",
)  # fmt: skip
DEAD_LETTERS = Spec(
    "orchestrator_dead_letters", "gauge", ("state", "tenant"),
    "Dead letters kept, by state and tenant.",
)  # fmt: skip
APPROVALS_WAITING = Spec(
    "orchestrator_approvals_waiting", "gauge", (), "Approvals waiting for a decision."
)
ZOMBIES = Spec(
    "orchestrator_zombies", "gauge", (),
    "RUNNING jobs whose heartbeat is older than the zombie threshold (not swept yet).",
)  # fmt: skip
FLOW_PAUSED = Spec(
    "orchestrator_flow_key_paused", "gauge", ("key",),
    "1 while the flow key is paused (a provider's 429/529 hint, or an operator), else 0.",
)  # fmt: skip
FLOW_WAITING = Spec(
    "orchestrator_flow_waiting_jobs", "gauge", ("key",),
    "Jobs waiting for capacity on the flow key (PENDING or RETRY, no attempt spent).",
)  # fmt: skip
FLOW_RUNNING = Spec(
    "orchestrator_flow_running_jobs", "gauge", ("key",), "Jobs of the flow key running now."
)
FLOW_RATE = Spec(
    "orchestrator_flow_rate_factor", "gauge", ("key",),
    "The flow key's adaptive rate: 1 in full, halved by each 429 without a hint.",
)  # fmt: skip
#: The window the fleet's recent tokens are summed over (seconds).
LLM_WINDOW = 3600
#: Models the recent tokens are labelled with, the most used first; the rest under OTHER_MODELS
#: (a model is a job's payload: user data).
MAX_MODELS = 20
OTHER_MODELS = "_other"
LLM_TOKENS_RECENT = Spec(
    "orchestrator_llm_tokens_recent", "gauge", ("tenant", "model", "kind"),
    "Tokens of the LLM calls recorded in the last hour (orc_llm_usage), by the job's tenant, the"
    " model and the kind (input, output, cache_read, cache_creation).",
)  # fmt: skip
ROLLUP_LAG = Spec(
    "orchestrator_rollup_lag_seconds", "gauge", (),
    "How far the rollups' watermark is behind now: jobs that finished since are not counted yet,"
    " and retention keeps them (one to three minutes when the rollups keep up).",
)  # fmt: skip
RETENTION_LAG = Spec(
    "orchestrator_retention_lag_seconds", "gauge", (),
    "How far the point retention last caught up to is behind now: no job that became due for"
    " deletion before it is left, so no job has been overdue longer (about a minute when"
    " retention keeps up).",
)  # fmt: skip
APPLICATION_CONFLICTS = Spec(
    "orchestrator_application_conflicts", "gauge", ("application", "other", "kind", "name"),
    "1 for each declaration of an application refused because another application defines the"
    " name otherwise, while both have a live process (docs/applications.md).",
)  # fmt: skip
JOBS_UNSERVED = Spec(
    "orchestrator_jobs_unserved", "gauge", ("job_type",),
    "Waiting jobs (PENDING, RETRY) of a type that no application with a live process declares:"
    " they wait until one is back (docs/applications.md).",
)  # fmt: skip
FLEET_UP = Spec("orchestrator_fleet_up", "gauge", (), "1 when the last scrape read the database.")
SCRAPE_DURATION = Spec(
    "orchestrator_fleet_scrape_duration_seconds", "gauge", (),
    "Time the last scrape of the fleet took (its queries).",
)  # fmt: skip
FLEET_METRICS = (
    JOBS, RETRYING_RATIO, QUEUE_DEPTH, QUEUE_OLDEST_AGE, DEAD_LETTERS, APPROVALS_WAITING, ZOMBIES,
    FLOW_PAUSED, FLOW_WAITING, FLOW_RUNNING, FLOW_RATE, LLM_TOKENS_RECENT, ROLLUP_LAG,
    RETENTION_LAG, APPLICATION_CONFLICTS, JOBS_UNSERVED, FLEET_UP, SCRAPE_DURATION,
)  # fmt: skip


@dataclass(frozen=True)
class Scrape:
    families: list[Metric]
    at: float


class FleetMetrics:
    def __init__(
        self,
        store: FleetStore,
        *,
        zombie_threshold: float,
        max_tenants: int,
        min_interval: float,
        live_seconds: float = 30,
    ) -> None:
        self.store = store
        self.zombie_threshold = zombie_threshold
        self.live_seconds = live_seconds
        self.max_tenants = max_tenants
        self.min_interval = min_interval
        self._last: Scrape | None = None

    async def exposition(self, accept: str) -> tuple[bytes, str]:
        """The fleet's metrics, in the format the scraper's Accept header asks for."""
        registry = CollectorRegistry()
        registry.register(_Families(await self.families()))
        encode, content_type = choose_encoder(accept)
        return encode(registry), content_type

    async def families(self) -> list[Metric]:
        now = time.monotonic()
        if self._last is not None and now - self._last.at < self.min_interval:
            return self._last.families
        started = time.perf_counter()
        families: list[Metric] = []
        try:
            rows = await self.store.read(
                zombie_threshold=self.zombie_threshold, llm_window=LLM_WINDOW,
                live_seconds=self.live_seconds,
            )  # fmt: skip
        except (DatabaseUnavailable, TransactionConflict):
            up = 0
        else:
            families.extend(self._read(rows))
            up = 1
        families.append(_value(FLEET_UP, up))
        families.append(_value(SCRAPE_DURATION, time.perf_counter() - started))
        self._last = Scrape(families, now)
        return families

    def _read(self, rows: FleetRows) -> Iterator[Metric]:
        jobs = _family(JOBS)
        counted = self._bounded(
            {(r["status"], r["job_type"], r["tenant"]): r["n"] for r in rows.jobs}
        )
        for labels, n in sorted(counted.items()):
            jobs.add_metric(list(labels), n)
        yield jobs
        unfinished = sum(counted.values())
        retrying = sum(n for (status, _, _), n in counted.items() if status == "RETRY")
        yield _value(RETRYING_RATIO, retrying / unfinished if unfinished else 0.0)
        depth, oldest = _family(QUEUE_DEPTH), _family(QUEUE_OLDEST_AGE)
        for row in rows.queues:
            depth.add_metric([row["queue"]], row["depth"])
            oldest.add_metric([row["queue"]], float(row["oldest_age"]))
        yield from (depth, oldest)
        letters = _family(DEAD_LETTERS)
        kept = self._bounded({(r["state"], r["tenant"]): r["n"] for r in rows.dead_letters})
        for labels, n in sorted(kept.items()):
            letters.add_metric(list(labels), n)
        yield letters
        yield _value(APPROVALS_WAITING, rows.approvals)
        yield _value(ZOMBIES, rows.zombies)
        flow = {
            spec: _family(spec) for spec in (FLOW_PAUSED, FLOW_WAITING, FLOW_RUNNING, FLOW_RATE)
        }
        for row in rows.flow:
            flow[FLOW_PAUSED].add_metric([row["key"]], 1.0 if row["paused"] else 0.0)
            flow[FLOW_WAITING].add_metric([row["key"]], row["waiting"])
            flow[FLOW_RUNNING].add_metric([row["key"]], row["running"])
            flow[FLOW_RATE].add_metric([row["key"]], float(row["rate_factor"]))
        yield from flow.values()
        yield self._llm_tokens(rows.llm_tokens)
        yield _value(ROLLUP_LAG, rows.rollup_lag)
        yield _value(RETENTION_LAG, rows.retention_lag)
        conflicts = _family(APPLICATION_CONFLICTS)
        for row in rows.conflicts:
            conflicts.add_metric([row["application"], row["other"], row["kind"], row["name"]], 1)
        yield conflicts
        unserved = _family(JOBS_UNSERVED)
        for row in rows.unserved:
            unserved.add_metric([row["job_type"]], row["pending"] + row["retry"])
        yield unserved

    def _llm_tokens(self, rows: list[Row]) -> GaugeMetricFamily:
        """The recent tokens by tenant, model and kind: the ``MAX_MODELS`` most used models
        and the ``max_tenants`` largest tenants keep their names, the rest are summed."""
        by_model: Counter[str] = Counter()
        for r in rows:
            by_model[r["model"]] += sum(r[kind] for kind in KINDS)
        models = {model for model, _ in by_model.most_common(MAX_MODELS)}
        counted: Counter[tuple[str, ...]] = Counter()
        for r in rows:
            model = r["model"] if r["model"] in models else OTHER_MODELS
            for kind in KINDS:
                counted[(model, kind, r["tenant"])] += r[kind]
        family = _family(LLM_TOKENS_RECENT)
        for (model, kind, tenant), n in sorted(self._bounded(dict(counted)).items()):
            family.add_metric([tenant, model, kind], n)
        return family

    def _bounded(self, counts: dict[tuple[str, ...], int]) -> dict[tuple[str, ...], int]:
        """The counts with every tenant (the last label) past the ``max_tenants`` largest
        summed under OTHER_TENANTS."""
        by_tenant: Counter[str] = Counter()
        for labels, n in counts.items():
            by_tenant[labels[-1]] += n
        kept = {tenant for tenant, _ in by_tenant.most_common(self.max_tenants)}
        bounded: Counter[tuple[str, ...]] = Counter()
        for labels, n in counts.items():
            tenant = labels[-1] if labels[-1] in kept else OTHER_TENANTS
            bounded[(*labels[:-1], tenant)] += n
        return dict(bounded)


def _family(spec: Spec) -> GaugeMetricFamily:
    return GaugeMetricFamily(spec.name, spec.help, labels=list(spec.labels))


def _value(spec: Spec, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(spec.name, spec.help, value=value)


class _Families(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)
