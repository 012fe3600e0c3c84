"""Retention of finished jobs (prune_finished): which jobs go, with every row of theirs (their
live output included), in bounded batches, archived first when asked; never a job that has not
finished, a dead letter awaiting review, or a job a live replay still points at; safe while
real workers run."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import stat
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator import JobContext, JobNotFound, JobSpec, Orchestrator, PermanentError
from orchestrator.domain.retention import DAY, Retention
from orchestrator.domain.states import TERMINAL, Status
from orchestrator.interfaces import render
from orchestrator.services import archive
from orchestrator.services.retention import RetentionResult
from retry_config import parse
from tests.support import agent_app, scripted, scripted_app
from tests.support.exposition import counted, exporter, value
from tests.support.external import MessageService, message_service
from tests.support.harness import WorkerRun, config_with, wait_for
from tests.support.workers import WorkerProcess

#: Every table a job's rows live in, and how to find the rows of the jobs in %(ids)s.
JOB_ROWS = {
    "orc_jobs": "SELECT to_jsonb(x) FROM orc_jobs AS x WHERE x.id = ANY (%(ids)s)",
    "orc_job_events": "SELECT to_jsonb(x) FROM orc_job_events AS x WHERE x.job_id = ANY (%(ids)s)",
    "orc_checkpoints": "SELECT to_jsonb(x) FROM orc_checkpoints AS x"
    " WHERE x.job_id = ANY (%(ids)s)",
    "orc_side_effects": "SELECT to_jsonb(x) FROM orc_side_effects AS x"
    " WHERE x.job_id = ANY (%(ids)s)",
    "orc_approvals": "SELECT to_jsonb(x) FROM orc_approvals AS x WHERE x.job_id = ANY (%(ids)s)",
    "orc_dead_letters": "SELECT to_jsonb(x) FROM orc_dead_letters AS x"
    " WHERE x.job_id = ANY (%(ids)s)",
    "orc_job_output": "SELECT to_jsonb(x) FROM orc_job_output AS x WHERE x.job_id = ANY (%(ids)s)",
    "orc_job_output_heads": "SELECT to_jsonb(x) FROM orc_job_output_heads AS x"
    " WHERE x.job_id = ANY (%(ids)s)",
    "procrastinate_jobs": "SELECT to_jsonb(x) FROM procrastinate_jobs AS x"
    " WHERE x.lock = ANY (%(ids)s::text[])",
    "procrastinate_events": "SELECT to_jsonb(x) FROM procrastinate_events AS x"
    " JOIN procrastinate_jobs AS p ON p.id = x.job_id WHERE p.lock = ANY (%(ids)s::text[])",
}


async def all_tables(db: psycopg.AsyncConnection[Any]) -> dict[str, int]:
    """Rows in every table of the schema (the migrations' and Procrastinate's)."""
    cur = await db.execute(
        "SELECT table_name FROM information_schema.tables"
        " WHERE table_schema = 'public' AND table_type = 'BASE TABLE' ORDER BY 1"
    )
    names = [r[0] for r in await cur.fetchall()]
    counts = {}
    for name in names:
        cur = await db.execute(f'SELECT count(*) FROM "{name}"')  # names from the catalogue
        counts[name] = (await cur.fetchone() or [0])[0]
    return counts


async def rows_of(db: psycopg.AsyncConnection[Any], ids: list[uuid.UUID]) -> dict[str, list[Any]]:
    out = {}
    for table, sql in JOB_ROWS.items():
        cur = await db.execute(sql, {"ids": [str(i) for i in ids]})
        out[table] = [r[0] for r in await cur.fetchall()]
    return out


def counts(rows: dict[str, list[Any]]) -> dict[str, int]:
    return {table: len(r) for table, r in rows.items()}


async def finished_job(
    db: psycopg.AsyncConnection[Any],
    *,
    job_type: str = "ok",
    status: str = "COMPLETED",
    age_days: float = 0.0,
    dead_letter: str | None = None,
    dispatch: str = "succeeded",
) -> uuid.UUID:
    """A job as the workers leave one, inserted directly so that its finish time can lie in the
    past (a finished job's finished_at cannot be updated): two events, a dispatch in the state
    ``dispatch`` (``doing`` on a registered worker; ``dead doing``: its worker pruned), and
    with ``dead_letter`` a dead letter in that state."""
    job_id = uuid.uuid4()
    finished = (
        "NULL" if status not in TERMINAL else f"now() - make_interval(secs => {age_days * DAY})"
    )
    await db.execute(
        "INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts, max_retries,"
        " trace_id, lease_token, finished_at) VALUES (%s, %s, %s, '{}', %s, 1, 0, 't',"
        f" CASE WHEN %s THEN gen_random_uuid() END, {finished})",
        (job_id, job_type, status, job_type, status == "RUNNING"),
    )
    await db.execute(
        "INSERT INTO orc_job_events (job_id, kind) VALUES (%s, 'job.created'), (%s, 'job.done')",
        (job_id, job_id),
    )
    await db.execute(  # a doing dispatch on a registered worker, unless the worker is "dead"
        "INSERT INTO procrastinate_jobs (queue_name, task_name, lock, args, status, worker_id)"
        " VALUES (%s, %s, %s, jsonb_build_object('job_id', %s::text), %s,"
        " CASE WHEN %s = 'doing' THEN (SELECT worker_id FROM procrastinate_register_worker_v1())"
        " END)",
        (job_type, f"orc.{job_type}", str(job_id), str(job_id), dispatch.removeprefix("dead "),
         dispatch),
    )  # fmt: skip
    if dead_letter is not None:
        await db.execute(
            "INSERT INTO orc_dead_letters (id, job_id, job_type, payload, error, state,"
            " discard_requested_by, discarded_by) VALUES (gen_random_uuid(), %s, %s, '{}', '{}',"
            " %s, CASE WHEN %s THEN 'ann' END, CASE WHEN %s THEN 'bob' END)",
            (job_id, job_type, dead_letter, dead_letter != "recorded",
             dead_letter == "discarded"),
        )  # fmt: skip
    return job_id


def config(text: str = "") -> Path:
    return config_with(text)


# -- the policy -------------------------------------------------------------------------------

days = st.one_of(st.none(), st.floats(0, 36_500, allow_nan=False))
TYPES = ("a", "b", "c")


@given(
    settings=st.tuples(st.floats(0, 36_500), st.floats(0, 36_500)),
    defaults=st.tuples(days, days),
    types=st.dictionaries(st.sampled_from(TYPES), st.tuples(days, days)),
)
def test_a_types_retention_is_its_own_else_the_config_defaults_else_the_settings(
    settings: tuple[float, float],
    defaults: tuple[float | None, float | None],
    types: dict[str, tuple[float | None, float | None]],
) -> None:
    def table(pair: tuple[float | None, float | None]) -> dict[str, float]:
        names = ("retention_days", "failed_retention_days")
        return {n: v for n, v in zip(names, pair, strict=True) if v is not None}

    raw = {"defaults": table(defaults), "job_types": {t: table(p) for t, p in types.items()}}
    loaded = parse(raw, Path("test.toml"))
    retention = Retention.of(days=settings[0], failed_days=settings[1], config=loaded)
    params = retention.params()
    default: dict[str, float] = dict(zip(params["statuses"], params["seconds"], strict=True))
    overrides: dict[tuple[str, str], float] = {
        (t, s): v
        for t, s, v in zip(params["override_types"], params["override_statuses"],
                           params["override_seconds"], strict=True)
    }  # fmt: skip

    def kept(job_type: str, status: Status) -> float:
        """As the prune query reads the arrays: the override, else the status's default."""
        return overrides.get((job_type, status.value), default[status.value])

    for job_type in (*TYPES, "unlisted"):
        own = types.get(job_type, (None, None))
        for status, i in ((Status.COMPLETED, 0), (Status.CANCELLED, 0), (Status.FAILED, 1)):
            expected = next(v for v in (own[i], defaults[i], settings[i]) if v is not None)
            kept_for = kept(job_type, status)
            assert retention.shortest() <= kept_for == expected * DAY <= retention.longest()
    assert all(  # an override is listed only where it differs
        v != retention.default[s] for by in retention.by_type.values() for s, v in by.items()
    )


# -- which jobs go ----------------------------------------------------------------------------


async def test_exactly_the_jobs_past_their_retention_go_by_status_and_type_override(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = make_orc(
        job_retention_days=1, failed_job_retention_days=10,
        retry_config=config(
            "[job_types.short]\nretention_days = 0.25\n"
            "[job_types.long]\nretention_days = 3\nfailed_retention_days = 20\n"
        ),
    )  # fmt: skip
    go: list[uuid.UUID] = []
    stay: list[uuid.UUID] = []
    for job_type, status, age, goes in [
        ("ok", "COMPLETED", 2, True), ("ok", "COMPLETED", 0.5, False),
        ("ok", "CANCELLED", 2, True), ("ok", "CANCELLED", 0.5, False),
        ("ok", "FAILED", 11, True), ("ok", "FAILED", 5, False),  # the longer FAILED default
        ("short", "COMPLETED", 0.5, True), ("short", "COMPLETED", 0.1, False),
        ("short", "FAILED", 11, True), ("short", "FAILED", 2, False),  # the default for FAILED
        ("long", "COMPLETED", 4, True), ("long", "COMPLETED", 2, False),
        ("long", "FAILED", 21, True), ("long", "FAILED", 11, False),
    ]:  # fmt: skip
        letter = "discarded" if status == "FAILED" else None
        job = await finished_job(db, job_type=job_type, status=status, age_days=age,
                                 dead_letter=letter)  # fmt: skip
        (go if goes else stay).append(job)
    for status, dispatch in (("PENDING", "todo"), ("RUNNING", "doing"), ("RETRY", "failed")):
        job_id = await finished_job(db, status=status, dispatch=dispatch)  # unfinished
        stay.append(job_id)
    for dispatch in ("todo", "doing"):  # finished, but its dispatch has not ended yet
        stay.append(await finished_job(db, age_days=2, dispatch=dispatch))
    # finished, its dispatch left doing by a worker Procrastinate has pruned (worker_id unset)
    go.append(await finished_job(db, age_days=2, dispatch="dead doing"))
    before, going, staying = await all_tables(db), await rows_of(db, go), await rows_of(db, stay)
    async with orc:
        result = await orc.maintenance.finished.run_once()
        with pytest.raises(JobNotFound):  # gone as if never submitted
            await orc.get_job(go[0])
    assert result.jobs == len(go) and result.events == 2 * len(go)
    assert (result.dispatches, result.dead_letters) == (len(go), 3)
    assert await rows_of(db, go) == {t: [] for t in JOB_ROWS}
    assert await rows_of(db, stay) == staying
    after = await all_tables(db)
    assert {t: before[t] - after[t] for t in before if before[t] != after[t]} == {
        t: n for t, n in counts(going).items() if n
    }
    assert result.by_type == {
        ("ok", "COMPLETED"): 2, ("ok", "CANCELLED"): 1, ("ok", "FAILED"): 1,
        ("short", "COMPLETED"): 1, ("short", "FAILED"): 1, ("long", "COMPLETED"): 1,
        ("long", "FAILED"): 1,
    }  # fmt: skip


@pytest.fixture(autouse=True)
async def rolled_up(db: psycopg.AsyncConnection[Any]) -> None:
    """Every finished job counted in the rollups already (the watermark's own test sets it):
    a watermark far ahead, but finite, since a worker process's rollup tick may read it (an
    infinite one cannot be loaded as a datetime, and failed such a tick in a loaded run)."""
    await db.execute("UPDATE orc_rollup_watermark SET rolled_up_to = '9999-12-31'")


async def test_a_job_goes_only_once_the_rollups_have_counted_it(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    """History outlives the jobs: a job past its retention stays while it finished at or after
    the rollups' watermark (none before the first rollup), and goes once they counted it."""
    orc = make_orc(job_retention_days=0)
    old = await finished_job(db, age_days=2)
    recent = await finished_job(db, age_days=0.5)
    watermark = "UPDATE orc_rollup_watermark SET rolled_up_to = %s"
    async with orc:
        await db.execute(watermark, [None])
        assert (await orc.maintenance.finished.run_once()).jobs == 0
        await db.execute(watermark, [datetime.now(UTC) - timedelta(days=1)])
        assert (await orc.maintenance.finished.preview()).jobs == 1
        assert (await orc.maintenance.finished.run_once()).jobs == 1
        await db.execute(watermark, [datetime.now(UTC)])
        assert (await orc.maintenance.finished.run_once()).jobs == 1
    assert await rows_of(db, [old, recent]) == {t: [] for t in JOB_ROWS}


async def test_a_reloaded_retry_config_sets_the_retention_of_the_next_run(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    """A per-type retention edited in the file applies from the next run, without a restart
    (the policy is read from the config in effect, docs/configuration.md "Reloading")."""
    orc = make_orc(job_retention_days=1)
    job = await finished_job(db, job_type="short", status="COMPLETED", age_days=0.5)
    async with orc:
        assert (await orc.maintenance.finished.run_once()).jobs == 0
        edited = parse({"job_types": {"short": {"retention_days": 0.25}}}, Path("edited.toml"))
        orc.live_config.apply(edited)
        assert (await orc.maintenance.finished.run_once()).jobs == 1
    assert await (
        await db.execute("SELECT count(*) FROM orc_jobs WHERE id = %s", [job])
    ).fetchone() == (0,)


async def test_a_dead_letter_awaiting_review_or_a_live_replay_keeps_its_job(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = make_orc(failed_job_retention_days=1)
    recorded = await finished_job(db, status="FAILED", age_days=5, dead_letter="recorded")
    requested = await finished_job(db, status="FAILED", age_days=5, dead_letter="discard_requested")
    discarded = await finished_job(db, status="FAILED", age_days=5, dead_letter="discarded")
    requeued = await finished_job(db, status="FAILED", age_days=5, dead_letter="requeued")
    replayed = await finished_job(db, status="FAILED", age_days=5, dead_letter="requeued")
    live = await finished_job(db, status="PENDING", dispatch="todo")  # a replay, not finished
    await db.execute(
        "UPDATE orc_dead_letters SET requeued_job_id = %s WHERE job_id = %s", (live, replayed)
    )
    async with orc:
        result = await orc.maintenance.finished.run_once()
    assert result.jobs == 2
    cur = await db.execute("SELECT id FROM orc_jobs")
    assert {r[0] for r in await cur.fetchall()} == {recorded, requested, replayed, live}
    assert discarded != requeued  # both gone: reviewed, and nothing live points at them


async def test_a_job_that_an_unfinished_job_depends_on_is_kept(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    """docs/workflows.md: a finished parent stays while a job that depends on it has not
    ended (the child will read its result), or while a child it spawned runs; once they have
    ended, it goes."""
    orc = make_orc(job_retention_days=1)
    read_later = await finished_job(db, age_days=5)
    read_already = await finished_job(db, age_days=5)
    waiting = await finished_job(db, status="BLOCKED", dispatch="todo")
    ended = await finished_job(db, age_days=5)
    await db.execute(
        "UPDATE orc_jobs SET has_dependants = true WHERE id = ANY(%s)",
        ([read_later, read_already],),
    )
    await db.execute(
        "INSERT INTO orc_job_dependencies (job_id, awaited_id, ord, on_failure, settled)"
        " VALUES (%s, %s, 1, 'cancel', 'COMPLETED'), (%s, %s, 1, 'cancel', 'COMPLETED')",
        (waiting, read_later, ended, read_already),
    )  # fmt: skip
    spawner = await finished_job(db, age_days=5)  # its child still runs
    running = await finished_job(db, status="RUNNING", dispatch="doing")
    await db.execute("UPDATE orc_jobs SET has_dependants = true WHERE id = %s", (spawner,))
    await db.execute(
        "INSERT INTO orc_job_children (parent_id, step, key, n, child_id, cancel_with_parent)"
        " VALUES (%s, 1, 'spawn1', 1, %s, false)",
        (spawner, running),
    )  # fmt: skip
    async with orc:
        await orc.maintenance.finished.run_once()
    cur = await db.execute("SELECT id FROM orc_jobs")
    assert {r[0] for r in await cur.fetchall()} == {read_later, waiting, spawner, running}


async def test_a_run_deletes_in_batches_one_statement_each(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = make_orc(job_retention_days=1, retention_batch_size=2)
    for _ in range(5):
        await finished_job(db, age_days=2)
    async with orc:
        result = await orc.maintenance.finished.run_once()
        assert result.batches == [2, 2, 1]  # a short batch ends the run
        assert (await orc.maintenance.finished.run_once()).batches == [0]


async def test_a_job_locked_elsewhere_is_skipped_not_waited_for(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any], dsn: str
) -> None:
    orc = make_orc(job_retention_days=1)
    locked, free = await finished_job(db, age_days=2), await finished_job(db, age_days=2)
    async with await psycopg.AsyncConnection.connect(dsn) as other, orc:
        await other.execute("SELECT FROM orc_jobs WHERE id = %s FOR UPDATE", (locked,))
        result = await asyncio.wait_for(orc.maintenance.finished.run_once(), timeout=10)
        await other.rollback()
        assert result.jobs == 1
        cur = await db.execute("SELECT id FROM orc_jobs")
        assert [r[0] for r in await cur.fetchall()] == [locked]  # the next run takes it
        assert (await orc.maintenance.finished.run_once()).jobs == 1
    assert free != locked


# -- bookkeeping ------------------------------------------------------------------------------


async def test_bookkeeping_ages_out(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = make_orc(job_retention_days=1, failed_job_retention_days=10)
    await db.execute(
        """
        INSERT INTO procrastinate_jobs (queue_name, task_name, args, status)
        SELECT 'maintenance', 'orchestrator.sweep_zombies',
               jsonb_build_object('timestamp', extract(epoch FROM now()) - d * 86400),
               s::procrastinate_job_status
          FROM (VALUES (2, 'succeeded'), (2, 'failed'), (0.5, 'succeeded'), (2, 'doing'))
               AS x (d, s);
        INSERT INTO orc_api_tokens (id, name, secret_sha256, scopes, created_by, revoked_at)
        SELECT gen_random_uuid(), n, sha256(n::bytea), '{read}', 'test',
               now() - make_interval(days => d)
          FROM (VALUES ('old', 11), ('recent', 9)) AS x (n, d);
        INSERT INTO orc_ui_sessions (id_sha256, token_id, csrf, expires_at)
        SELECT sha256(x::bytea), (SELECT id FROM orc_api_tokens WHERE name = 'recent'), 'c', e
          FROM (VALUES ('a', now() - interval '1 s'), ('b', now() + interval '1 h')) AS v (x, e);
        INSERT INTO orc_event_listeners (listener, until)
        VALUES ('gone', now() - interval '1 s'), ('here', now() + interval '1 h');
        """
    )
    async with orc:
        preview = await orc.maintenance.finished.preview()
        result = await orc.maintenance.finished.run_once()
        again = await orc.maintenance.finished.run_once()
    kinds = ("maintenance_dispatches", "sessions", "event_listeners", "revoked_tokens")
    assert [getattr(result, k) for k in kinds] == [2, 1, 1, 1]
    assert [getattr(preview, k) for k in kinds] == [2, 1, 1, 1]
    assert again.handled == 0
    cur = await db.execute("SELECT name FROM orc_api_tokens")
    assert [r[0] for r in await cur.fetchall()] == ["recent"]
    cur = await db.execute("SELECT listener FROM orc_event_listeners")
    assert [r[0] for r in await cur.fetchall()] == ["here"]


# -- with real jobs, the archive, the CLI and the metrics -------------------------------------


@pytest.fixture
def service() -> Iterator[MessageService]:
    with message_service() as svc:
        yield svc


@pytest.mark.logs_errors(r"\(boom\) failed; no escalation target")
async def test_real_jobs_go_whole_and_the_archive_holds_exactly_what_went(
    make_orc: Callable[..., Orchestrator],
    db: psycopg.AsyncConnection[Any],
    service: MessageService,
    tmp_path: Path,
) -> None:
    retention = 2.0  # seconds: a real job's finish time cannot be backdated
    orc = make_orc(
        retry_config=config(agent_app.TABLE + "[job_types.fresh]\nretention_days = 1\n"
                            "failed_retention_days = 1\n"),
        archive_dir=tmp_path / "archive", retention_cron="0 0 1 1 *",  # no tick of its own
        job_retention_days=retention / DAY, failed_job_retention_days=retention / DAY,
    )  # fmt: skip
    agent_app.register(orc)

    @orc.job_type("boom")
    async def boom(ctx: JobContext, payload: Any) -> None:
        ctx.output.text("about to fail")  # its output, and the marker its failure writes
        ctx.output.progress({"tool": "fuse"})
        raise PermanentError("boom")

    @orc.job_type("fresh")
    async def fresh(ctx: JobContext, payload: Any) -> None:
        ctx.output.text("kept a day")

    async with WorkerRun(orc) as worker:
        old = [await orc.submit("agent", {"service": service.url}) for _ in range(2)]
        failed = [await orc.submit("boom", {}) for _ in range(2)]
        cancelled = await orc.submit("agent", {"service": service.url}, run_at=later())
        await orc.cancel(cancelled)
        waiting = await orc.submit("agent", {"service": service.url}, run_at=later())
        kept = await orc.submit("fresh", {})  # its type keeps it a day
        await worker.until_finished(*old, *failed, kept)
        letters = {letter.job_id: letter for letter in await orc.dead_letters()}
        await orc.request_discard(letters[failed[1]].id, by="ann", reason="seen")
        await orc.confirm_discard(letters[failed[1]].id, by="bob")
    await asyncio.sleep(retention + 0.5)
    go, stay = [*old, failed[1], cancelled], [failed[0], waiting, kept]
    before, going, staying = await all_tables(db), await rows_of(db, go), await rows_of(db, stay)
    assert all(going[t] for t in ("orc_checkpoints", "orc_side_effects", "procrastinate_jobs",
                                  "orc_job_output", "orc_job_output_heads"))  # fmt: skip
    assert staying["orc_job_output"]
    result = await orc.maintenance.run("prune_finished")
    assert await rows_of(db, go) == {t: [] for t in JOB_ROWS}
    assert await rows_of(db, stay) == staying
    assert isinstance(result, RetentionResult)
    after = await all_tables(db)
    gone = counts({t: r for t, r in going.items() if r})
    gone["procrastinate_jobs"] += result.maintenance_dispatches  # the worker's ticks, aged out
    assert {t: before[t] - after[t] for t in before if before[t] != after[t]} == gone

    assert result.archive is not None
    assert result.archive.parent == tmp_path / "archive"
    archived = {line["job"]["id"]: line for line in archive.read(result.archive)}
    assert set(archived) == {str(j) for j in go}
    for job_id, line in archived.items():
        mine = of_job(going, job_id)
        assert line["job"] == mine["orc_jobs"][0]
        for kind in ("events", "checkpoints", "side_effects", "approvals", "dead_letters"):
            assert line[kind] == mine[f"orc_{kind}" if kind != "events" else "orc_job_events"]
        assert line["output"] == mine["orc_job_output"]
        assert [{k: v for k, v in d.items() if k != "events"} for d in line["dispatches"]] == (
            mine["procrastinate_jobs"]
        )
    found = await counted(orc)
    assert value(found, "orchestrator_maintenance_rows_total", service="prune_finished",
                 action="jobs") == len(go)  # fmt: skip
    assert value(found, "orchestrator_maintenance_rows_total", service="prune_finished",
                 action="events") == len(going["orc_job_events"])  # fmt: skip
    assert value(found, "orchestrator_maintenance_rows_total", service="prune_finished",
                 action="output_chunks") == len(going["orc_job_output"])  # fmt: skip
    counts_by_kind = [f.name for f in dataclasses.fields(RetentionResult) if f.type == "int"]
    assert all(type(getattr(result, k)) is int for k in counts_by_kind)  # all reach the metrics


def later() -> datetime:
    return datetime.now(UTC) + timedelta(hours=1)


def of_job(rows: dict[str, list[Any]], job_id: str) -> dict[str, list[Any]]:
    """Of ``rows`` (by table), those of one job, in the archive's order."""
    orders = {"orc_job_events": "id", "orc_checkpoints": "step", "orc_approvals": "id",
              "orc_side_effects": "invocation_id", "orc_dead_letters": "id",
              "orc_job_output": "chunk_offset", "procrastinate_jobs": "id"}  # fmt: skip
    mine = {}
    for table, found in rows.items():
        key = "lock" if table == "procrastinate_jobs" else "id" if table == "orc_jobs" else "job_id"
        own = [r for r in found if r.get(key) == job_id]
        mine[table] = sorted(own, key=lambda r: r[orders[table]]) if table in orders else own
    return mine


async def test_pruning_while_worker_processes_run_jobs_takes_only_finished_ones(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any], dsn: str,
    tmp_path: Path,
) -> None:  # fmt: skip
    """Retention zero: every job is due the moment it finishes, while two worker processes run
    jobs that retry once (RETRY, a new dispatch) and the workers' own ticks prune every second.
    Every job deleted was finished, whole (its archive line ends in job.completed), and no
    worker logged an error (a write to a job deleted under it would)."""
    env = {
        "ORCHESTRATOR_RETRY_CONFIG": scripted_app.CONFIG, "ORCHESTRATOR_JOB_RETENTION_DAYS": 0,
        "ORCHESTRATOR_RETENTION_CRON": "* * * * * *", "ORCHESTRATOR_ARCHIVE_DIR": tmp_path,
        "ORCHESTRATOR_RETENTION_BATCH_SIZE": 7,
    }  # fmt: skip
    orc = make_orc(retry_config=scripted_app.CONFIG, job_retention_days=0, archive_dir=tmp_path,
                   retention_batch_size=5)  # fmt: skip
    scripted.register(orc)
    app = "tests.support.scripted_app:orc"
    with WorkerProcess(dsn, app, **env), WorkerProcess(dsn, app, **env):
        async with orc:
            submitted: set[uuid.UUID] = set()
            for _ in range(8):
                for script in (["ok"], ["app", "ok"], ["sleep:0.2", "ok"]):
                    submitted |= set(await orc.submit_many(
                        [JobSpec(job_type="scripted", payload={"script": script})] * 10
                    ))  # fmt: skip
                await orc.maintenance.finished.run_once()

            async def all_gone() -> bool:
                await orc.maintenance.finished.run_once()
                cur = await db.execute("SELECT count(*) FROM orc_jobs")
                return bool((await cur.fetchone() or [1])[0] == 0)

            await wait_for(all_gone, timeout=90, interval=0.2)
    files = await asyncio.to_thread(lambda: list(tmp_path.glob(f"*{archive.SUFFIX}")))
    lines = [line for path in files for line in archive.read(path)]
    assert sorted(line["job"]["id"] for line in lines) == sorted(str(j) for j in submitted)
    assert {line["job"]["status"] for line in lines} == {"COMPLETED"}
    assert all(line["events"][-1]["kind"] == "job.completed" for line in lines)
    assert all(d["status"] == "succeeded" for line in lines for d in line["dispatches"][-1:])


# -- keeping pace, and saying how far behind -------------------------------------------------


async def planted_due(db: psycopg.AsyncConnection[Any], n: int) -> None:
    """``n`` COMPLETED jobs that finished two days ago, an event each, planted in one statement
    each table."""
    await db.execute(
        "INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts, max_retries,"
        " trace_id, finished_at) SELECT gen_random_uuid(), 'ok', 'COMPLETED', '{}', 'ok', 1, 0,"
        " 't', now() - interval '2 days' - make_interval(secs => i)"
        " FROM generate_series(1, %s) AS i",
        (n,),
    )
    await db.execute(
        "INSERT INTO orc_job_events (job_id, kind) SELECT id, 'job.done' FROM orc_jobs"
    )


async def caught_up_long_ago(db: psycopg.AsyncConnection[Any]) -> None:
    """Retention last caught up two hours ago (orc_retention_progress, 0037)."""
    await db.execute("UPDATE orc_retention_progress SET caught_up_to = now() - interval '2 hours'")


async def test_tokens_past_a_bigint_roll_up_exactly_and_retention_goes_on(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any], dsn: str
) -> None:
    """Two LLM calls of a job reporting 2^62 tokens of each kind (a usage row holds any bigint)
    sum to 2^63, past a bigint. The rollup counts them exactly and its watermark moves on, so
    retention deletes the job; the fleet exporter says how far behind both were, and are. Before
    0037 every rollup run failed (`bigint out of range`): nothing was deleted from then on, and
    no metric said so (issue 36, item 10)."""
    orc = make_orc(job_retention_days=0)
    job = await finished_job(db, age_days=30 / 1440)  # half an hour ago
    await db.execute(
        "INSERT INTO orc_llm_usage (job_id, call_id, attempt, job_type, model, input_tokens,"
        " output_tokens, cache_read_tokens, cache_creation_tokens)"
        " SELECT %(job)s, c, 1, 'ok', 'big', %(n)s, %(n)s, %(n)s, %(n)s"
        " FROM unnest(ARRAY['one', 'two']) AS c",
        {"job": job, "n": 2**62},
    )
    await db.execute(  # the rollups have counted every minute before the job's
        "UPDATE orc_rollup_watermark SET rolled_up_to ="
        " (SELECT date_trunc('minute', finished_at) FROM orc_jobs)"
    )
    await caught_up_long_ago(db)
    async with exporter(dsn) as scrape, orc:
        before = await scrape()
        rolled = await orc.maintenance.rollup.run_once()
        pruned = await orc.maintenance.finished.run_once()
        stats = await orc.stats(since=datetime.now(UTC) - timedelta(hours=2), step=3600)
        after = await scrape()
    assert rolled.jobs == 1 and rolled.minutes >= 25
    assert (pruned.jobs, pruned.llm_usage) == (1, 2)
    cur = await db.execute(
        "SELECT period, input_tokens, output_tokens, cache_read_tokens, cache_creation_tokens,"
        " llm_calls FROM orc_job_rollups ORDER BY period"
    )
    total = 2**63
    assert await cur.fetchall() == [(60, total, total, total, total, 2),
                                    (3600, total, total, total, total, 2)]  # fmt: skip
    points = [p for series in stats.jobs for p in series.points]
    assert sum(p.input_tokens for p in points) == total
    assert sum(p.cache_creation_tokens for p in points) == total
    tokens = {"tenant": "", "model": "big"}
    assert value(before, "orchestrator_llm_tokens_recent", **tokens, kind="input") == 2.0**63
    assert value(before, "orchestrator_rollup_lag_seconds") >= 29 * 60
    assert value(before, "orchestrator_retention_lag_seconds") >= 2 * 3600
    # The rollups now trail the clock by the settle time and the minute under way; retention
    # caught up to their watermark (the shortest retention is 0).
    assert 0 < value(after, "orchestrator_rollup_lag_seconds") < 10 * 60
    assert 0 < value(after, "orchestrator_retention_lag_seconds") < 10 * 60


@pytest.fixture
async def deletions(db: psycopg.AsyncConnection[Any]) -> AsyncIterator[str]:
    """A table of the DELETE statements on orc_jobs, each with its transaction and the jobs it
    deleted (a statement trigger of the test's own, dropped after it): the query that reads it."""
    await db.execute("CREATE TABLE test_deletions (xid bigint, jobs bigint)")
    await db.execute(
        "CREATE FUNCTION test_deletion() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
        " INSERT INTO test_deletions SELECT txid_current(), count(*) FROM gone; RETURN NULL;"
        " END $$"
    )
    await db.execute(
        "CREATE TRIGGER test_deletion AFTER DELETE ON orc_jobs REFERENCING OLD TABLE AS gone"
        " FOR EACH STATEMENT EXECUTE FUNCTION test_deletion()"
    )
    try:
        yield "SELECT xid, jobs FROM test_deletions WHERE jobs > 0"
    finally:
        await db.execute("DROP TRIGGER test_deletion ON orc_jobs")
        await db.execute("DROP FUNCTION test_deletion()")
        await db.execute("DROP TABLE test_deletions")


async def test_one_run_with_the_defaults_clears_more_than_ten_batches_one_transaction_each(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any], deletions: str
) -> None:
    """25,000 jobs due, two and a half times what a run took before (10 batches of 1,000: no
    more than 167 jobs/s a minute). One run, with every default but the retention, takes them
    all, 1,000 a statement, each in a transaction of its own (issue 36, item 11)."""
    orc = make_orc(job_retention_days=1)
    assert (orc.settings.retention_batch_size, orc.settings.retention_run_seconds) == (1000, 30)
    await planted_due(db, 25_000)
    async with orc:
        result = await orc.maintenance.finished.run_once()
    assert (result.jobs, result.events, result.behind) == (25_000, 25_000, False)
    assert result.batches == [1000] * 25 + [0]
    cur = await db.execute("SELECT count(*) FROM orc_jobs")
    assert await cur.fetchone() == (0,)
    statements = await (await db.execute(deletions)).fetchall()
    assert sorted(jobs for _, jobs in statements) == [1000] * 25
    assert len({xid for xid, _ in statements}) == 25


async def test_a_run_whose_time_ran_out_with_jobs_due_says_it_fell_behind(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any], dsn: str,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """A run that stops with its batches still full leaves the point retention caught up to
    where it was: its log line says it fell behind, and the exporter's retention lag keeps
    growing until a run comes back short."""
    orc = make_orc(job_retention_days=1, retention_batch_size=10, retention_run_seconds=0)
    await planted_due(db, 25)
    await caught_up_long_ago(db)

    async def prune() -> RetentionResult:
        """A run as the maintenance lane's tick makes it (logged)."""
        result = await orc.maintenance.run("prune_finished")
        assert isinstance(result, RetentionResult)
        return result

    async with exporter(dsn) as scrape, orc:
        with caplog.at_level(logging.WARNING, logger="orchestrator.services.maintenance"):
            runs = [await prune()]
            behind = await scrape()
            runs += [await prune(), await prune()]
        caught_up = await scrape()
    assert [(r.jobs, r.behind) for r in runs] == [(10, True), (10, True), (5, False)]
    lines = [r.getMessage() for r in caplog.records if r.name.endswith(".maintenance")]
    assert len(lines) == 3
    assert all("fell behind: jobs were still due when the run's 0 s ran out" in line
               for line in lines[:2])  # fmt: skip
    assert "fell behind" not in lines[2]
    assert value(behind, "orchestrator_retention_lag_seconds") >= 2 * 3600
    assert value(caught_up, "orchestrator_retention_lag_seconds") < 10 * 60


# -- the command line -------------------------------------------------------------------------


@pytest.fixture
def cli(dsn: str) -> Callable[..., tuple[int, str, str]]:
    """``orchestrator ARGS`` in a process of its own (the application reads its settings at
    import), with a day's retention and ``env`` added."""

    def run(*argv: str, **env: str) -> tuple[int, str, str]:
        environment = {**os.environ, "DATABASE_URL": dsn, "ORCHESTRATOR_JOB_RETENTION_DAYS": "1"}
        environment.pop("ORCHESTRATOR_RETRY_CONFIG", None)
        done = subprocess.run(
            [sys.executable, "-m", "orchestrator", *argv], env={**environment, **env},
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        return done.returncode, done.stdout, done.stderr

    return run


async def test_prune_dry_run_shows_what_would_go_and_prune_deletes_it(
    cli: Callable[..., tuple[int, str, str]], db: psycopg.AsyncConnection[Any]
) -> None:
    for job_type, status, age in [
        ("llm_generate", "COMPLETED", 2),
        ("llm_generate", "COMPLETED", 3),
        ("run_agent", "CANCELLED", 2),
        ("run_agent", "COMPLETED", 0.5),
    ]:
        await finished_job(db, job_type=job_type, status=status, age_days=age)  # fmt: skip
    expected = [
        "3 finished jobs past their retention",
        "  llm_generate  COMPLETED  2",
        "  run_agent     CANCELLED  1",
        "with them: 6 events, 0 checkpoints, 0 side effects, 0 approvals, 0 dead letters,"
        " 3 dispatches, 0 dispatch events, 0 llm usage, 0 output chunks",
        "aged out: 0 maintenance dispatches, 0 sessions, 0 event listeners, 0 revoked tokens",
    ]
    code, out, _ = await asyncio.to_thread(cli, "prune", "--dry-run")
    assert code == 0 and out.splitlines() == ["would delete " + expected[0], *expected[1:]]
    code, out, _ = await asyncio.to_thread(cli, "prune")
    assert code == 0 and out.splitlines() == ["deleted " + expected[0], *expected[1:]]
    cur = await db.execute("SELECT job_type FROM orc_jobs")
    assert [r[0] for r in await cur.fetchall()] == ["run_agent"]


@pytest.mark.parametrize("umask", [0o022, 0o000], ids=["umask 022", "umask 000"])
async def test_the_archive_is_its_owner_s_alone_whatever_the_umask(
    cli: Callable[..., tuple[int, str, str]],
    db: psycopg.AsyncConnection[Any],
    tmp_path: Path,
    umask: int,
) -> None:
    """Every tenant's payloads and results are in it: the file is 0600, and each directory the
    run made for it 0700; a directory that was there keeps its mode."""
    await finished_job(db, age_days=2)
    directory = tmp_path / "archive" / "prune"
    code, out, err, modes = await asyncio.to_thread(prune_into, cli, directory, umask)
    assert code == 0 and out.startswith("deleted 1 finished jobs"), err
    assert modes == {"file": 0o600, "directory": 0o700, "its parent": 0o700, "there before": 0o755}


def prune_into(
    cli: Callable[..., tuple[int, str, str]], directory: Path, umask: int
) -> tuple[int, str, str, dict[str, int]]:
    """``orchestrator prune`` archiving into ``directory`` (two levels below one of mode 0755)
    under ``umask``: its answer, and the modes of the file and the directories it is in."""
    directory.parent.parent.chmod(0o755)
    previous = os.umask(umask)  # the command's process inherits it
    try:
        code, out, err = cli("prune", ORCHESTRATOR_ARCHIVE_DIR=str(directory))
    finally:
        os.umask(previous)
    files = list(directory.glob(f"*{archive.SUFFIX}"))
    assert len(files) == 1 and len(archive.read(files[0])) == 1, files
    paths = {"file": files[0], "directory": directory, "its parent": directory.parent,
             "there before": directory.parent.parent}  # fmt: skip
    return code, out, err, {what: stat.S_IMODE(p.stat().st_mode) for what, p in paths.items()}


async def test_prune_mistakes_are_one_line_and_delete_nothing(
    cli: Callable[..., tuple[int, str, str]], db: psycopg.AsyncConnection[Any], tmp_path: Path
) -> None:
    await finished_job(db, age_days=2)
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    code, out, err = await asyncio.to_thread(
        cli, "prune", ORCHESTRATOR_ARCHIVE_DIR=str(not_a_directory)
    )
    assert (code, out) == (2, "") and err.startswith("error: cannot write the archive (")
    assert err.endswith("the jobs it would hold were not deleted\n") and err.count("\n") == 1
    code, out, err = await asyncio.to_thread(
        cli, "prune", "--dry-run", ORCHESTRATOR_JOB_RETENTION_DAYS="-1"
    )
    assert (code, out) == (2, "") and "ORCHESTRATOR_JOB_RETENTION_DAYS" in err
    assert "Traceback" not in err
    cur = await db.execute("SELECT count(*) FROM orc_jobs")
    assert (await cur.fetchone() or [0])[0] == 1


def test_a_runs_result_reads_as_a_sentence(tmp_path: Path) -> None:
    result = RetentionResult(jobs=3, events=9, checkpoints=2, side_effects=1, output_chunks=4,
                             dispatches=3, sessions=2, revoked_tokens=1,
                             archive=tmp_path / "a.jsonl.gz")  # fmt: skip
    assert result.sentence() == (
        "finished jobs past their retention deleted: 3 (9 events, 2 checkpoints, 1 ledger rows,"
        f" 4 output chunks, 3 dispatches); aged out: 2 sessions, 1 revoked tokens; archived to"
        f" {tmp_path}/a.jsonl.gz"
    )
    assert result.handled == 6
    assert RetentionResult().sentence() == (
        "finished jobs past their retention deleted: 0 (0 events, 0 checkpoints, 0 ledger rows,"
        " 0 output chunks, 0 dispatches)"
    )


def test_a_dry_run_that_reaches_a_runs_limit_says_more_may_be_due() -> None:
    full = RetentionResult(jobs=20, limit=20, by_type={("a", "COMPLETED"): 20})
    assert render.prune_lines(full, dry_run=True)[:2] == [
        "would delete 20 finished jobs past their retention (a dry run counts 20 at most: more"
        " may be due)",
        "  a  COMPLETED  20",
    ]
    assert render.prune_lines(RetentionResult(jobs=19, limit=20), dry_run=True)[0] == (
        "would delete 19 finished jobs past their retention"
    )
