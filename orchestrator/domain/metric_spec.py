"""How a metric is defined: one table row per metric (its name as scraped, kind, labels and
help). The tables (orchestrator.runtime.metrics, orchestrator.services.fleet) are the one place
each metric is defined: the collectors are built from them, and the alert rules and the
dashboard are checked against them (tests/test_monitoring.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class Spec:
    name: str  # a counter's with its ``_total``
    kind: Kind
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...] = ()  # a histogram's
