"""A Prometheus exposition read back as the tests compare it: one value per sample."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(exposition: str) -> Samples:
    """(sample name, sorted labels) -> value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
    }


def value(found: Samples, name: str, **labels: str) -> float:
    """The sample's value; 0 when it was not exposed."""
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


async def counted(orc: Any) -> Samples:
    """What an Orchestrator in this process has counted so far."""
    body, _ = await orc.metrics.exposition("")
    return samples(body.decode())
