"""History kept as rollups (migration 0026, orchestrator/services/rollup.py): on the real
database, the rollups equal what the jobs they summarise say, recomputed here from the jobs
(real jobs run through both retry layers, and random mixes written as rows), the jobs' live
output included; a second run changes nothing; they stay when the jobs are deleted; the stats
read answers from them alone, each tenant its own numbers only. The pure part (buckets,
percentiles, the read's bounds) is tested against its rules, with hypothesis."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID, uuid4

import httpx
import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st
from psycopg.rows import dict_row

from orchestrator import JobContext, Orchestrator, RetryLater
from orchestrator.domain.principals import Scope
from orchestrator.domain.rollups import (
    BOUNDS_MS,
    BUCKETS,
    MAX_POINTS,
    StatsQueryInvalid,
    bucket_of,
    quantile,
    window,
)
from orchestrator.services.retention import RetentionResult
from tests.support import log_guard, scripted
from tests.support.api_server import ApiServer, token
from tests.support.harness import WorkerRun, config_with, wait_for

NOW = datetime(2026, 3, 1, 12, 0, 30, tzinfo=UTC)
COUNTED = ("completed", "failed", "cancelled", "dead_lettered", "app_retries", "infra_retries",
           "timed", "duration_ms_sum", "duration_ms_max", *(name for name, _ in BUCKETS))  # fmt: skip
Group = tuple[datetime, str, str, str]


# -- the pure part --------------------------------------------------------------------------------


@given(st.floats(min_value=0, max_value=10**8, allow_nan=False))
def test_a_duration_falls_in_the_one_bucket_whose_bounds_hold_it(ms: float) -> None:
    i = bucket_of(ms)
    assert i == 0 or BOUNDS_MS[i - 1] <= ms
    assert i == len(BOUNDS_MS) or ms < BOUNDS_MS[i]


@given(
    st.lists(st.integers(0, 50), min_size=len(BUCKETS), max_size=len(BUCKETS)),
    st.floats(0, 1),
    st.floats(0, 1),
)
def test_a_quantile_stays_in_its_bucket_below_the_slowest_and_grows_with_q(
    counts: list[int], q1: float, q2: float
) -> None:
    last = max((i for i, n in enumerate(counts) if n), default=None)
    if last is None:
        assert quantile(counts, q1, 0) is None
        return
    slowest = BOUNDS_MS[last] - 1 if last < len(BOUNDS_MS) else BOUNDS_MS[-1] * 3
    low, high = sorted((q1, q2))
    a, b = quantile(counts, low, slowest), quantile(counts, high, slowest)
    assert a is not None and b is not None
    assert 0 <= a <= b <= slowest
    first = min(i for i, n in enumerate(counts) if n)
    assert a >= (BOUNDS_MS[first - 1] if first else 0)


def test_a_quantile_of_one_bucket_interpolates_inside_it() -> None:
    counts = [0, 10, *([0] * (len(BUCKETS) - 2))]  # ten jobs of 100 to 500 ms
    assert quantile(counts, 0.5, 480) == 300
    assert quantile(counts, 0.95, 480) == 480  # 480 by interpolation: the slowest caps it


def test_a_read_s_defaults_are_the_last_hour_by_minute() -> None:
    read = window(since=None, until=None, step=None, by=[], now=NOW)
    assert (read.since, read.until) == (datetime(2026, 3, 1, 11, 0, tzinfo=UTC),
                                        datetime(2026, 3, 1, 12, 1, tzinfo=UTC))  # fmt: skip
    assert (read.step, read.period, read.points) == (60, 60, 61)
    day = window(since=NOW - timedelta(days=3), until=NOW, step=None, by=["tenant"], now=NOW)
    assert (day.step, day.period, day.by) == (3600, 3600, ("tenant",))


@pytest.mark.parametrize(
    ("asked", "named"),
    [
        ({"since": NOW, "until": NOW}, "must be before"),
        ({"since": NOW.replace(tzinfo=None)}, "from: "),
        ({"until": NOW.replace(tzinfo=None)}, "to: "),
        ({"step": 90}, "step: 90 s is not a whole number of minutes"),
        ({"step": 0}, "step: 0 s"),
        ({"since": NOW - timedelta(days=2), "step": 300}, "give a step of whole hours"),
        ({"since": NOW - timedelta(days=400), "step": 3600}, f"at most {MAX_POINTS}"),
        ({"by": ["tenant", "colour"]}, "by: 'colour' is not one of job_type, queue, tenant"),
    ],
)
def test_a_read_the_rollups_cannot_answer_is_refused_naming_why(
    asked: dict[str, Any], named: str
) -> None:
    args: dict[str, Any] = {"since": None, "until": None, "step": None, "by": [], **asked}
    with pytest.raises(StatsQueryInvalid, match=named):
        window(**args, now=NOW)


async def test_the_buckets_are_the_table_s_columns_and_the_sql_s_buckets(
    db: psycopg.AsyncConnection[Any],
) -> None:
    cur = await db.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name = 'orc_job_rollups'"
        " ORDER BY ordinal_position"
    )
    columns = [r[0] for r in await cur.fetchall()]
    first = columns.index(BUCKETS[0][0])  # the buckets, in order (0030 added columns after)
    assert columns[first : first + len(BUCKETS)] == [name for name, _ in BUCKETS]
    values = sorted({0, 1, 99, 3_599_999, 10**9} | set(BOUNDS_MS)
                    | {b - 1 for b in BOUNDS_MS} | {b + 1 for b in BOUNDS_MS})  # fmt: skip
    cur = await db.execute(
        "SELECT width_bucket(v, %s::bigint[]) FROM unnest(%s::bigint[]) AS v",
        (list(BOUNDS_MS), values),
    )
    assert [r[0] for r in await cur.fetchall()] == [bucket_of(v) for v in values]


# -- rollups of real jobs ---------------------------------------------------------------------


async def expected_of(orc: Orchestrator, job_ids: list[UUID]) -> dict[Group, Counter[str]]:
    """The rollups recomputed from the jobs as the Orchestrator reads them (rows, events,
    dead letters), by the rule docs/operations.md states."""
    letters = {d.job_id for d in await orc.dead_letters(limit=500)}
    groups: dict[Group, Counter[str]] = defaultdict(Counter)
    for job_id in job_ids:
        job = await orc.get_job(job_id)
        assert job.finished_at is not None
        minute = job.finished_at.replace(second=0, microsecond=0)
        layers = Counter(e.payload.get("layer") for e in await orc.job_events(job_id)
                         if e.kind == "job.retry_scheduled")  # fmt: skip
        ms = None
        if job.started_at is not None:
            ms = round((job.finished_at - job.started_at).total_seconds() * 1000)
        add(groups[minute, job.job_type, job.queue, job.tenant_id or ""],
            job.status.value, job_id in letters, layers["app"], layers["infra"], ms)  # fmt: skip
    return groups


def add(
    counts: Counter[str], status: str, lettered: bool, app: int, infra: int, ms: int | None
) -> None:
    counts[status.lower()] += 1
    counts["dead_lettered"] += lettered
    counts["app_retries"] += app
    counts["infra_retries"] += infra
    if ms is not None:
        counts["timed"] += 1
        counts["duration_ms_sum"] += ms
        counts["duration_ms_max"] = max(counts["duration_ms_max"], ms)
        counts[BUCKETS[bucket_of(ms)][0]] += 1


async def rollups(db: psycopg.AsyncConnection[Any], period: int = 60) -> dict[Group, Counter[str]]:
    cur = db.cursor(row_factory=dict_row)
    await cur.execute("SELECT * FROM orc_job_rollups WHERE period = %s", (period,))
    return {
        (r["at"], r["job_type"], r["queue"], r["tenant"]): Counter(
            {k: r[k] for k in COUNTED if r[k]}
        )
        for r in await cur.fetchall()
    }


async def back_in_time(db: psycopg.AsyncConnection[Any], minutes: int) -> None:
    """Every job finished ``minutes`` earlier than it did (its minute closed), by hand: the
    guard refuses a change to a finished job, so triggers are off for this statement."""
    await db.execute("SET session_replication_role = replica")
    await db.execute(
        "UPDATE orc_jobs SET finished_at = finished_at - make_interval(mins => %(m)s),"
        " started_at = started_at - make_interval(mins => %(m)s), created_at = created_at -"
        " make_interval(mins => %(m)s) WHERE finished_at IS NOT NULL",
        {"m": minutes},
    )
    await db.execute("SET session_replication_role = origin")


@log_guard.fails_jobs("HTTP_400", "HTTP_429", "ECONNRESET")
async def test_real_jobs_of_both_retry_layers_roll_up_to_what_they_say(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = make_orc(retry_config=config_with(scripted.TABLE), rollup_settle_seconds=0)
    scripted.register(orc)
    scripts = [["ok"], ["app", "ok"], ["infra", "ok"], ["app", "infra", "ok"], ["permanent"]]
    async with WorkerRun(orc):
        jobs = [await orc.submit("scripted", {"script": s}, tenant_id=tenant)
                for s in scripts for tenant in ("acme", None)]  # fmt: skip
        cancelled = await orc.submit("scripted", {"script": ["ok"]}, run_at=NOW.replace(year=2099))
        await orc.cancel(cancelled, reason="not needed", by="test")

        async def all_finished() -> bool:
            # the waits of both layers, fast-forwarded
            await db.execute("UPDATE procrastinate_jobs SET scheduled_at = now() "
                             "WHERE status = 'todo' AND scheduled_at > now()")  # fmt: skip
            return all([(await orc.get_job(j)).finished_at is not None for j in jobs])

        await wait_for(all_finished, timeout=60, interval=0.2)
    jobs.append(cancelled)
    await back_in_time(db, 5)
    # the worker's own rollup_jobs tick may have run meanwhile: start the rollups afresh
    await db.execute("TRUNCATE orc_job_rollups")
    await db.execute("UPDATE orc_rollup_watermark SET rolled_up_to = NULL")
    result = await orc.maintenance.rollup.run_once()
    assert result.jobs == len(jobs)
    expected = await expected_of(orc, jobs)
    assert await rollups(db) == expected
    totals = sum(expected.values(), Counter())
    assert (totals["completed"], totals["failed"], totals["cancelled"]) == (8, 2, 1)
    assert (totals["app_retries"], totals["infra_retries"], totals["dead_lettered"]) == (4, 4, 2)
    assert totals["timed"] == 10  # the cancelled job never ran


# -- rollups of random mixes, rerun, and after the jobs are gone --------------------------------

TYPES, QUEUES, TENANTS = ("digest", "sync"), ("default", "bulk"), ("acme", "globex", None)
#: Durations on and around the buckets' bounds, and far past the last.
DURATIONS = [0, 1, 99, 100, 101, 499, 500, 1_000, 14_999, 60_000, 3_599_999, 3_600_000, 9 * 10**6]


async def write_mix(db: psycopg.AsyncConnection[Any], rng: random.Random, n: int) -> None:
    """``n`` jobs as rows, finished over the last three hours (and some unfinished), with retry
    events of both layers, other events that name a layer, and dead letters."""
    base = (datetime.now(UTC) - timedelta(hours=3)).replace(second=0, microsecond=0)
    for _ in range(n):
        job_id = uuid4()
        status = rng.choice(["COMPLETED", "COMPLETED", "FAILED", "CANCELLED", "PENDING"])
        finished = base + timedelta(milliseconds=rng.randrange(3 * 3600 * 1000))
        ms = rng.choice([*DURATIONS, None]) if status != "PENDING" else None
        started = finished - timedelta(milliseconds=ms) if ms is not None else None
        await db.execute(
            "INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts,"
            " max_retries, trace_id, tenant_id, started_at, finished_at)"
            " VALUES (%s, %s, %s, 'null', %s, 3, 3, 't', %s, %s, %s)",
            (job_id, rng.choice(TYPES), status, rng.choice(QUEUES), rng.choice(TENANTS), started,
             finished if status != "PENDING" else None),
        )  # fmt: skip
        for layer in rng.choices(["app", "infra"], k=rng.randrange(4)):
            for kind in ("job.failed", "job.retry_scheduled"):  # only the second is a retry
                await db.execute(
                    "INSERT INTO orc_job_events (job_id, kind, payload) VALUES (%s, %s, %s)",
                    (job_id, kind, psycopg.types.json.Jsonb({"layer": layer, "terminal": False})),
                )
        if status != "PENDING" and rng.random() < 0.3:
            await db.execute(
                "INSERT INTO orc_dead_letters (id, job_id, job_type, payload, error)"
                " VALUES (%s, %s, 'x', 'null', '{}')",
                (uuid4(), job_id),
            )


async def expected_from_rows(db: psycopg.AsyncConnection[Any]) -> dict[Group, Counter[str]]:
    """The rollups recomputed from the rows, in Python, up to the watermark."""
    cur = db.cursor(row_factory=dict_row)
    await cur.execute("SELECT orc_rolled_up_to_v1() AS mark")
    mark = (await cur.fetchone() or {})["mark"]
    await cur.execute(
        "SELECT j.*, EXISTS (SELECT 1 FROM orc_dead_letters d WHERE d.job_id = j.id) AS lettered,"
        " (SELECT array_agg(e.payload ->> 'layer') FROM orc_job_events e"
        "   WHERE e.job_id = j.id AND e.kind = 'job.retry_scheduled') AS layers"
        " FROM orc_jobs j WHERE finished_at < %s",
        (mark,),
    )
    groups: dict[Group, Counter[str]] = defaultdict(Counter)
    for j in await cur.fetchall():
        layers = Counter(j["layers"] or [])
        ms = None
        if j["started_at"] is not None:
            ms = round((j["finished_at"] - j["started_at"]).total_seconds() * 1000)
        key = (j["finished_at"].replace(second=0, microsecond=0), j["job_type"], j["queue"],
               j["tenant_id"] or "")  # fmt: skip
        add(groups[key], j["status"], j["lettered"], layers["app"], layers["infra"], ms)
    return groups


def hours_of(minutes: dict[Group, Counter[str]]) -> dict[Group, Counter[str]]:
    """The minutes summed per hour (the slowest: the slowest of its minutes)."""
    hours: dict[Group, Counter[str]] = defaultdict(Counter)
    for (at, job_type, queue, tenant), counts in minutes.items():
        hour = hours[at.replace(minute=0), job_type, queue, tenant]
        slowest = max(hour["duration_ms_max"], counts["duration_ms_max"])
        hour.update(counts)
        hour["duration_ms_max"] = slowest
    return hours


@pytest.mark.parametrize("seed", range(4))
async def test_random_mixes_roll_up_to_their_jobs_once_and_outlive_them(
    seed: int, make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    rng = random.Random(seed)
    await write_mix(db, rng, 150)
    orc = make_orc(rollup_settle_seconds=0, rollup_batch_minutes=rng.choice([1, 7, 30]))
    async with orc:
        rollup = orc.maintenance.rollup
        while (await rollup.run_once()).minutes:  # a batch of one minute takes several runs
            pass
        mark = await orc.stores.rollups.rolled_up_to()
        assert mark is not None and mark <= datetime.now(UTC)
        expected = await expected_from_rows(db)
        assert sum(c["completed"] + c["failed"] + c["cancelled"] for c in expected.values()) > 100
        minutes, hours = await rollups(db), await rollups(db, 3600)
        assert minutes == expected
        assert hours == hours_of(expected)
        read = await orc.stats(since=mark - timedelta(hours=4), until=mark, step=3600)
        assert sum(p.finished for s in read.jobs for p in s.points) == sum(
            c["completed"] + c["failed"] + c["cancelled"] for c in expected.values()
        )

        # the same minutes rolled up again (a run that died after its commit): the same rows
        await db.execute("UPDATE orc_rollup_watermark SET rolled_up_to = NULL")
        while (await rollup.run_once()).minutes:
            pass
        assert await rollups(db) == minutes and await rollups(db, 3600) == hours

        # the jobs deleted (retention): the history stays, and a run adds nothing
        await db.execute("DELETE FROM orc_jobs")
        await rollup.run_once()
        assert await rollups(db) == minutes and await rollups(db, 3600) == hours
        again = await orc.stats(since=mark - timedelta(hours=4), until=mark, step=3600)
        assert again.jobs == read.jobs


async def test_a_minute_is_rolled_up_once_it_has_settled(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    await db.execute(
        "INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts, max_retries,"
        " trace_id, finished_at) VALUES (%s, 'x', 'COMPLETED', 'null', 'q', 3, 3, 't',"
        " now() - interval '10 minutes')",
        (uuid4(),),
    )
    orc = make_orc(rollup_settle_seconds=3600)  # its minute ended less than that ago
    async with orc:
        rollup = orc.maintenance.rollup
        quiet = await rollup.run_once()
        assert (quiet.jobs, quiet.handled) == (0, 0)  # nothing to say in the log
        assert await rollups(db) == {}
        cur = await db.execute("SELECT date_trunc('minute', min(finished_at)) FROM orc_jobs")
        start = (await cur.fetchone() or [None])[0]
        assert await orc.stores.rollups.rolled_up_to() == start  # where history starts
        rollup.settle_seconds = 0
        rollup.batch_minutes = 2
        caught_up = await rollup.run_once()  # ten minutes to roll up, in batches of two
        assert (caught_up.jobs, caught_up.minutes) == (1, caught_up.handled) and caught_up.behind
        assert (await rollup.run_once()).jobs == 0
        assert sum(c["completed"] for c in (await rollups(db)).values()) == 1


async def test_two_runs_at_once_take_turns_and_count_each_job_once(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    await write_mix(db, random.Random(3), 60)
    orc = make_orc(rollup_settle_seconds=0, rollup_batch_minutes=1440)
    async with orc:
        first, second = await asyncio.gather(
            orc.maintenance.rollup.run_once(), orc.maintenance.rollup.run_once()
        )
        expected = await expected_from_rows(db)
        finished = sum(c["completed"] + c["failed"] + c["cancelled"] for c in expected.values())
        assert sorted([first.jobs, second.jobs]) == [0, finished]
        assert await rollups(db) == expected


async def test_rows_past_their_retention_are_deleted_and_the_rest_kept(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    for period, days in ((60, 2), (60, 0.5), (3600, 5), (3600, 2)):
        await db.execute(
            "INSERT INTO orc_job_rollups SELECT %s, date_trunc('hour', now())"
            " - make_interval(secs => %s * 86400), 'x', 'q', '', 1, 0, 0, 0, 0, 0, 0, 0, 0,"
            " 0, 0, 0, 0, 0, 0, 0, 0, 0, 0",
            (period, days),
        )
    for days in (2, 0.5):
        await db.execute(
            "INSERT INTO orc_queue_depth VALUES (date_trunc('minute', now())"
            " - make_interval(secs => %s * 86400), 'q', '', 1, 0)",
            (days,),
        )
    orc = make_orc(rollup_retention_days=1, rollup_hourly_retention_days=3)
    async with orc:
        assert (await orc.maintenance.rollup.run_once()).pruned == 3
    cur = await db.execute(
        "SELECT period, round(extract(epoch FROM now() - at) / 86400, 1) FROM orc_job_rollups"
    )
    kept = {(p, float(d)) for p, d in await cur.fetchall()}
    assert {(p, round(d)) for p, d in kept} == {(60, 0), (3600, 2)}
    cur = await db.execute("SELECT count(*) FROM orc_queue_depth")
    assert (await cur.fetchone() or [0])[0] == 1


async def test_the_queue_depth_is_sampled_per_queue_and_tenant(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = make_orc()
    orc.job_type("noop")(_noop)
    async with orc:
        for tenant in ("acme", "acme", "globex"):
            await orc.submit("noop", tenant_id=tenant, queue="bulk")
        later = datetime.now(UTC) + timedelta(hours=1)
        await orc.submit("noop", tenant_id="acme", queue="bulk", run_at=later)  # not due
        assert (await orc.maintenance.rollup.run_once()).depth_rows == 2
        read = await orc.stats(by=["queue", "tenant"])
        depth = {tuple(s.key.values()): [(p.waiting, p.running) for p in s.points]
                 for s in read.queue_depth}  # fmt: skip
        assert depth == {("bulk", "acme"): [(2, 0)], ("bulk", "globex"): [(1, 0)]}
        mine = await orc.stats(by=["tenant"], tenants=["globex"])
        assert [s.key for s in mine.queue_depth] == [{"tenant": "globex"}]


async def _noop(ctx: object, payload: None) -> None:
    return None


async def test_a_jobs_output_is_rolled_up_with_it_and_outlives_it(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    """A job's live output (docs/output.md) is counted in the minute it finished: its chunks,
    markers included, and its bodies' bytes; retention then deletes the output with the job and
    the counts stay."""
    orc = make_orc(rollup_settle_seconds=0, job_retention_days=0, retention_cron="0 0 1 1 *")

    @orc.job_type("talker")
    async def talker(ctx: JobContext, payload: dict[str, Any]) -> str:
        ctx.output.text(payload["text"])
        if payload.get("fail_once") and ctx.attempt == 1:
            raise RetryLater(0, "once more")  # its output superseded by a marker
        ctx.output.progress({"done": True})
        return "ok"

    orc.job_type("quiet")(_noop)  # streams nothing: no output head, counted as none
    async with WorkerRun(orc) as worker:
        jobs = [
            await orc.submit("talker", {"text": "héllo"}, tenant_id="acme"),
            await orc.submit("talker", {"text": "again", "fail_once": True}, tenant_id="acme"),
            await orc.submit("talker", {"text": "x" * 40}, tenant_id="globex"),
            await orc.submit("quiet", tenant_id="acme"),
        ]
        await worker.until_finished(*jobs)
    expected: dict[str, Counter[str]] = defaultdict(Counter)
    for job_id in jobs:
        job, chunks = await orc.get_job(job_id), await orc.stores.output.read(job_id)
        tenant = expected[job.tenant_id or ""]
        tenant["output_chunks"] += len(chunks)
        tenant["output_bytes"] += sum(  # the bodies as jsonb writes them, markers not counted
            len(json.dumps(c.body, ensure_ascii=False).encode())
            for c in chunks if c.kind in ("text", "progress")
        )  # fmt: skip
    # acme: (text, progress), then (text, marker, text, progress) of the job that retried
    assert expected["acme"]["output_chunks"] == 6
    await back_in_time(db, 5)
    await db.execute("TRUNCATE orc_job_rollups")  # the worker's own tick may have run
    await db.execute("UPDATE orc_rollup_watermark SET rolled_up_to = NULL")
    since = datetime.now(UTC) - timedelta(hours=1)

    def totals(read: Any) -> dict[str, Counter[str]]:
        return {
            s.key["tenant"]: Counter({"output_chunks": sum(p.output_chunks for p in s.points),
                                      "output_bytes": sum(p.output_bytes for p in s.points)})
            for s in read.jobs
        }  # fmt: skip

    async with orc:
        while (await orc.maintenance.rollup.run_once()).minutes:
            pass
        counted = await orc.stats(since=since, step=60, by=["tenant"])
        assert totals(counted) == expected
        hours = await orc.stats(since=since.replace(minute=0, second=0, microsecond=0),
                                step=3600, by=["tenant"])  # fmt: skip
        assert totals(hours) == expected
        pruned = await orc.maintenance.run("prune_finished")
        assert isinstance(pruned, RetentionResult) and pruned.jobs == 4
        assert pruned.output_chunks == sum(t["output_chunks"] for t in expected.values())
        for table in ("orc_job_output", "orc_job_output_heads"):
            cur = await db.execute(f"SELECT count(*) FROM {table}")
            assert (await cur.fetchone() or [0])[0] == 0, table
        assert totals(await orc.stats(since=since, step=60, by=["tenant"])) == expected


# -- the stats API: bounds, and each tenant its own numbers ----------------------------------------


@pytest.fixture(scope="module")
def server(dsn: str) -> Iterator[ApiServer]:
    with ApiServer(dsn) as running:
        yield running


async def test_the_api_answers_each_tenant_with_its_own_numbers_only(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any], server: ApiServer
) -> None:
    await write_mix(db, random.Random(11), 120)
    orc = make_orc(rollup_settle_seconds=0)
    async with orc:
        while (await orc.maintenance.rollup.run_once()).minutes:
            pass
        expected = await expected_from_rows(db)
        everyone = await token(orc.stores.tokens, "stats-all", Scope.READ)
        acme = await token(orc.stores.tokens, "stats-acme", Scope.READ, tenants=["acme"])
    since = (datetime.now(UTC) - timedelta(hours=4)).isoformat()
    query = {"from": since, "step": "3600", "by": "tenant,queue,job_type"}
    finished: dict[str, Counter[str]] = defaultdict(Counter)
    for (_, _, _, tenant), counts in expected.items():
        finished[tenant]["finished"] += counts["completed"] + counts["failed"] + counts["cancelled"]
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        answers = {}
        for name, secret in (("all", everyone), ("acme", acme)):
            answer = await client.get(
                "/api/v1/stats", params=query, headers={"Authorization": f"Bearer {secret}"}
            )
            assert answer.status_code == 200, answer.text
            answers[name] = answer.json()
            # the other tenants' names appear nowhere in a tenant-limited answer
        assert "globex" not in json.dumps(answers["acme"])
        seen: dict[str, Counter[str]] = defaultdict(Counter)
        for name, body in answers.items():
            for series in body["jobs"]:
                tenant = series["key"]["tenant"] or ""
                for p in series["points"]:
                    seen[f"{name}:{tenant}"]["finished"] += (
                        p["completed"] + p["failed"] + p["cancelled"]
                    )
        assert {k: v for k, v in seen.items() if k.startswith("acme:")} == {
            "acme:acme": finished["acme"]
        }
        assert {k.split(":")[1]: v for k, v in seen.items() if k.startswith("all:")} == finished
        assert all(
            s["key"]["tenant"] == "acme" for s in answers["acme"]["queue_depth"]
        )  # and the depth too
        # no tenant's jobs (tenant null) are not a tenant-limited token's either
        assert finished[""]["finished"] > 0


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ({"step": "90"}, "step: 90 s is not a whole number of minutes"),
        ({"step": "30"}, "step: "),
        ({"step": "many"}, "step: "),
        ({"by": "colour"}, "by: 'colour' is not one of"),
        ({"by": "tenant;drop"}, "by: "),
        ({"from": "2026-01-02T00:00:00Z", "to": "2026-01-01T00:00:00Z"}, "must be before"),
        ({"from": "2026-01-01T00:00:00"}, "from: 2026-01-01T00:00:00 has no time zone"),
        ({"from": "yesterday"}, "from: "),
        ({"from": "2025-01-01T00:00:00Z", "to": "2026-01-01T00:00:00Z", "step": "300"},
         "give a step of whole hours"),
        ({"from": "2020-01-01T00:00:00Z", "to": "2026-01-01T00:00:00Z", "step": "3600"},
         "at most 1440"),
    ],
)  # fmt: skip
async def test_a_read_the_rollups_cannot_answer_is_a_422_naming_why(
    query: dict[str, str], named: str, make_orc: Callable[..., Orchestrator], server: ApiServer
) -> None:
    async with make_orc() as orc:
        secret = await token(orc.stores.tokens, f"stats-{uuid4().hex[:8]}", Scope.READ)
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        answer = await client.get(
            "/api/v1/stats", params=query, headers={"Authorization": f"Bearer {secret}"}
        )
    assert answer.status_code == 422, answer.text
    assert answer.headers["content-type"].startswith("application/problem+json")
    assert named in answer.json()["detail"]
