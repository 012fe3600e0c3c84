"""History kept as rollups (migration 0026): what a stats read may ask for, and what a rollup's
duration histogram says.

A rollup row counts the jobs that finished in one period (a minute, or an hour summed from its
minutes) of one job type, queue and tenant: their outcomes, their retries by layer, and their
durations as counts in fixed buckets, so that rows add up across periods and groups and a
percentile can still be estimated from the sum (as a Prometheus histogram is). Pure: the
storage reads and writes the rows, the API, the CLI and the dashboard ask through
:func:`window`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.domain.errors import InvalidArgument

#: The duration buckets: each counts the jobs that took less than its bound (ms) and at least
#: the previous one's; the last has no bound. Their names are orc_job_rollups' columns.
BUCKETS: tuple[tuple[str, int | None], ...] = (
    ("lt_100ms", 100), ("lt_500ms", 500), ("lt_1s", 1_000), ("lt_5s", 5_000),
    ("lt_15s", 15_000), ("lt_1min", 60_000), ("lt_5min", 300_000), ("lt_15min", 900_000),
    ("lt_1h", 3_600_000), ("ge_1h", None),
)  # fmt: skip
BOUNDS_MS: tuple[int, ...] = tuple(bound for _, bound in BUCKETS if bound is not None)
#: What a series can be split by, as the API's ``by`` names them.
DIMENSIONS = ("job_type", "queue", "tenant")
#: The other names a dimension is known by (the CLI's ``--type``, the rows' ``tenant_id``).
DIMENSION_ALIASES = {"type": "job_type", "tenant_id": "tenant"}
#: A read answers this many points per series at most.
MAX_POINTS = 1440
MINUTE, HOUR = 60, 3600
#: Longer ranges are read from the hourly rollups, in steps of whole hours.
MAX_MINUTE_RANGE = timedelta(days=1)


class StatsQueryInvalid(InvalidArgument):
    """A stats read the rollups cannot answer: the message names the parameter and the bound."""

    code = "STATS_QUERY_INVALID"


def bucket_of(ms: float) -> int:
    """The index of the bucket a duration of ``ms`` falls in (the SQL's ``width_bucket``)."""
    return bisect.bisect_right(BOUNDS_MS, ms)


def quantile(counts: Sequence[int], q: float, max_ms: float) -> float | None:
    """The ``q``-quantile (0..1) of durations counted in ``counts`` (one per bucket), by
    linear interpolation inside the bucket it falls in; the last bucket, which has no bound,
    ends at ``max_ms``, the slowest seen; and no estimate exceeds it. None when nothing was
    counted."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, n in enumerate(counts):
        if n and seen + n >= rank:
            low = BOUNDS_MS[i - 1] if i > 0 else 0
            high = BOUNDS_MS[i] if i < len(BOUNDS_MS) else max(max_ms, low)
            return min(low + (high - low) * (rank - seen) / n, max_ms)
        seen += n
    return max_ms


class Window(BaseModel):
    """A validated stats read: ``[since, until)`` in steps of ``step`` seconds, from the
    rollups of ``period`` seconds (60: minutes, 3600: hours), split by ``by``."""

    model_config = ConfigDict(frozen=True)

    since: datetime
    until: datetime
    step: int
    period: int
    by: tuple[str, ...]

    @property
    def points(self) -> int:
        return math.ceil((self.until - self.since).total_seconds() / self.step)


def window(
    *,
    since: datetime | None,
    until: datetime | None,
    step: int | None,
    by: Sequence[str],
    now: datetime,
) -> Window:
    """The read asked for, with its defaults (the last hour to ``now``, a step of a minute,
    or of an hour past a day), its range widened to whole steps; StatsQueryInvalid naming the
    first parameter the rollups cannot answer."""
    until = _aware(until, "to") if until is not None else now
    since = _aware(since, "from") if since is not None else until - timedelta(hours=1)
    if since >= until:
        raise StatsQueryInvalid(f"from ({since.isoformat()}) must be before to "
                                f"({until.isoformat()})")  # fmt: skip
    hourly = until - since > MAX_MINUTE_RANGE
    if step is None:
        step = HOUR if hourly else MINUTE
    if step < MINUTE or step % MINUTE:
        raise StatsQueryInvalid(f"step: {step} s is not a whole number of minutes (60, 300, ...)")
    if hourly and step % HOUR:
        raise StatsQueryInvalid(
            f"step: a range over {MAX_MINUTE_RANGE.days} day is read from the hourly rollups: "
            f"give a step of whole hours (3600, 86400, ...), not {step} s"
        )
    period = HOUR if step % HOUR == 0 else MINUTE
    since = _floor(since, period)
    until = since + math.ceil((until - since).total_seconds() / step) * timedelta(seconds=step)
    by = [DIMENSION_ALIASES.get(d, d) for d in by]
    unknown = [d for d in by if d not in DIMENSIONS]
    if unknown:
        raise StatsQueryInvalid(f"by: {', '.join(map(repr, unknown))} is not one of "
                                f"{', '.join(DIMENSIONS)} (or type)")  # fmt: skip
    chosen = Window(since=since, until=until, step=step, period=period,
                    by=tuple(d for d in DIMENSIONS if d in by))  # fmt: skip
    if chosen.points > MAX_POINTS:
        raise StatsQueryInvalid(
            f"step: {chosen.points} points of {step} s from {since.isoformat()} to "
            f"{until.isoformat()}; at most {MAX_POINTS}: give a longer step or a shorter range"
        )
    return chosen


def _aware(value: datetime, name: str) -> datetime:
    if value.tzinfo is None:
        raise StatsQueryInvalid(f"{name}: {value.isoformat()} has no time zone (add Z or +00:00)")
    return value.astimezone(UTC)


def _floor(value: datetime, seconds: int) -> datetime:
    epoch = math.floor(value.timestamp() / seconds) * seconds
    return datetime.fromtimestamp(epoch, UTC)


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, populate_by_name=True)


class Durations(_Model):
    """The durations of a point's jobs that ran (first claim to finish, in ms): how many, their
    mean, the slowest, and p50 / p95 estimated from the buckets."""

    count: int
    mean_ms: float | None
    max_ms: float | None
    p50_ms: float | None
    p95_ms: float | None

    @classmethod
    def of(cls, count: int, sum_ms: int, max_ms: int, buckets: Sequence[int]) -> Durations:
        if count == 0:
            return cls(count=0, mean_ms=None, max_ms=None, p50_ms=None, p95_ms=None)
        return cls(count=count, mean_ms=sum_ms / count, max_ms=float(max_ms),
                   p50_ms=quantile(buckets, 0.5, max_ms),
                   p95_ms=quantile(buckets, 0.95, max_ms))  # fmt: skip


class Point(_Model):
    """The jobs that finished in one step from ``at``: outcomes, retries by layer, durations.
    A job's retries are counted when it finishes."""

    at: datetime
    completed: int
    failed: int
    cancelled: int
    dead_lettered: int
    app_retries: int
    infra_retries: int
    durations: Durations
    #: The LLM calls of these jobs and their tokens (counted when each job finished).
    llm_calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_creation_tokens: int = 0
    #: The live output of these jobs (docs/output.md): its chunks, markers included, and the
    #: bytes of their bodies (counted when each job finished).
    output_chunks: int = 0
    output_bytes: int = 0

    @property
    def finished(self) -> int:
        return self.completed + self.failed + self.cancelled


class Series(_Model):
    """One group's points (``key``: the value of each dimension asked for; a tenant of null is
    no tenant's), steps with no finished job left out."""

    key: dict[str, str | None]
    points: list[Point]


class DepthPoint(_Model):
    """Jobs due and waiting to start, and running, as sampled at ``at`` (the step's start)."""

    at: datetime
    waiting: int
    running: int


class DepthSeries(_Model):
    key: dict[str, str | None]
    points: list[DepthPoint]


class Stats(_Model):
    """A stats read: the jobs finished per step and the queue depth per step, from the rollups;
    ``rolled_up_to``: the jobs finished before it are all counted (later steps may still grow)."""

    since: datetime = Field(alias="from")
    until: datetime = Field(alias="to")
    step: int
    by: tuple[str, ...]
    rolled_up_to: datetime | None
    jobs: list[Series]
    queue_depth: list[DepthSeries]


def stats(
    window: Window,
    jobs: Iterable[Mapping[str, Any]],
    depth: Iterable[Mapping[str, Any]],
    rolled_up_to: datetime | None,
) -> Stats:
    """The read's answer from the storage's rows (job_stats, queue_depth_stats: a group's rows
    together, in time order)."""
    series: dict[tuple[Any, ...], list[Point]] = {}
    for row in jobs:
        buckets = [int(n) for n in row["buckets"]]
        durations = Durations.of(int(row["timed"]), int(row["duration_ms_sum"]),
                                 int(row["duration_ms_max"]), buckets)  # fmt: skip
        series.setdefault(_key(window, row), []).append(Point(
            at=row["at"], completed=row["completed"], failed=row["failed"],
            cancelled=row["cancelled"], dead_lettered=row["dead_lettered"],
            app_retries=row["app_retries"], infra_retries=row["infra_retries"],
            durations=durations, llm_calls=row.get("llm_calls") or 0,
            input_tokens=row.get("input_tokens") or 0,
            output_tokens=row.get("output_tokens") or 0,
            cache_read_tokens=row.get("cache_read_tokens") or 0,
            cache_creation_tokens=row.get("cache_creation_tokens") or 0,
            output_chunks=row.get("output_chunks") or 0,
            output_bytes=row.get("output_bytes") or 0,
        ))  # fmt: skip
    depths: dict[tuple[Any, ...], list[DepthPoint]] = {}
    for row in depth:
        key = _key(window, row, among=("queue", "tenant"))
        depths.setdefault(key, []).append(
            DepthPoint(at=row["at"], waiting=row["waiting"], running=row["running"])
        )
    return Stats(
        since=window.since, until=window.until, step=window.step, by=window.by,
        rolled_up_to=rolled_up_to,
        jobs=[Series(key=dict(k), points=p) for k, p in series.items()],
        queue_depth=[DepthSeries(key=dict(k), points=p) for k, p in depths.items()],
    )  # fmt: skip


def _key(
    window: Window, row: Mapping[str, Any], among: Sequence[str] = DIMENSIONS
) -> tuple[tuple[str, str | None], ...]:
    return tuple((d, row[d] or None) for d in window.by if d in among)
