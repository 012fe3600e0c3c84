"""The checks of a schedule (``retry_config.models.ScheduleConfig``): when a job type runs by
itself, a cron expression in a time zone (the retry config's ``[job_types.<name>.schedule]``
table, ``@orc.job_type(..., cron=...)``, a crontab line).

The expression and the zone are checked here, where every form of a schedule is read, by the
libraries that will follow them (croniter, zoneinfo): a malformed one is refused when the
schedule is defined, naming it, never when its first tick would have come.
"""

from __future__ import annotations

from datetime import UTC, datetime
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterError, croniter

#: How a cron expression may look (croniter's forms).
CRON_FORMS = "five fields (minute hour day month weekday), or six with seconds last"


def zone(name: str) -> ZoneInfo:
    """The IANA time zone ``name``; ValueError naming it when there is none."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {name!r} (an IANA name, e.g. Europe/Paris)") from None


def check_cron(expression: str) -> str:
    """``expression`` if croniter can follow it and it ever fires; ValueError naming it."""
    if not croniter.is_valid(expression):
        raise ValueError(f"malformed cron expression {expression!r}: expected {CRON_FORMS}")
    try:
        croniter(expression, datetime(2000, 1, 1, tzinfo=UTC)).get_next(datetime)
    except CroniterError:
        raise ValueError(f"cron expression {expression!r} never fires") from None
    return expression
