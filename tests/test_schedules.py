"""Schedules on the real database: one job per tick with three worker processes, backfill after
a simulated downtime, pause and resume, the listings, each tenant's own, and a malformed
schedule refused wherever it is written."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import uuid4
from zoneinfo import ZoneInfo

import psycopg
import pytest
from pydantic import BaseModel

from orchestrator import JobContext, Orchestrator, Status
from orchestrator.domain.errors import ConfigError, ScheduleNotFound
from orchestrator.domain.schedules import MAX_TICKS
from tests.support.harness import BASE_CONFIG, ROOT, WorkerRun, wait_for
from tests.support.workers import WorkerProcess

MakeOrc = Callable[..., Orchestrator]


class Count(BaseModel):
    n: int


Db = psycopg.AsyncConnection[Any]


def app(make_orc: MakeOrc, **settings: Any) -> Orchestrator:
    """An application with a no-op job type ``noop``, unscheduled."""
    orc = make_orc(**settings)

    @orc.job_type("noop")
    async def noop(ctx: JobContext, payload: Any) -> None:
        return None

    return orc


async def runs(db: Db, name: str) -> list[tuple[str, datetime, str | None]]:
    """The jobs of schedule ``name``: their keys, due times and tenants, by due time."""
    cur = await db.execute(
        "SELECT job_key, run_at, tenant_id FROM orc_jobs WHERE job_key LIKE %s ORDER BY run_at",
        (f"schedule/{name}/%",),
    )
    return await cur.fetchall()


async def db_now(db: Db) -> datetime:
    cur = await db.execute("SELECT statement_timestamp()")
    row = await cur.fetchone()
    assert row is not None
    now: datetime = row[0]
    return now


async def test_three_worker_processes_submit_one_job_per_tick(dsn: str, db: Db) -> None:
    """A schedule every second, three real workers each running a scheduler: every tick from
    the first to the last has exactly one job, and each job runs as any other."""
    env = {"ORCHESTRATOR_RETRY_CONFIG": str(BASE_CONFIG)}
    with (
        WorkerProcess(dsn, "tests.support.schedules_app:orc", **env) as a,
        WorkerProcess(dsn, "tests.support.schedules_app:orc", **env) as b,
        WorkerProcess(dsn, "tests.support.schedules_app:orc", **env) as c,
    ):

        async def enough() -> bool:
            return len(await runs(db, "tick")) >= 8

        await wait_for(enough, timeout=60)
        for worker in (a, b, c):
            worker.signal(signal.SIGTERM)
        for worker in (a, b, c):
            assert worker.wait() == 0, worker.output()
    found = await runs(db, "tick")
    ticks = [run_at for _, run_at, _ in found]
    assert len({key for key, _, _ in found}) == len(found)  # one job per tick
    assert ticks == [ticks[0] + timedelta(seconds=n) for n in range(len(ticks))]  # none missed
    cur = await db.execute(
        "SELECT count(*) FROM orc_jobs WHERE job_type = 'tick' AND status = %s",
        (Status.COMPLETED.value,),
    )
    assert (await cur.fetchone()) == (len(found),)  # ordinary jobs, each run


async def test_schedulers_racing_for_the_same_ticks_fire_each_once(
    make_orc: MakeOrc, db: Db
) -> None:
    """Five schedulers (five pools, as five processes) check at the same instant after a
    downtime: each tick within the backfill has one job, and exactly one scheduler fired."""
    orcs = [app(make_orc) for _ in range(5)]
    for orc in orcs:
        orc.schedule("burst", "noop", cron="* * * * * *", backfill_seconds=30)
        await orc.open()
    schedulers = [orc.scheduler() for orc in orcs]
    await orcs[0].stores.schedules.sync(orcs[0].application, orcs[0].schedules.values())
    await db.execute("UPDATE orc_schedules SET fire_after = now() - interval '1 hour'")
    results = await asyncio.gather(*(s.run_once() for s in schedulers))
    assert sorted(r.fired > 0 for r in results) == [False] * 4 + [True]
    assert sum(r.lost for r in results) == 4
    found = await runs(db, "burst")
    assert len(found) == sum(r.fired for r in results) >= 30
    assert len({key for key, _, _ in found}) == len(found)


async def test_after_downtime_only_the_ticks_within_the_backfill_window_run(
    make_orc: MakeOrc, db: Db
) -> None:
    """Workers down for an hour: a schedule with a ten-minute backfill runs the ticks of the
    last ten minutes, oldest first; one without runs only the ticks within the grace; none of
    either runs again at the next check."""
    orc = app(make_orc, schedule_grace_seconds=90)
    orc.schedule("filled", "noop", cron="* * * * *", backfill_seconds=600)
    orc.schedule("unfilled", "noop", cron="* * * * *")
    await orc.open()
    scheduler = orc.scheduler()
    await orc.stores.schedules.sync(orc.application, orc.schedules.values())
    assert (await scheduler.run_once()).fired == 0  # just stored: nothing due yet
    await db.execute("UPDATE orc_schedules SET fire_after = now() - interval '1 hour'")
    before = await db_now(db)
    result = await scheduler.run_once()  # the same scheduler: its row moved, it looks again
    after = await db_now(db)
    minute = timedelta(minutes=1)
    for name, window in (("filled", timedelta(seconds=600)), ("unfilled", timedelta(seconds=90))):
        ticks = [run_at for _, run_at, _ in await runs(db, name)]
        assert ticks == [ticks[0] + n * minute for n in range(len(ticks))], name
        assert all(t.second == 0 and t.microsecond == 0 for t in ticks)
        # the latest due tick ran, and the earliest is the oldest within the window
        assert after - minute < ticks[-1] <= after
        assert ticks[0] >= before - window and ticks[0] - minute < after - window
    assert result.fired == len(await runs(db, "filled")) + len(await runs(db, "unfilled"))
    # it then sleeps until a millisecond past the next tick (the listing's), by the database's
    # clock: read at some instant between `before` and `after`
    next_tick = (await orc.list_schedules())[0].next_tick
    assert next_tick is not None and result.wait is not None
    assert (next_tick - after).total_seconds() + 0.001 <= result.wait
    assert result.wait <= (next_tick - before).total_seconds() + 0.001
    filled = {v.name: v for v in await orc.list_schedules()}["filled"]
    cur = await db.execute(
        "SELECT id FROM orc_jobs WHERE job_key = %s", ((await runs(db, "filled"))[-1][0],)
    )
    assert (await cur.fetchone()) == (filled.last_job_id,)  # the last tick's job
    before = await db_now(db)
    again = await scheduler.run_once()  # remembered: no cron arithmetic, the same wake-up
    after = await db_now(db)
    assert again.fired == 0 and again.wait is not None
    assert (next_tick - after).total_seconds() + 0.001 <= again.wait
    assert again.wait <= (next_tick - before).total_seconds() + 0.001


async def test_the_listing_shows_the_next_and_last_run_and_a_pause_holds_the_ticks(
    make_orc: MakeOrc, db: Db
) -> None:
    orc = app(make_orc, schedule_check_seconds=0.5)  # a resume is seen within half a second
    orc.schedule("digest", "noop", cron="0 7 * * *", tz="Europe/Paris")
    orc.schedule("often", "noop", cron="* * * * * *", tenant_id="acme")
    await orc.open()
    # before any process stored them: shown as they will start
    [digest, often] = await orc.list_schedules()
    assert (often.tenant_id, often.next_tick is not None) == ("acme", True)
    assert (digest.name, digest.last_tick, digest.paused) == ("digest", None, False)
    assert digest.next_tick is not None and digest.next_tick > datetime.now(UTC)
    paris = digest.next_tick.astimezone(ZoneInfo("Europe/Paris"))
    assert (paris.hour, paris.minute) == (7, 0)

    async with WorkerRun(orc):

        async def fired() -> bool:
            return len(await runs(db, "often")) >= 2

        await wait_for(fired)
        paused = await orc.pause_schedule("often", by="ops")
        assert (paused.paused, paused.paused_by, paused.next_tick) == (True, "ops", None)
        held = len(await runs(db, "often"))
        await asyncio.sleep(1.5)  # a tick or two come due while it is paused
        assert len(await runs(db, "often")) == held
        [view] = [v for v in await orc.list_schedules() if v.name == "often"]
        latest = (await runs(db, "often"))[-1]
        assert view.last_tick == latest[1] and view.paused
        cur = await db.execute("SELECT id FROM orc_jobs WHERE job_key = %s", (latest[0],))
        assert (await cur.fetchone()) == (view.last_job_id,)
        resumed = await orc.resume_schedule("often")
        assert not resumed.paused and resumed.next_tick is not None

        async def again() -> bool:
            return len(await runs(db, "often")) > held

        await wait_for(again)
    ticks = [run_at for _, run_at, _ in await runs(db, "often")]
    assert ticks[held] - ticks[held - 1] > timedelta(seconds=1)  # the paused ticks never ran
    assert {tenant for _, _, tenant in await runs(db, "often")} == {"acme"}


async def test_a_tenants_schedule_is_neither_seen_nor_paused_by_another(
    make_orc: MakeOrc, db: Db
) -> None:
    orc = app(make_orc)
    orc.schedule("theirs", "noop", cron="0 7 * * *", tenant_id="tenant-b")
    orc.schedule("mine", "noop", cron="0 7 * * *", tenant_id="tenant-a")
    orc.schedule("nobodys", "noop", cron="0 7 * * *")
    await orc.open()
    await orc.stores.schedules.sync(orc.application, orc.schedules.values())
    assert [v.name for v in await orc.list_schedules(tenants=["tenant-a"])] == ["mine"]
    assert len(await orc.list_schedules()) == 3
    for name in ("theirs", "nobodys", "unknown"):
        with pytest.raises(ScheduleNotFound, match=f"no schedule named '{name}'"):
            await orc.pause_schedule(name, by="attacker", tenants=["tenant-a"])
        with pytest.raises(ScheduleNotFound):
            await orc.resume_schedule(name, tenants=["tenant-a"])
    cur = await db.execute("SELECT count(*) FROM orc_schedules WHERE paused_at IS NOT NULL")
    assert (await cur.fetchone()) == (0,)
    assert (await orc.pause_schedule("mine", by="owner", tenants=["tenant-a"])).paused


def test_a_malformed_schedule_is_refused_at_definition(make_orc: MakeOrc, tmp_path: Path) -> None:
    """By the Python API, the decorator, the retry config and the crontab file, naming it."""
    orc = app(make_orc)
    with pytest.raises(
        ConfigError, match=r"^orc.schedule: schedule 'x': cron: malformed cron expression '7 \*'"
    ):
        orc.schedule("x", "noop", cron="7 *")
    with pytest.raises(ConfigError, match="job type 'digest': schedule 'digest': tz: unknown"):
        orc.job_type("digest", cron="0 7 * * *", tz="Europe/Nowhere")
    assert "digest" not in orc.job_types and "x" not in orc.schedules
    orc.schedule("x", "noop", cron="0 7 * * *")
    with pytest.raises(ConfigError, match="schedule 'x' is already defined"):
        orc.schedule("x", "noop", cron="0 8 * * *")
    orc.schedule("ghost", "nothing_of_the_kind", cron="0 7 * * *")
    with pytest.raises(ConfigError, match="schedule 'ghost': unknown job type"):
        orc.check_definition()

    config = tmp_path / "retry.toml"
    config.write_text('[job_types.noop.schedule]\ncron = "0 7 * * 8"\n')
    with pytest.raises(ConfigError, match=r"job type 'noop': field 'schedule\.cron'"):
        make_orc(retry_config=config)
    tab = tmp_path / "crontab"
    tab.write_text("0 7 * * * noop ?fill=forever\n")
    with pytest.raises(ConfigError, match="crontab:1: fill='forever' is not a time phrase"):
        make_orc(crontab=tab)


def cli(dsn: str, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "--app", "tests.support.schedules_app:orc", *argv],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
        env={**os.environ, "DATABASE_URL": dsn, "ORCHESTRATOR_RETRY_CONFIG": str(BASE_CONFIG),
             **env},
    )  # fmt: skip


def test_the_command_line_lists_pauses_and_resumes_and_refuses_without_a_traceback(
    dsn: str, db: Db, tmp_path: Path
) -> None:
    listed = cli(dsn, "schedules")
    assert listed.returncode == 0, listed.stderr
    [line] = listed.stdout.splitlines()
    assert line.startswith("tick ") and "* * * * * * (UTC)" in line and " next 20" in line
    assert "never run" in line
    paused = cli(dsn, "schedules", "pause", "tick", "--by", "ops")
    assert paused.returncode == 0 and "paused by ops (cli:" in paused.stdout
    assert "paused by ops" in cli(dsn, "schedules", "list").stdout
    assert " next 20" in cli(dsn, "schedules", "resume", "tick").stdout
    missing = cli(dsn, "schedules", "pause", "tock")
    assert (missing.returncode, missing.stdout, missing.stderr) == (
        2, "", "error: no schedule named 'tock'\n"
    )  # fmt: skip
    tab = tmp_path / "crontab"
    tab.write_text("# ours\n0 7 * * * tick ?id=morning\n0 7 * * 9 tick ?id=never\n")
    refused = cli(dsn, "schedules", ORCHESTRATOR_CRONTAB=str(tab))
    assert (refused.returncode, refused.stdout) == (2, "")
    assert refused.stderr == (
        f"error: {tab}:3: schedule 'never': cron: malformed cron expression '0 7 * * 9': expected "
        "five fields (minute hour day month weekday), or six with seconds last\n"
    )


async def test_a_pause_that_commits_between_the_read_and_the_firing_wins(
    make_orc: MakeOrc, db: Db
) -> None:
    """The compare-and-set refuses a paused schedule too, and a check skips one it reads paused
    (neither fired nor counted as lost)."""
    orc = app(make_orc)
    orc.schedule("held", "noop", cron="* * * * * *")
    await orc.open()
    await orc.stores.schedules.sync(orc.application, orc.schedules.values())
    await db.execute("UPDATE orc_schedules SET fire_after = now() - interval '5 seconds'")
    [state] = await orc.stores.schedules.states(["held"])
    await orc.pause_schedule("held", by="ops")
    async with orc.stores.queries.transaction() as conn:
        fired = await orc.stores.schedules.fire(
            "held", seen=state.fire_after, tick=state.now, job_id=uuid4(), conn=conn
        )
    assert not fired
    result = await orc.scheduler().run_once()
    assert (result.fired, result.lost, result.wait) == (0, 0, None)
    # nothing to wait for: a running scheduler sleeps its longest and checks again
    running = asyncio.create_task(orc.scheduler().run())
    await asyncio.sleep(0.3)
    assert not running.done()
    running.cancel()
    assert await runs(db, "held") == []
    # pausing again keeps who paused it first
    assert (await orc.pause_schedule("held", by="someone else")).paused_by == "ops"


async def test_a_long_backfill_is_fired_a_thousand_ticks_at_a_time_without_waiting(
    make_orc: MakeOrc, db: Db
) -> None:
    orc = app(make_orc)
    orc.schedule("dense", "noop", cron="* * * * * *", backfill_seconds=3600)
    await orc.open()
    await orc.stores.schedules.sync(orc.application, orc.schedules.values())
    await db.execute("UPDATE orc_schedules SET fire_after = now() - interval '2 hours'")
    first = await orc.scheduler().run_once()
    assert (first.fired, first.wait) == (MAX_TICKS, 0.0)  # the next check comes at once
    second = await orc.scheduler().run_once()
    assert second.fired == MAX_TICKS
    ticks = [run_at for _, run_at, _ in await runs(db, "dense")]
    assert ticks == [ticks[0] + timedelta(seconds=n) for n in range(2 * MAX_TICKS)]


async def test_definitions_are_written_only_where_new_or_changed(make_orc: MakeOrc, db: Db) -> None:
    """A process starting with the same definitions writes nothing; one with a new expression
    (a deploy) replaces the stored one and keeps where the schedule stands."""
    old, new = app(make_orc), app(make_orc)
    old.schedule("sync", "noop", cron="0 * * * *")
    new.schedule("sync", "noop", cron="*/30 * * * *", tz="Europe/Paris")
    await old.open()
    await new.open()
    query = "SELECT cron, tz, defined_at, fire_after, xmin::text FROM orc_schedules"
    await old.stores.schedules.sync(old.application, old.schedules.values())
    before = await (await db.execute(query)).fetchone()
    await old.stores.schedules.sync(old.application, old.schedules.values())
    assert await (await db.execute(query)).fetchone() == before  # not even rewritten
    await new.stores.schedules.sync(new.application, new.schedules.values())
    after = await (await db.execute(query)).fetchone()
    assert before is not None and after is not None
    assert after[:2] == ("*/30 * * * *", "Europe/Paris") and after[2] > before[2]
    assert after[3] == before[3]


async def test_a_scheduler_without_schedules_returns_at_once(make_orc: MakeOrc) -> None:
    orc = app(make_orc)
    await orc.open()
    await asyncio.wait_for(orc.scheduler().run(), timeout=1)


async def test_a_scheduler_rides_through_a_lost_connection(
    make_orc: MakeOrc, db: Db, caplog: pytest.LogCaptureFixture
) -> None:
    """Its connections killed under it, a scheduler logs a warning, checks again soon, and
    fires the ticks it missed meanwhile (within the grace): none is lost."""
    orc = app(make_orc, schedule_check_seconds=0.2)
    orc.schedule("steady", "noop", cron="* * * * * *")
    await orc.open()
    running = asyncio.create_task(orc.scheduler().run())
    try:
        await wait_for(lambda: _count(db, "steady", 1))
        with caplog.at_level(logging.INFO, logger="orchestrator.services.scheduler"):

            async def warned() -> bool:
                await db.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
                await asyncio.sleep(0.3)
                return "checking again in 0.2 s" in caplog.text

            await wait_for(warned, timeout=20)
            ticks = len(await runs(db, "steady"))
            await wait_for(lambda: _count(db, "steady", ticks + 2))
    finally:
        running.cancel()
    found = [run_at for _, run_at, _ in await runs(db, "steady")]
    assert found == [found[0] + timedelta(seconds=n) for n in range(len(found))]
    assert "schedules: scheduled runs submitted: 1" in caplog.text  # a line per firing


@pytest.mark.logs_errors("schedules: the check failed")
async def test_a_check_that_fails_is_logged_and_tried_again(
    make_orc: MakeOrc, caplog: pytest.LogCaptureFixture
) -> None:
    """A run its type refuses (here a payload that does not fit, on an application whose
    definition nobody checked) fails the check, which is logged as an error and tried again."""
    orc = app(make_orc, schedule_check_seconds=0.2)

    @orc.job_type("counted")
    async def counted(ctx: JobContext, payload: Count) -> None:
        return None

    orc.schedule("broken", "counted", cron="* * * * * *", payload={"n": "many"})
    await orc.open()
    with caplog.at_level(logging.ERROR, logger="orchestrator.services.scheduler"):
        running = asyncio.create_task(orc.scheduler().run())

        async def failed_twice() -> bool:
            return caplog.text.count("schedules: the check failed") >= 2

        await wait_for(failed_twice, timeout=10)
        assert not running.done()
        running.cancel()
    with pytest.raises(ConfigError, match=r"orc\.schedule: schedule 'broken': invalid payload"):
        orc.check_definition()  # what a worker or serve would have said before starting


async def _count(db: Db, name: str, at_least: int) -> bool:
    return len(await runs(db, name)) >= at_least


async def test_a_paused_schedule_holds_only_itself(make_orc: MakeOrc, db: Db) -> None:
    orc = app(make_orc)
    orc.schedule("a_held", "noop", cron="* * * * * *")
    orc.schedule("b_going", "noop", cron="* * * * * *")
    await orc.open()
    await orc.stores.schedules.sync(orc.application, orc.schedules.values())
    await orc.pause_schedule("a_held", by="ops")
    await db.execute("UPDATE orc_schedules SET fire_after = now() - interval '3 seconds'")
    assert (await orc.scheduler().run_once()).fired >= 3
    assert await runs(db, "a_held") == [] and len(await runs(db, "b_going")) >= 3
