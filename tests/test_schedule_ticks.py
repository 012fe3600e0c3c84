"""Schedules without a database: which ticks are due (backfill, grace, clock changes), the
definition's refusals, and the crontab file in Graphile Worker's format."""

from __future__ import annotations

import itertools
import tomllib
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from croniter import croniter
from hypothesis import given, settings
from hypothesis import strategies as st

import retry_config
from orchestrator.domain import crontab
from orchestrator.domain.errors import ConfigError
from orchestrator.domain.schedules import (
    MAX_TICKS,
    ScheduleView,
    define,
    due_ticks,
    job_key,
    next_tick,
)

EXPRESSIONS = ["* * * * *", "*/7 * * * *", "0 * * * *", "30 2 * * *", "0 2 * * *",
               "15 1-3 * * 0", "*/30 * * * *", "0 0 1 * *", "*/5 * * * * 30", "0 7 * * 1-5"]  # fmt: skip
ZONES = ["UTC", "Europe/Paris", "America/New_York", "Australia/Lord_Howe", "Asia/Kolkata"]
#: Instants around both of 2026's clock changes in Europe and America.
INSTANTS = st.datetimes(
    min_value=datetime(2026, 3, 7), max_value=datetime(2026, 11, 3), timezones=st.just(UTC)
)


def options(cron: str, tz: str = "UTC", backfill: int = 0) -> retry_config.ScheduleConfig:
    return define("s", "t", cron=cron, tz=tz, backfill_seconds=backfill).options


def every_tick(cron: str, tz: str, after: datetime, until: datetime) -> list[datetime]:
    """croniter's own ticks in (after, until], as UTC instants (no repeat left out)."""
    it = croniter(cron, after.astimezone(ZoneInfo(tz)))
    found = []
    while (tick := it.get_next(datetime).astimezone(UTC)) <= until:
        found.append(tick)
    return found


@settings(max_examples=100, deadline=None)
@given(
    cron=st.sampled_from(EXPRESSIONS), tz=st.sampled_from(ZONES), after=INSTANTS,
    span=st.integers(0, 2 * 86_400), backfill=st.integers(0, 2 * 86_400),
    grace=st.integers(0, 600),
)  # fmt: skip
def test_due_ticks_are_the_expressions_ticks_within_the_window_oldest_first(
    cron: str, tz: str, after: datetime, span: int, backfill: int, grace: int
) -> None:
    now = after + timedelta(seconds=span)
    due = due_ticks(options(cron, tz, backfill), after=after, now=now, grace=grace)
    oldest = now - timedelta(seconds=max(backfill, grace))
    assert due == sorted(set(due))
    assert all(after < t <= now and t >= oldest for t in due)
    for tick in due:  # each one the expression names, read in the zone
        assert croniter.match(cron, tick.astimezone(ZoneInfo(tz)).replace(tzinfo=None))
    # none missing: every tick croniter gives in the window, but a repeated fixed local time
    expected = [t for t in every_tick(cron, tz, max(after, oldest - timedelta(seconds=1)), now)
                if t >= oldest][:MAX_TICKS]  # fmt: skip
    missing = set(expected) - set(due)
    assert all(t.astimezone(ZoneInfo(tz)).fold == 1 for t in missing)


@settings(max_examples=100, deadline=None)
@given(
    cron=st.sampled_from(EXPRESSIONS), tz=st.sampled_from(ZONES), after=INSTANTS,
    first=st.integers(0, 86_400), second=st.integers(0, 86_400),
)  # fmt: skip
def test_two_checks_fire_what_one_check_would_each_tick_once(
    cron: str, tz: str, after: datetime, first: int, second: int
) -> None:
    """A check moves the schedule to the last tick it fired; the next check starts there."""
    o = options(cron, tz, backfill=10 * 86_400)
    middle, end = after + timedelta(seconds=first), after + timedelta(seconds=first + second)
    one = due_ticks(o, after=after, now=middle, grace=0, limit=10**6)
    two = due_ticks(o, after=one[-1] if one else after, now=end, grace=0, limit=10**6)
    assert one + two == due_ticks(o, after=after, now=end, grace=0, limit=10**6)


def test_without_backfill_only_the_ticks_within_the_grace_run_after_downtime() -> None:
    every_minute = options("* * * * *")
    now = datetime(2026, 5, 1, 12, 0, 30, tzinfo=UTC)
    down_since = now - timedelta(hours=1)
    assert due_ticks(every_minute, after=down_since, now=now, grace=60) == [
        datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    ]
    assert due_ticks(every_minute, after=down_since, now=now, grace=0) == []
    filled = due_ticks(options("* * * * *", backfill=600), after=down_since, now=now, grace=60)
    assert filled == [datetime(2026, 5, 1, 11, m, tzinfo=UTC) for m in range(51, 60)] + [
        datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    ]
    # a tick exactly at the window's edge, and one exactly now, are due
    assert due_ticks(every_minute, after=down_since, now=now.replace(second=0), grace=60) == [
        datetime(2026, 5, 1, 11, 59, tzinfo=UTC), datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    ]  # fmt: skip
    # at most 1,000 at once by default (job-types.md says so), or `limit`, the oldest first
    hour_of_seconds = options("* * * * * *", backfill=3600)
    assert len(due_ticks(hour_of_seconds, after=down_since, now=now, grace=0)) == 1000
    assert len(due_ticks(options("* * * * * *", backfill=3600), after=down_since, now=now,
                         grace=0, limit=5)) == 5  # fmt: skip


def test_clock_changes_a_fixed_local_time_runs_once_an_interval_follows_elapsed_time() -> None:
    paris = "Europe/Paris"
    # spring: 02:30 does not exist on 29 March; it runs once, at the first instant after the gap
    spring = due_ticks(options("30 2 * * *", paris), after=datetime(2026, 3, 28, 12, tzinfo=UTC),
                       now=datetime(2026, 3, 30, 12, tzinfo=UTC), grace=10**6)  # fmt: skip
    assert spring == [datetime(2026, 3, 29, 1, 0, tzinfo=UTC),
                      datetime(2026, 3, 30, 0, 30, tzinfo=UTC)]  # fmt: skip
    # autumn: 02:30 happens twice on 25 October; the digest runs at the first
    autumn = due_ticks(options("30 2 * * *", paris), after=datetime(2026, 10, 24, 12, tzinfo=UTC),
                       now=datetime(2026, 10, 26, 12, tzinfo=UTC), grace=10**6)  # fmt: skip
    assert autumn == [datetime(2026, 10, 25, 0, 30, tzinfo=UTC),
                      datetime(2026, 10, 26, 1, 30, tzinfo=UTC)]  # fmt: skip
    # an interval keeps its pace through both repeated half hours
    half = due_ticks(options("*/30 * * * *", paris), after=datetime(2026, 10, 24, 23, tzinfo=UTC),
                     now=datetime(2026, 10, 25, 2, tzinfo=UTC), grace=10**6)  # fmt: skip
    assert [b - a for a, b in itertools.pairwise(half)] == [timedelta(minutes=30)] * 5


def test_the_next_tick_and_the_job_key_are_utc_instants() -> None:
    digest = options("0 7 * * *", "Europe/Paris")
    tick = next_tick(digest, datetime(2026, 1, 15, 6, 0, tzinfo=UTC))
    assert tick == datetime(2026, 1, 16, 6, 0, tzinfo=UTC)  # 07:00 in Paris, in winter
    paris = tick.astimezone(ZoneInfo("Europe/Paris"))
    assert job_key("digest", paris) == "schedule/digest/2026-01-16T06:00:00+00:00"
    view = ScheduleView.of({
        "name": "digest", "job_type": "digest", "cron": "0 7 * * *", "tz": "Europe/Paris",
        "tenant_id": None, "backfill_seconds": 0, "paused_at": None,
        "fire_after": datetime(2026, 1, 1, tzinfo=UTC), "now": datetime(2026, 1, 15, 6, tzinfo=UTC),
    })  # fmt: skip
    assert view.next_tick == tick and not view.paused


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"cron": "0 7 * *"}, "cron: malformed cron expression '0 7 * *': expected five fields"),
        ({"cron": "61 * * * *"}, "cron: malformed cron expression '61 * * * *'"),
        ({"cron": "0 0 30 2 *"}, "cron: cron expression '0 0 30 2 *' never fires"),
        ({"cron": "0 7 * * *", "tz": "Europe/Pariss"}, "tz: unknown time zone 'Europe/Pariss'"),
        ({"cron": "0 7 * * *", "backfill_seconds": -1}, "backfill_seconds: Input should be"),
        ({"cron": "0 7 * * *", "colour": "red"}, "colour: Extra inputs are not permitted"),
    ],
)
def test_a_malformed_schedule_is_refused_naming_what(
    options: dict[str, object], problem: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        define("digest", "digest", source="here", **options)  # type: ignore[arg-type]
    assert str(refused.value).startswith(f"here: schedule 'digest': {problem}")


def test_a_schedule_name_is_checked() -> None:
    with pytest.raises(ConfigError, match="schedule 'a b': a name is a letter"):
        define("a b", "t", cron="* * * * *")


def test_the_retry_config_declares_a_schedule_per_type_and_refuses_a_bad_one() -> None:
    path = Path("jobs.toml")
    table = '[job_types.digest.schedule]\ncron = "0 7 * * *"\ntz = "Europe/Paris"\n'
    config = retry_config.parse(tomllib.loads(table + 'payload = {team = "a"}\n'), path)
    assert config.schedules["digest"].payload == {"team": "a"}
    assert config.schedules["digest"].zone == ZoneInfo("Europe/Paris")
    for bad, problem in [
        (table.replace("0 7", "0 25"), "field 'schedule.cron': Value error, malformed cron"),
        (table.replace("Paris", "Parsi"), "field 'schedule.tz': Value error, unknown time zone"),
        ('[defaults.schedule]\ncron = "* * * * *"\n', "defaults: field 'schedule': set it per"),
    ]:
        with pytest.raises(ConfigError, match=problem):
            retry_config.parse(tomllib.loads(bad), path)


GRAPHILE = """
# Graphile Worker's crontab, as a team keeps it
0 7 * * 1-5 send_digest ?fill=1d2h&max=3&id=weekday_digest&queue=mail&priority=-2 {"team": "a"}
*/15 * * * * sync_accounts

30 2 * * * nightly ?tz=Europe/Paris&tenant=acme
"""


def test_a_graphile_crontab_reads_as_its_schedules() -> None:
    digest, sync, nightly = crontab.parse(GRAPHILE, "crontab")
    assert (digest.name, digest.job_type, digest.source) == ("weekday_digest", "send_digest",
                                                             "crontab:3")  # fmt: skip
    o = digest.options
    assert (o.cron, o.tz, o.backfill_seconds, o.max_retries, o.queue, o.priority, o.payload) == (
        "0 7 * * 1-5",
        "UTC",
        93_600,
        2,
        "mail",
        -2,
        {"team": "a"},
    )
    assert (sync.name, sync.job_type, sync.options.cron, sync.options.payload) == (
        "sync_accounts",
        "sync_accounts",
        "*/15 * * * *",
        None,
    )
    assert (nightly.options.tz, nightly.options.tenant_id) == ("Europe/Paris", "acme")


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("0 7 * * send_digest", "crontab:1: expected five time fields"),
        ("0 7 * * * 9digest", "crontab:1: not a task, ?options and {payload}: '9digest'"),
        ("0 77 * * * digest", "crontab:1: schedule 'digest': cron: malformed cron expression"),
        ("0 7 * * * digest ?tz=Mars/Base", "crontab:1: schedule 'digest': tz: unknown time zone"),
        ("0 7 * * * digest ?jobKey=k", "crontab:1: option 'jobKey' is not honoured: every run"),
        ("0 7 * * * digest ?jobKeyMode=replace", "crontab:1: option 'jobKeyMode' is not honoured"),
        ("0 7 * * * digest ?colour=red", "crontab:1: unknown option 'colour'; known: id, fill"),
        ("0 7 * * * digest ?fill=1y", "crontab:1: fill='1y' is not a time phrase"),
        ("0 7 * * * digest ?max=0", "crontab:1: max='0': a job makes at least one attempt"),
        ("0 7 * * * digest ?priority=high", "crontab:1: priority='high' is not a whole number"),
        ("0 7 * * * digest ?id=a&id=b", "crontab:1: option 'id' is given twice"),
        ("0 7 * * * digest ?fill", "crontab:1: options are not key=value"),
        ("0 7 * * * digest {team: 'a'}", "crontab:1: the payload is not JSON"),
    ],
)
def test_a_bad_crontab_line_is_refused_naming_its_line(line: str, problem: str) -> None:
    with pytest.raises(ConfigError) as refused:
        crontab.parse(line, "crontab")
    assert str(refused.value).startswith(problem)


def test_every_bad_line_of_a_crontab_is_reported_at_once() -> None:
    text = "0 7 * * * digest\n* * * * * digest\n0 25 * * * other\n"
    with pytest.raises(ConfigError) as refused:
        crontab.parse(text, "crontab")
    assert str(refused.value).splitlines() == [
        "crontab:2: schedule 'digest' is already on line 1: give one of them another ?id=",
        "crontab:3: schedule 'other': cron: malformed cron expression '0 25 * * *': expected "
        "five fields (minute hour day month weekday), or six with seconds last",
    ]
