"""The metrics the project exports: what the alert rules and the dashboard may name. The
worker's metrics (every worker's ``/metrics`` on ORCHESTRATOR_HEALTH_PORT) and the fleet's
(``orchestrator exporter``) are read from the tables their collectors are built from
(orchestrator/runtime/metrics.py, orchestrator/services/fleet.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from orchestrator.runtime.metrics import WORKER_METRICS
from orchestrator.services.fleet import FLEET_METRICS

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class Metric:
    kind: Kind
    labels: frozenset[str]


#: Fleet metrics that another part of issue 27 (the flow-control core) adds to the exporter and
#: the alert rules already name: each counts as exported until FLEET_METRICS has it (then its
#: own spec wins, and the entry can go).
ANNOUNCED = {"orchestrator_flow_key_paused": Metric("gauge", frozenset({"key"}))}


def exported() -> dict[str, Metric]:
    """Every metric exported, by name: the workers' and the fleet's, from the tables their
    collectors are built from."""
    return ANNOUNCED | {
        spec.name: Metric(spec.kind, frozenset(spec.labels))
        for spec in (*WORKER_METRICS, *FLEET_METRICS)
    }


@dataclass(frozen=True)
class Series:
    """A name a query can select: a gauge or counter as such, a histogram's parts."""

    metric: str
    kind: Kind
    labels: frozenset[str]
    counts: bool  # a counter or a histogram's part: read through rate()/increase()


def series(metrics: dict[str, Metric]) -> dict[str, Series]:
    found = {}
    for name, metric in metrics.items():
        if metric.kind == "histogram":
            found[f"{name}_bucket"] = Series(name, "histogram", metric.labels | {"le"}, True)
            for part in ("_sum", "_count"):
                found[name + part] = Series(name, "histogram", metric.labels, True)
        else:
            found[name] = Series(name, metric.kind, metric.labels, metric.kind == "counter")
    return found
