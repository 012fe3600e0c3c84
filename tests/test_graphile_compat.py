"""Graphile Worker's SQL API for producers (docs/graphile.md): with ORCHESTRATOR_GRAPHILE_COMPAT,
`migrate` installs graphile_worker.add_job, add_jobs and remove_job, which write through the
orchestrator's submit: a producer's trigger adds jobs inside its transaction (gone with its
rollback), the orchestrator's workers run them, job keys behave as Graphile Worker's, and bad
arguments get Graphile Worker's kind of error with nothing stored."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from psycopg import conninfo
from psycopg.rows import dict_row

from bench.common import GRAPHILE, graphile_node
from orchestrator import JobContext, Orchestrator, Status
from orchestrator.domain.errors import ConfigError, MigrationError
from tests.support.harness import ROOT, WorkerRun
from tests.support.tools import find

PRODUCER = ROOT / "tests" / "support" / "graphile_producer.js"


def app(make_orc: Callable[..., Orchestrator], **settings: Any) -> Orchestrator:
    orc = make_orc(graphile_compat=True, **settings)
    running: list[str] = []
    orc.ran = []  # type: ignore[attr-defined]

    @orc.job_type("echo")
    async def echo(ctx: JobContext, payload: Any) -> Any:
        orc.ran.append(payload)  # type: ignore[attr-defined]
        return payload

    @orc.job_type("slow")
    async def slow(ctx: JobContext, payload: Any) -> None:
        running.append(payload["n"])
        orc.ran.append(list(running))  # type: ignore[attr-defined]
        await asyncio.sleep(0.2)
        running.remove(payload["n"])

    return orc


@pytest.fixture
async def compat(
    make_orc: Callable[..., Orchestrator], dsn: str
) -> AsyncIterator[Callable[..., Orchestrator]]:
    """Orchestrators whose migrate installs Graphile Worker's API; a migrate without the
    setting removes it after the test."""
    yield lambda **settings: app(make_orc, **settings)
    await make_orc().migrate()


async def call(db: psycopg.AsyncConnection[Any], sql: str, *args: Any) -> list[dict[str, Any]]:
    cur = db.cursor(row_factory=dict_row)
    await cur.execute(sql, args)
    return await cur.fetchall()


async def count_jobs(db: psycopg.AsyncConnection[Any]) -> int:
    return (await (await db.execute("SELECT count(*) FROM orc_jobs")).fetchone())[0]


async def test_a_producers_trigger_adds_jobs_in_its_transaction_and_a_rollback_leaves_none(
    compat: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = compat()
    await orc.migrate()
    await db.execute(
        """
        CREATE TEMP TABLE orders (id integer PRIMARY KEY);
        CREATE FUNCTION pg_temp.order_placed() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM graphile_worker.add_job('echo', json_build_object('order', NEW.id));
            RETURN NEW;
        END;
        $$;
        CREATE TRIGGER order_placed AFTER INSERT ON orders
            FOR EACH ROW EXECUTE FUNCTION pg_temp.order_placed();
        """
    )
    async with db.transaction(force_rollback=True):
        await db.execute("INSERT INTO orders VALUES (1)")
        assert await count_jobs(db) == 1
    assert await count_jobs(db) == 0  # rolled back with the producer's transaction
    await db.execute("INSERT INTO orders VALUES (2)")
    (job_id,) = (await (await db.execute("SELECT id FROM orc_jobs")).fetchone()) or ()
    async with WorkerRun(orc) as worker:
        await worker.until_finished(job_id)
    job = await orc.get_job(job_id)
    assert (job.job_type, job.status, job.result) == ("echo", Status.COMPLETED, {"order": 2})
    events = [e.kind for e in await orc.job_events(job_id)]
    assert events[0] == "job.created" and events[-1] == "job.completed"


async def test_add_job_answers_with_graphile_workers_columns_and_the_types_defaults(
    compat: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = compat(graphile_tenant="acme")
    await orc.migrate()
    at = datetime.now(UTC) + timedelta(hours=1)
    (row,) = await call(
        db,
        "SELECT * FROM graphile_worker.add_job('echo', '{\"a\": 1}', run_at => %s,"
        " priority => 3, max_attempts => 4)",
        at,
    )
    assert set(row) == {
        "id", "queue_name", "task_identifier", "payload", "priority", "run_at", "attempts",
        "max_attempts", "last_error", "created_at", "updated_at", "key", "locked_at",
        "locked_by", "revision", "flags", "is_available",
    }  # fmt: skip
    assert isinstance(row["id"], int)
    assert (row["task_identifier"], row["payload"], row["priority"], row["run_at"]) == (
        "echo", {"a": 1}, 3, at,
    )  # fmt: skip
    assert (row["attempts"], row["max_attempts"], row["revision"], row["is_available"]) == (
        0, 4, 0, True,
    )  # fmt: skip
    await orc.open()
    (job,) = await orc.list_jobs()
    submitted = await orc.get_job(await orc.submit("echo"))
    assert job.tenant_id == "acme"
    assert (job.queue, job.max_retries, job.timeout_seconds) == (
        submitted.queue, submitted.max_retries, submitted.timeout_seconds,
    )  # fmt: skip
    (default,) = await call(db, "SELECT * FROM graphile_worker.add_job('echo')")
    assert (default["payload"], default["priority"], default["max_attempts"]) == (
        {}, 0, submitted.max_attempts,
    )  # fmt: skip


async def test_job_keys_replace_append_arrays_preserve_run_at_and_dedupe(
    compat: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    await compat().migrate()
    later = datetime.now(UTC) + timedelta(hours=1)
    add = "SELECT * FROM graphile_worker.add_job('echo', %s::json, job_key => 'k', run_at => %s"
    (first,) = await call(db, add + ")", '{"v": 1}', later)
    (second,) = await call(db, add + ")", '{"v": 2}', later + timedelta(hours=1))
    assert (second["id"], second["revision"], second["payload"]) == (first["id"], 1, {"v": 2})
    assert second["run_at"] == later + timedelta(hours=1)
    (kept,) = await call(db, add + ", job_key_mode => 'preserve_run_at')", '{"v": 3}', later)
    assert (kept["revision"], kept["run_at"]) == (2, later + timedelta(hours=1))
    (same,) = await call(db, add + ", job_key_mode => 'unsafe_dedupe')", '{"v": 4}', later)
    assert (same["id"], same["revision"], same["payload"]) == (first["id"], 3, {"v": 3})

    (a,) = await call(db, "SELECT * FROM graphile_worker.add_job('echo', '[1]', job_key => 'l')")
    (b,) = await call(db, "SELECT * FROM graphile_worker.add_job('echo', '[2]', job_key => 'l')")
    assert (b["id"], b["payload"]) == (a["id"], [1, 2])  # arrays are appended

    rows = await call(
        db,
        "SELECT * FROM graphile_worker.add_jobs(ARRAY[('echo', '{\"b\": 1}', NULL, %s, NULL,"
        " 'k', NULL, NULL)::graphile_worker.job_spec], true)",
        later,
    )
    assert [(r["id"], r["revision"], r["run_at"]) for r in rows] == [
        (first["id"], 4, later + timedelta(hours=1))
    ]
    assert await count_jobs(db) == 2


async def test_priority_lowest_first_and_a_named_queue_runs_one_job_at_a_time(
    compat: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = compat()
    await orc.migrate()
    for priority in (5, 1, 3):
        await db.execute(
            "SELECT graphile_worker.add_job('echo', json_build_object('p', %s::int),"
            " priority => %s)",
            (priority, priority),
        )
    async with WorkerRun(orc, concurrency=1) as worker:
        await worker.until_finished(*[j.id for j in await orc.list_jobs()])
    assert orc.ran == [{"p": 1}, {"p": 3}, {"p": 5}]  # type: ignore[attr-defined]

    orc.ran.clear()  # type: ignore[attr-defined]
    for n in range(4):
        await db.execute(
            "SELECT graphile_worker.add_job('slow', json_build_object('n', %s::int),"
            " queue_name => 'serial')",
            (n,),
        )
    jobs = [j for j in await orc.list_jobs() if j.job_type == "slow"]
    async with WorkerRun(orc, concurrency=4) as worker:
        await worker.until_finished(*[j.id for j in jobs], timeout=30)
    assert len(orc.ran) == 4  # type: ignore[attr-defined]
    assert all(len(seen) == 1 for seen in orc.ran), orc.ran  # type: ignore[attr-defined]
    (row,) = await call(db, "SELECT * FROM graphile_worker.add_job('slow', '{\"n\": 9}',"
                            " queue_name => 'serial')")  # fmt: skip
    assert row["queue_name"] == "serial"


@pytest.mark.parametrize(
    ("sql", "sqlstate", "says"),
    [
        ("add_job('nope')", "22023", "unknown job type 'nope'"),
        ("add_job('echo', job_key => 'k', job_key_mode => 'bad')", "GWBKM", "job_key_mode"),
        ("add_job('echo', flags => ARRAY['f'])", "0A000", "flags are not supported"),
        ("add_job('echo', '{\"a\": \"\\u0000\"}')", "22P05", "unsupported Unicode"),
        ("add_job('echo', priority => 40000)", "22003", "smallint"),
        ("add_job('echo', job_key => 'schedule/x/1')", "22023", "schedules' namespace"),
        ("add_job('echo', max_attempts => 0)", "22023", "max_attempts"),
        (
            "add_jobs(ARRAY[('echo', NULL, NULL, NULL, NULL, NULL, NULL, NULL),"
            " ('nope', NULL, NULL, NULL, NULL, NULL, NULL, NULL)]::graphile_worker.job_spec[])",
            "22023",
            "unknown job type",
        ),
    ],
    ids=["unknown", "mode", "flags", "nul", "priority", "tick-key", "attempts", "batch"],
)
async def test_bad_arguments_get_graphile_workers_kind_of_error_and_nothing_is_stored(
    compat: Callable[..., Orchestrator],
    db: psycopg.AsyncConnection[Any],
    sql: str,
    sqlstate: str,
    says: str,
) -> None:
    await compat().migrate()
    with pytest.raises(psycopg.Error) as raised:
        await db.execute(f"SELECT * FROM graphile_worker.{sql}")
    assert raised.value.sqlstate == sqlstate
    assert says in str(raised.value)
    assert await count_jobs(db) == 0


async def test_remove_job_cancels_a_waiting_job_and_an_unknown_key_gives_a_row_of_nulls(
    compat: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = compat()
    await orc.migrate()
    (added,) = await call(db, "SELECT * FROM graphile_worker.add_job('echo', job_key => 'k')")
    (removed,) = await call(db, "SELECT * FROM graphile_worker.remove_job('k')")
    assert (removed["id"], removed["is_available"]) == (added["id"], False)
    await orc.open()
    (job,) = await orc.list_jobs()
    assert job.status == Status.CANCELLED
    assert [e.kind for e in await orc.job_events(job.id)][-1] == "job.cancelled"
    (unknown,) = await call(db, "SELECT * FROM graphile_worker.remove_job('k')")
    assert set(unknown.values()) == {None}


async def test_migrate_installs_the_api_only_when_asked_and_never_over_graphile_workers_own(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    exists = "SELECT to_regnamespace('graphile_worker') IS NOT NULL"
    await make_orc().migrate()
    assert (await (await db.execute(exists)).fetchone()) == (False,)
    await app(make_orc).migrate()
    assert (await (await db.execute(exists)).fetchone()) == (True,)
    (latest,) = await call(db, "SELECT max(id) AS id FROM graphile_worker.migrations")
    assert latest["id"] == 19
    await make_orc().migrate()  # the setting off: removed
    assert (await (await db.execute(exists)).fetchone()) == (False,)

    await db.execute("CREATE SCHEMA graphile_worker; CREATE TABLE graphile_worker._private_jobs ()")
    try:
        with pytest.raises(MigrationError, match="did not install"):
            await app(make_orc).migrate()
    finally:
        await db.execute("DROP SCHEMA graphile_worker CASCADE")


async def test_migrate_refuses_a_tenant_a_submit_would_refuse(
    make_orc: Callable[..., Orchestrator],
) -> None:
    with pytest.raises(ConfigError, match="ORCHESTRATOR_GRAPHILE_TENANT"):
        await app(make_orc, graphile_tenant=" ").migrate()


def graphile_producer(dsn: str, calls: list[list[Any]]) -> list[dict[str, Any]]:
    """Run graphile-worker's own client (tests/support/graphile_producer.js) making ``calls``;
    each call's answer. Without Node.js or the pinned package the test skips (fails under
    CI=true)."""
    find("node")
    try:
        node = graphile_node()
    except RuntimeError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"graphile-worker: {exc}; CI=true requires it")
        pytest.skip(f"graphile-worker: {exc}")
    module = GRAPHILE / "node_modules" / "graphile-worker"
    params = conninfo.conninfo_to_dict(dsn)
    user = quote(str(params.get("user", "postgres")), safe="")
    password = f":{quote(str(params['password']), safe='')}" if params.get("password") else ""
    # Host and port as parameters: the embedded server's host is its socket's directory.
    url = (
        f"postgresql://{user}{password}@/{quote(str(params['dbname']), safe='')}"
        f"?host={quote(str(params.get('host', '127.0.0.1')), safe='')}"
        f"&port={params.get('port', 5432)}"
    )
    run = subprocess.run(
        [node, str(PRODUCER), str(module), json.dumps(calls)],
        env={**os.environ, "DATABASE_URL": url}, capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    answers: list[dict[str, Any]] = json.loads(run.stdout.strip().splitlines()[-1])
    return answers


async def test_graphile_workers_own_client_adds_jobs_the_orchestrator_runs(
    compat: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any], dsn: str
) -> None:
    orc = compat()
    await orc.migrate()
    at = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
    calls = [
        ["addJob", "echo", {"v": 1}, {"jobKey": "k", "priority": 2, "runAt": at}],
        ["addJob", "echo", {"v": 2}, {"jobKey": "k", "runAt": at}],
        ["addJob", "echo", [1], {"jobKey": "list"}],
        ["addJob", "echo", [2], {"jobKey": "list"}],
        ["addJob", "echo", {}, {"jobKey": "k", "jobKeyMode": "bad"}],
        ["addJob", "nope", {}],
        ["quickAddJob", "echo", {"quick": True}],
        ["addJobs", [{"identifier": "echo", "payload": {"many": 1}},
                     {"identifier": "echo", "payload": {"many": 2}, "priority": -1}]],
    ]  # fmt: skip
    first, second, listed, appended, bad_mode, unknown, quick, many = await asyncio.to_thread(
        graphile_producer, dsn, calls
    )
    # The client found its schema migrated, and installed none of its own tables.
    assert (
        await (await db.execute("SELECT to_regclass('graphile_worker._private_jobs')")).fetchone()
    ) == (None,)
    assert (second["ok"]["id"], second["ok"]["revision"]) == (first["ok"]["id"], 1)
    assert second["ok"]["payload"] == {"v": 2} and second["ok"]["priority"] == 0
    assert appended["ok"]["id"] == listed["ok"]["id"] and appended["ok"]["payload"] == [1, 2]
    assert bad_mode["error"]["code"] == "GWBKM"
    assert unknown["error"]["code"] == "22023" and "'nope'" in unknown["error"]["message"]
    assert quick["ok"]["task_identifier"] == "echo"
    assert [j["payload"] for j in many["ok"]] == [{"many": 1}, {"many": 2}]

    await orc.open()
    jobs = await orc.list_jobs()
    assert len(jobs) == 5  # k, list, the quick one and the two of addJobs; nothing else
    async with WorkerRun(orc) as worker:
        await worker.until_finished(*[j.id for j in jobs], timeout=30)
    done = {json.dumps(j.result, sort_keys=True) for j in await orc.list_jobs()}
    assert done == {'{"v": 2}', "[1, 2]", '{"quick": true}', '{"many": 1}', '{"many": 2}'}
    keyed = next(j for j in jobs if j.job_key == "k")
    kinds = [e.kind for e in await orc.job_events(keyed.id)]
    assert kinds[:2] == ["job.created", "job.replaced"] and kinds[-1] == "job.completed"
