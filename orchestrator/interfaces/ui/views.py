"""What the dashboard's pages show, computed from what the stores return: pure functions, so
the templates only lay them out (and the tests can check them without a browser)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from orchestrator.domain.backoff import app_delay_bounds_ms, graphile_delay_seconds
from orchestrator.domain.classification import ErrorClass
from orchestrator.domain.states import TERMINAL, Status
from retry_config import JobRetryConfig

#: Rows of a backoff schedule shown at most (a type may allow thousands of retries).
SCHEDULE_ROWS = 12


def layer_of(error_class: ErrorClass | str | None) -> str | None:
    """Which layer retries a job in RETRY, from its last failure's class: the infrastructure
    layer re-runs the dispatch after a TRANSIENT_INFRA failure; every other retry (a
    TRANSIENT_APP failure, a swept zombie, a RetryLater) is the application layer's."""
    if error_class is None:
        return None
    return "infra" if ErrorClass(error_class) is ErrorClass.TRANSIENT_INFRA else "app"


@dataclass(frozen=True)
class Delay:
    retry: int
    low_s: float
    high_s: float

    @property
    def text(self) -> str:
        if self.low_s == self.high_s:
            return seconds(self.low_s)
        return f"{seconds(self.low_s)} to {seconds(self.high_s)}"


def app_schedule(config: JobRetryConfig) -> list[Delay]:
    """The application layer's delays before retries 1..n (their jitter's range)."""
    rows = []
    for n in range(1, min(config.app_max_retries, SCHEDULE_ROWS) + 1):
        low, high = app_delay_bounds_ms(n, config.backoff)
        rows.append(Delay(n, low / 1000, high / 1000))
    return rows


def infra_schedule(config: JobRetryConfig) -> list[Delay]:
    """Graphile Worker's delays after runs 1..max-1 of a dispatch (no jitter)."""
    runs = range(1, min(config.worker_max_attempts - 1, SCHEDULE_ROWS) + 1)
    return [Delay(run, graphile_delay_seconds(run), graphile_delay_seconds(run)) for run in runs]


def seconds(value: float) -> str:
    """A duration as people read it: 850 ms, 12.5 s, 3 min 20 s, 2 h 5 min."""
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 60:
        return f"{value:.3g} s"
    if value < 3600:
        return f"{int(value // 60)} min {int(value % 60)} s"
    return f"{int(value // 3600)} h {int(value % 3600 // 60)} min"


def ago(when: datetime | None, now: datetime) -> str:
    if when is None:
        return "never"
    return f"{seconds(max(0.0, (now - when).total_seconds()))} ago"


def readable(payload: Any) -> list[tuple[str, str]]:
    """An event's payload as (field, text) lines: scalars as they are, a nested value as compact
    JSON, empty fields left out (a person reads the lines; the raw JSON is shown beside)."""
    if not isinstance(payload, dict):
        return [("value", _text(payload))]
    lines = []
    for key, value in payload.items():
        if value is None or value == "" or value == {} or value == []:
            continue
        if isinstance(value, dict) and {"message", "code"} <= value.keys():
            value = f"[{value.get('classification', '')} {value['code']}] {value['message']}"
        lines.append((key.replace("_", " "), _text(value)))
    return lines


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def pretty(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=2, sort_keys=True)


@dataclass(frozen=True)
class Counts:
    """Unfinished jobs counted three ways, and the recent outcomes."""

    by_status: dict[str, int]
    by_type: dict[str, int]
    by_tenant: dict[str, int]
    finished: int
    failed: int
    window_s: float

    @property
    def per_second(self) -> float:
        return self.finished / self.window_s

    @property
    def failure_share(self) -> float:
        return self.failed / self.finished if self.finished else 0.0


def counts(
    jobs: list[dict[str, Any]],
    outcomes: dict[str, int],
    window_s: float,
    tenants: frozenset[str] | None,
) -> Counts:
    """From the fleet's rows (status, job_type, tenant, n), those of the principal's tenants."""
    by_status: Counter[str] = Counter({s.value: 0 for s in Status if s not in TERMINAL})
    by_type: Counter[str] = Counter()
    by_tenant: Counter[str] = Counter()
    for row in jobs:
        tenant = row["tenant"] or None
        if tenants is not None and tenant not in tenants:
            continue
        by_status[row["status"]] += row["n"]
        by_type[row["job_type"]] += row["n"]
        by_tenant[tenant or "(none)"] += row["n"]
    finished = sum(outcomes.values())
    return Counts(
        dict(by_status), dict(by_type.most_common()), dict(by_tenant.most_common()),
        finished, outcomes.get(Status.FAILED.value, 0), window_s,
    )  # fmt: skip
