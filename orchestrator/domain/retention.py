"""How long a finished job is kept, by job type and terminal status: the retention policy that
the ``prune_finished`` service applies (docs/operations.md, "Retention").

COMPLETED and CANCELLED jobs are kept ``ORCHESTRATOR_JOB_RETENTION_DAYS``, FAILED ones
``ORCHESTRATOR_FAILED_JOB_RETENTION_DAYS`` (longer by default: a failure is what somebody comes
back to read). A job type's ``retention_days`` / ``failed_retention_days`` in the retry config
(or in its ``[defaults]``) replace them for that type.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from orchestrator.domain.states import Status
from retry_config import JobRetryConfig, RetryConfig

DAY = 86_400.0
#: The statuses a job is deleted from, each with the config field that sets its retention.
FIELDS: Mapping[Status, str] = {
    Status.COMPLETED: "retention_days",
    Status.CANCELLED: "retention_days",
    Status.FAILED: "failed_retention_days",
}


@dataclass(frozen=True)
class Retention:
    """Seconds a finished job is kept: ``default`` by status, and ``by_type`` for the job types
    whose config says otherwise (only the statuses that differ)."""

    default: Mapping[Status, float]
    by_type: Mapping[str, Mapping[Status, float]] = field(default_factory=dict)

    @classmethod
    def of(cls, *, days: float, failed_days: float, config: RetryConfig) -> Retention:
        """The settings' retentions, overridden by the config's ``[defaults]`` and types."""
        base = {Status.COMPLETED: days, Status.CANCELLED: days, Status.FAILED: failed_days}
        default = _seconds(config.defaults, base)
        by_type: dict[str, dict[Status, float]] = {}
        for name, type_config in config.job_types.items():
            own = _seconds(type_config, base)
            differs = {s: v for s, v in own.items() if v != default[s]}
            if differs:
                by_type[name] = differs
        return cls(default=default, by_type=by_type)

    def longest(self) -> float:
        """The longest any finished job is kept (what outlives every job's history)."""
        return max(self._every())

    def shortest(self) -> float:
        """The shortest any finished job is kept (how soon after the rollups' watermark a job
        they have not counted yet can be due)."""
        return min(self._every())

    def _every(self) -> list[float]:
        return [*self.default.values(), *(s for t in self.by_type.values() for s in t.values())]

    def params(self) -> dict[str, Any]:
        """The prune query's arrays: the default by status, and each override (the query keeps
        a job of type t that ended s for the override of (t, s) if there is one, else the
        default of s); and the shortest, for the point it has caught up to."""
        overrides = [
            (t, s.value, v) for t, by in sorted(self.by_type.items()) for s, v in by.items()
        ]
        return {
            "statuses": [s.value for s in self.default],
            "seconds": list(self.default.values()),
            "override_types": [t for t, _, _ in overrides],
            "override_statuses": [s for _, s, _ in overrides],
            "override_seconds": [v for _, _, v in overrides],
            "shortest": self.shortest(),
        }


def _seconds(config: JobRetryConfig, base: Mapping[Status, float]) -> dict[Status, float]:
    """Seconds by status for one config: its own field where set, else ``base``'s days."""
    out: dict[Status, float] = {}
    for status, name in FIELDS.items():
        days: float | None = getattr(config, name)
        out[status] = (base[status] if days is None else days) * DAY
    return out
