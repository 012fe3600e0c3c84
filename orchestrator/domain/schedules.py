"""Schedules: a job type run by itself at each tick of a cron expression, in a time zone.

Pure: which ticks are due between two instants, the next one, a run's job key. Each tick is an
instant (UTC); croniter reads the expression in the schedule's zone, so a local time skipped by
a clock change in spring fires once, at the first instant after the gap. A local time that
occurs twice in autumn fires once, at its first occurrence, when the expression names its hours
(``30 2 * * *``), and at both when its hour field has a wildcard (``*/30 * * * *``: elapsed
time), as Vixie cron does.

Which missed ticks still run: every tick at most ``max(backfill, grace)`` late, oldest first;
older ones are skipped. ``grace`` is the fleet's tolerance for its own lateness (a process
woken late, a restart), ``backfill`` the schedule's window after downtime (Graphile Worker's
``backfillPeriod``), none by default.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from croniter import croniter
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrator.domain.errors import ConfigError
from retry_config import ScheduleConfig

#: A schedule's name: what its runs' job keys and the CLI's arguments carry.
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_:.-]{0,127}$")
#: Ticks fired for one schedule in one transaction at most; the rest at the next check, at once.
MAX_TICKS = 1000
#: The schedules' namespace of job keys: a run's key is ``schedule/<name>/<tick>``. Only the
#: scheduler submits such a key; any other submit naming one is refused (key_refusal), so no
#: submit can take a tick's job over before the tick fires.
KEY_PREFIX = "schedule/"


@dataclass(frozen=True)
class Schedule:
    name: str
    job_type: str
    options: ScheduleConfig
    #: Where it was defined, for errors (a file and line, a decorator).
    source: str = "code"

    def job_key(self, tick: datetime) -> str:
        return job_key(self.name, tick)


def define(name: str, job_type: str, *, source: str = "code", **options: Any) -> Schedule:
    """A checked schedule; ConfigError naming the schedule, its source and each problem."""
    if not NAME.match(name):
        raise ConfigError(
            f"{source}: schedule {name!r}: a name is a letter or _ followed by up to 127 "
            "letters, digits, _ : . -"
        )
    try:
        config = ScheduleConfig(**options)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors(include_url=False)
        )
        raise ConfigError(f"{source}: schedule {name!r}: {problems}") from None
    return Schedule(name=name, job_type=job_type, options=config, source=source)


def job_key(name: str, tick: datetime) -> str:
    """The job key of the run of ``name`` at ``tick``: the same in every process."""
    return f"{KEY_PREFIX}{name}/{tick.astimezone(UTC).isoformat()}"


def key_refusal(key: str) -> str | None:
    """Why a submit other than the scheduler's may not use the job key ``key``, or None."""
    if key.startswith(KEY_PREFIX):
        return (
            f"job key {key[:80]!r} is in the schedules' namespace ({KEY_PREFIX}<name>/<tick>): "
            "only the scheduler submits those keys; use another key"
        )
    return None


def due_ticks(
    options: ScheduleConfig,
    *,
    after: datetime,
    now: datetime,
    grace: float,
    limit: int = MAX_TICKS,
) -> list[datetime]:
    """The ticks in (``after``, ``now``] that still run: those at most ``max(backfill, grace)``
    seconds before ``now``, oldest first, at most ``limit`` of them (UTC)."""
    oldest = now - timedelta(seconds=max(options.backfill_seconds, grace))
    # ticks after ``after`` (exclusive), and from ``oldest`` on (inclusive)
    start = max(after, oldest - timedelta(microseconds=1))
    due: list[datetime] = []
    for tick in _ticks(options, start):
        if tick > now or len(due) >= limit:
            break
        due.append(tick)
    return due


def next_tick(options: ScheduleConfig, after: datetime) -> datetime:
    """The first tick after ``after`` (UTC)."""
    return next(_ticks(options, after))


def _ticks(options: ScheduleConfig, after: datetime) -> Iterator[datetime]:
    """Every tick after ``after``, in order, as UTC instants, the repeats of a fixed local time
    in autumn left out."""
    zone = options.zone
    fixed_hours = "*" not in options.cron.split()[1]
    it = croniter(options.cron, after.astimezone(zone))
    while True:
        tick: datetime = it.get_next(datetime)
        local = tick.astimezone(zone)
        if fixed_hours and local.fold and _ambiguous(local):
            continue
        yield tick.astimezone(UTC)


def _ambiguous(local: datetime) -> bool:
    """Whether this wall-clock time occurs twice in its zone (the hour repeated in autumn)."""
    return local.replace(fold=0).utcoffset() != local.replace(fold=1).utcoffset()


class ScheduleView(BaseModel):
    """A schedule as the listings show it (``orchestrator schedules``, the API, the dashboard)."""

    model_config = ConfigDict(frozen=True)

    name: str
    job_type: str
    cron: str
    tz: str
    tenant_id: str | None
    backfill_seconds: int
    paused: bool
    paused_at: datetime | None = None
    paused_by: str | None = None
    last_tick: datetime | None = Field(None, description="The latest tick fired.")
    last_job_id: UUID | None = Field(None, description="The job of the latest tick fired.")
    next_tick: datetime | None = Field(None, description="The next tick; none while paused.")

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> ScheduleView:
        """A stored schedule (its row, with the database's ``now``): its next tick after now,
        and after the last one it fired."""
        paused = row["paused_at"] is not None
        options = ScheduleConfig(cron=row["cron"], tz=row["tz"])
        after = max(row["now"], row["fire_after"])
        return cls(
            **{k: row[k] for k in cls.model_fields if k in row},
            paused=paused,
            next_tick=None if paused else next_tick(options, after),
        )

    @classmethod
    def defined(cls, schedule: Schedule, now: datetime) -> ScheduleView:
        """A schedule no process has stored yet: as it will start, due from ``now``."""
        o = schedule.options
        return cls.of(
            {
                "name": schedule.name, "job_type": schedule.job_type, "cron": o.cron,
                "tz": o.tz, "tenant_id": o.tenant_id, "backfill_seconds": o.backfill_seconds,
                "paused_at": None, "fire_after": now, "now": now,
            }
        )  # fmt: skip
