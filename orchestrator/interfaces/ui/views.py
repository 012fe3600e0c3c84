"""What the dashboard's pages show, computed from what the stores return: pure functions, so
the templates only lay them out (and the tests can check them without a browser)."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from orchestrator.domain.backoff import app_delay_bounds_ms, graphile_delay_seconds
from orchestrator.domain.classification import ErrorClass
from orchestrator.domain.rollups import Stats
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
    #: Jobs failed for good in the window, counted from their events as they happen (the
    #: rollups' ``failed`` counts them only once their minute is rolled up).
    failed_now: int = 0

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
    failed_now: int = 0,
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
        finished, outcomes.get(Status.FAILED.value, 0), window_s, failed_now,
    )  # fmt: skip


# -- charts (inline SVG, drawn here: the page loads nothing from elsewhere) -------------------

#: The drawing's size in SVG units (it scales to its box).
CHART_WIDTH, CHART_HEIGHT = 600, 160


@dataclass(frozen=True)
class Line:
    name: str  # its CSS class (chart-<name>) and legend
    points: str  # an SVG polyline's points
    total: int
    peak: int


@dataclass(frozen=True)
class Chart:
    title: str
    lines: list[Line]
    top: int  # the value at the top edge
    start: str  # the x axis' ends and middle, as people read them
    end: str
    unit: str  # what one point is: "per minute", "per hour"
    nothing: str  # what it says when every line is 0
    y_label: str = "jobs"  # what the y axis counts
    middle: str = ""
    width: int = CHART_WIDTH
    height: int = CHART_HEIGHT

    @property
    def empty(self) -> bool:
        return all(line.total == 0 for line in self.lines)

    @property
    def ticks(self) -> list[str]:
        """The y axis' scale, top to bottom, at the top, the middle and the bottom edge."""
        return [f"{self.top:g}", f"{self.top / 2:g}", "0"]

    @property
    def gridlines(self) -> list[float]:
        """Where the ticks' lines are drawn (SVG units from the top)."""
        return [0.0, self.height / 2]


def chart(
    title: str,
    steps: list[datetime],
    series: dict[str, dict[datetime, int]],
    *,
    unit: str,
    known_until: datetime | None,
    sums: bool = True,
    nothing: str = "no jobs in the rollups yet",
    y_label: str = "jobs",
) -> Chart:
    """Lines of ``series`` (name -> value per step; a step missing is 0) over ``steps``, scaled
    to a round top, drawn up to ``known_until`` (the steps after it are not known yet: not
    drawn as zeros); ``sums``: a line's total is the sum of its steps (else its last value);
    ``nothing``: what an empty chart says; ``y_label``: what its y axis counts."""
    peak = max((v for values in series.values() for v in values.values()), default=0)
    top = round_up(peak)
    last = max(len(steps) - 1, 1)
    known = [at for at in steps if known_until is None or at < known_until]
    lines = []
    for name, values in series.items():
        ys = [values.get(at, 0) for at in known]
        points = " ".join(
            f"{i * CHART_WIDTH / last:.1f},{CHART_HEIGHT - y * CHART_HEIGHT / top:.1f}"
            for i, y in enumerate(ys)
        )
        total = sum(ys) if sums else (ys[-1] if ys else 0)
        lines.append(Line(name, points, total, max(ys, default=0)))
    days = bool(steps) and steps[-1] - steps[0] > timedelta(hours=12)
    start, end = (_clock(steps[0], days), _clock(steps[-1], days)) if steps else ("", "")
    middle = _clock(steps[len(steps) // 2], days) if steps else ""
    return Chart(title, lines, top, start, end, unit, nothing, y_label, middle)


def last_sample(stats: Stats) -> datetime | None:
    """Just after the newest queue depth sample of the read (None: no sample)."""
    newest = max((p.at for s in stats.queue_depth for p in s.points), default=None)
    return None if newest is None else newest + timedelta(seconds=stats.step)


def round_up(value: float) -> int:
    """The smallest of 1, 2, 5 times a power of ten at or above ``value`` (1 at least)."""
    top, factors = 1, itertools.cycle((2, 2.5, 2))  # 1, 2, 5, 10, 20, 50, ...
    while top < value:
        top = int(top * next(factors))
    return top


def _clock(when: datetime, days: bool) -> str:
    return f"{when:%a %H:%M} UTC" if days else f"{when:%H:%M} UTC"


def steps_of(since: datetime, until: datetime, step: int) -> list[datetime]:
    """Every step's start in ``[since, until)``."""
    count = int((until - since).total_seconds() // step)
    return [since + timedelta(seconds=step * i) for i in range(count)]


def outcome_series(stats: Stats) -> dict[str, dict[datetime, int]]:
    """Per step: jobs completed, failed, and retries scheduled (both layers), summed over the
    read's series."""
    lines: dict[str, dict[datetime, int]] = {"completed": {}, "failed": {}, "retried": {}}
    for series in stats.jobs:
        for p in series.points:
            for name, n in (("completed", p.completed), ("failed", p.failed),
                            ("retried", p.app_retries + p.infra_retries)):  # fmt: skip
                lines[name][p.at] = lines[name].get(p.at, 0) + n
    return lines


def depth_series(stats: Stats) -> dict[str, dict[datetime, int]]:
    lines: dict[str, dict[datetime, int]] = {"waiting": {}, "running": {}}
    for series in stats.queue_depth:
        for p in series.points:
            lines["waiting"][p.at] = lines["waiting"].get(p.at, 0) + p.waiting
            lines["running"][p.at] = lines["running"].get(p.at, 0) + p.running
    return lines


#: The usage page's grouping columns: each group's heading.
USAGE_COLUMN = {"job": "Job", "tenant": "Tenant", "agent": "Agent", "model": "Model",
                "job_type": "Job type"}  # fmt: skip
