"""Graphile Worker's SQL API for producers (docs/graphile.md): with ORCHESTRATOR_GRAPHILE_COMPAT,
`migrate` installs graphile_worker.add_job, add_jobs and remove_job, which write through the
orchestrator's submit: a producer's trigger adds jobs inside its transaction (gone with its
rollback), the orchestrator's workers run them, job keys behave as Graphile Worker's, and bad
arguments get Graphile Worker's kind of error with nothing stored. complete_jobs,
permanently_fail_jobs and reschedule_jobs end or move the API tenant's waiting jobs through the
orchestrator's own writers, with their events; a running job and another tenant's are left
alone. A job added this way is its tenant's in the HTTP API, the command line and the dashboard
(a real ``orchestrator serve``), and another tenant's token does not find it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

import httpx
import psycopg
import pytest
from psycopg import conninfo
from psycopg.rows import dict_row

from bench.common import GRAPHILE, graphile_node
from orchestrator import JobContext, Orchestrator, RetryLater, Status
from orchestrator.domain import events
from orchestrator.domain.classification import ErrorClass
from orchestrator.domain.errors import ConfigError, MigrationError
from orchestrator.domain.events import Fault
from orchestrator.domain.models import Job, JobState
from tests.support.api_server import ApiServer, ui_session
from tests.support.harness import ROOT, WorkerRun, config_with, wait_for
from tests.support.tools import find

PRODUCER = ROOT / "tests" / "support" / "graphile_producer.js"


#: A job of type ``later`` retries in an hour (the hint its first run gives, under this cap).
LATER = """
[job_types.later]
backoff = { base_ms = 3600000, cap_ms = 3600000, multiplier = 2, jitter = "none" }
"""


def app(make_orc: Callable[..., Orchestrator], **settings: Any) -> Orchestrator:
    orc = make_orc(graphile_compat=True, retry_config=config_with(LATER), **settings)
    running: list[str] = []
    orc.ran = []  # type: ignore[attr-defined]
    orc.release = asyncio.Event()  # type: ignore[attr-defined]

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

    @orc.job_type("later")  # its first run asks to be retried in an hour; the next succeeds
    async def later(ctx: JobContext, payload: Any) -> str:
        if ctx.attempt == 1:
            raise RetryLater(3600, "not yet")
        return "done"

    @orc.job_type("hold")  # runs until the test releases it
    async def hold(ctx: JobContext, payload: Any) -> str:
        await orc.release.wait()  # type: ignore[attr-defined]
        return "held"

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


def orchestrator_cli(dsn: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``orchestrator ARGV`` as an operator runs it: a real process."""
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *argv], capture_output=True, text=True, cwd=ROOT,
        env={**os.environ, "DATABASE_URL": dsn}, timeout=60, check=False,
    )  # fmt: skip


def seen_by_the_api_the_cli_and_the_dashboard(dsn: str, job_id: str) -> None:
    """The job, of tenant acme, through a real ``orchestrator serve`` with tokens made by the
    command line (acme's, and another tenant's: the attacker), and ``orchestrator status``."""
    secrets = {}
    for tenant in ("other", "acme"):  # the attacker first
        made = orchestrator_cli(dsn, "tokens", "create", tenant, "--scope", "read",
                                "--tenant", tenant)  # fmt: skip
        assert made.returncode == 0, made.stderr
        secrets[tenant] = made.stdout.strip()
    with ApiServer(dsn) as server:
        for tenant, secret in secrets.items():
            with httpx.Client(
                base_url=server.url, headers={"Authorization": f"Bearer {secret}"}, timeout=30
            ) as client:
                job, history = (client.get(f"/api/v1/jobs/{job_id}{p}") for p in ("", "/events"))
                if tenant == "other":
                    assert (job.status_code, history.status_code) == (404, 404), job.text
                    continue
                body = job.json()
                assert (job.status_code, body.get("status"), body.get("tenant_id")) == (
                    200, "COMPLETED", "acme",
                ), job.text  # fmt: skip
                kinds = [e["kind"] for e in history.json()["events"]]
                assert kinds[0] == "job.created" and kinds[-1] == "job.completed", kinds
            with ui_session(server, secret) as (browser, _):
                page = browser.get(f"/ui/jobs/{job_id}")
                if tenant == "other":
                    assert page.status_code == 404 and job_id not in page.text
                else:
                    assert page.status_code == 200 and job_id in page.text, page.status_code
    shown = orchestrator_cli(dsn, "status", job_id)
    assert shown.returncode == 0, shown.stderr
    for said in (f"job {job_id}  echo  COMPLETED", "tenant acme", "job.created", "job.completed"):
        assert said in shown.stdout, shown.stdout


async def test_a_job_added_in_a_producers_transaction_is_its_tenants_everywhere(
    compat: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any], dsn: str
) -> None:
    """The API's tenant's job, with its events, in the HTTP API, the command line and the
    dashboard; another tenant's token does not find it."""
    orc = compat(graphile_tenant="acme")
    await orc.migrate()
    await orc.open()
    async with db.transaction():  # the producer's: its own write, and the job
        await db.execute("CREATE TEMP TABLE orders (id integer PRIMARY KEY)")
        await db.execute("INSERT INTO orders VALUES (7)")
        number = await add(db, "echo", payload='{"order": 7}')
    job_id = (await job_of(db, orc, number)).id
    async with WorkerRun(orc) as worker:
        await worker.until_finished(job_id)
    await asyncio.to_thread(seen_by_the_api_the_cli_and_the_dashboard, dsn, str(job_id))


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


async def as_stored(
    db: psycopg.AsyncConnection[Any], orc: Orchestrator, number: int
) -> dict[str, Any]:
    """The job with that Graphile Worker id, in Graphile Worker's columns, as the orchestrator
    stored it (its Python API) and as its dispatch will run it (Procrastinate's row)."""
    job = await job_of(db, orc, number)
    (dispatch,) = await call(
        db,
        "SELECT queue_name, priority, scheduled_at, status FROM procrastinate_jobs WHERE id = %s",
        job.procrastinate_job_id,
    )
    due = job.next_retry_at or job.run_at
    assert dispatch == {
        "queue_name": job.queue, "priority": -job.priority,
        "scheduled_at": due if due > job.updated_at else None, "status": "todo",
    }  # fmt: skip
    serial = "graphile_worker_queue:"
    return {
        "id": number,
        "queue_name": job.flow_key.removeprefix(serial) if job.flow_key else None,
        "task_identifier": job.job_type, "payload": job.payload, "priority": job.priority,
        "run_at": due, "attempts": job.attempt, "max_attempts": job.max_attempts,
        "last_error": job.last_error and job.last_error.message,
        "created_at": job.created_at, "updated_at": job.updated_at, "key": job.job_key,
        "locked_at": None, "locked_by": job.locked_by, "revision": job.revision, "flags": None,
        "is_available": job.status in (Status.PENDING, Status.RETRY),
    }  # fmt: skip


async def test_the_row_add_job_returns_is_the_job_as_stored_and_dispatched(
    compat: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = compat()
    await orc.migrate()
    await orc.open()
    budget = orc.retry_config.for_type("echo").worker_max_attempts
    assert budget != 25  # unset, max_attempts is the type's budget, not Graphile Worker's 25
    at = datetime.now(UTC) + timedelta(hours=1)

    async def added(sql: str, *args: Any) -> list[dict[str, Any]]:
        """The rows the call returns, each the job as stored right after it."""
        rows = await call(db, sql, *args)
        assert rows and [await as_stored(db, orc, r["id"]) for r in rows] == rows
        return rows

    add = "SELECT * FROM graphile_worker.add_job('echo'"
    (bare,) = await added(add + ")")
    (given,) = await added(
        add + ", '{\"a\": 1}', queue_name => 'q', run_at => %s, max_attempts => 4,"
        " job_key => 'k', priority => 3)", at,
    )  # fmt: skip
    assert [(r["max_attempts"], r["queue_name"], r["priority"]) for r in (bare, given)] == [
        (budget, None, 0), (4, "q", 3),
    ]  # fmt: skip
    assert (bare["run_at"], given["run_at"]) == (bare["created_at"], at)
    # A replace without max_attempts gives the job its type's budget again.
    (replaced,) = await added(add + ", '{\"a\": 2}', job_key => 'k')")
    assert (replaced["id"], replaced["max_attempts"], replaced["queue_name"]) == (
        given["id"], budget, None,
    )  # fmt: skip
    # One waiting for its retry is due at its retry's time, which preserve_run_at keeps and a
    # replace moves; its attempts so far stay.
    claimed = "status = 'RUNNING', attempt = 1, lease_token = gen_random_uuid(), locked_by = 'w'"
    await db.execute(f"UPDATE orc_jobs SET {claimed} WHERE number = %s", (given["id"],))
    await db.execute(
        "UPDATE orc_jobs SET status = 'RETRY', next_retry_at = %s, lease_token = NULL,"
        " locked_by = NULL WHERE number = %s", (at + timedelta(hours=1), given["id"]),
    )  # fmt: skip
    (kept,) = await added(add + ", job_key => 'k', job_key_mode => 'preserve_run_at')")
    assert (kept["run_at"], kept["attempts"], kept["max_attempts"]) == (
        at + timedelta(hours=1), 1, budget,
    )  # fmt: skip
    (moved,) = await added(add + ", job_key => 'k', run_at => %s, max_attempts => 5)", at)
    assert (moved["run_at"], moved["attempts"], moved["max_attempts"]) == (at, 1, 5)
    batch = await added(
        "SELECT * FROM graphile_worker.add_jobs(ARRAY["
        " ('echo', NULL, NULL, %s, 6, NULL, NULL, NULL),"
        " ('echo', NULL, 'q', NULL, NULL, 'l', -2, NULL)]::graphile_worker.job_spec[])",
        at,
    )
    assert [(r["max_attempts"], r["queue_name"], r["priority"]) for r in batch] == [
        (6, None, 0), (budget, "q", -2),
    ]  # fmt: skip


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
        ("add_job('echo', job_key => repeat('k', 513))", "22023", "job_key must be 1 to 512"),
        ("add_job('echo', queue_name => repeat('q', 129))", "22023", "queue_name must be 1 to 128"),
        (
            "add_jobs(ARRAY[('echo', NULL, NULL, NULL, NULL, NULL, NULL, NULL),"
            " ('nope', NULL, NULL, NULL, NULL, NULL, NULL, NULL)]::graphile_worker.job_spec[])",
            "22023",
            "unknown job type",
        ),
    ],
    ids=[
        "unknown",
        "mode",
        "flags",
        "nul",
        "priority",
        "tick-key",
        "attempts",
        "key-length",
        "queue-length",
        "batch",
    ],
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


# -- complete_jobs, permanently_fail_jobs, reschedule_jobs ------------------------------------


async def add(db: psycopg.AsyncConnection[Any], identifier: str, **options: Any) -> int:
    """A job added through Graphile Worker's add_job; its Graphile Worker id."""
    named = "".join(f", {name} => %s" for name in options)
    (row,) = await call(
        db, f"SELECT id FROM graphile_worker.add_job(%s{named})", identifier, *options.values()
    )
    number: int = row["id"]
    return number


async def job_of(db: psycopg.AsyncConnection[Any], orc: Orchestrator, number: int) -> Job:
    """The orchestrator's job with that Graphile Worker id, through its Python API."""
    (row,) = await call(db, "SELECT id FROM orc_jobs WHERE number = %s", number)
    return await orc.get_job(row["id"])


async def waiting_dispatches(db: psycopg.AsyncConnection[Any], job: Job) -> int:
    (row,) = await call(
        db,
        "SELECT count(*) AS n FROM procrastinate_jobs WHERE lock = %s AND status = 'todo'",
        str(job.id),
    )
    n: int = row["n"]
    return n


async def status_is(orc: Orchestrator, job_id: Any, status: Status) -> None:
    async def there() -> bool:
        return (await orc.get_job(job_id)).status is status

    await wait_for(there)


async def test_complete_jobs_ends_waiting_jobs_completed_and_ignores_unknown_ids(
    compat: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = compat(graphile_tenant="acme")
    await orc.migrate()
    await orc.open()
    later = datetime.now(UTC) + timedelta(hours=1)
    now, delayed = await add(db, "echo"), await add(db, "echo", run_at=later)
    rows = await call(db, "SELECT * FROM graphile_worker.complete_jobs(%s)", [delayed, now, 9999])
    # each completed job once, as Graphile Worker returns it; the unknown id ignored
    assert [(r["id"], r["is_available"], r["run_at"]) for r in rows] == [
        (now, False, rows[0]["run_at"]), (delayed, False, later),
    ]  # fmt: skip
    for number in (now, delayed):
        job = await job_of(db, orc, number)
        assert (job.status, job.result, job.tenant_id) == (Status.COMPLETED, None, "acme")
        kinds = [(e.kind, e.payload) for e in await orc.job_events(job.id)]
        assert kinds[0][0] == "job.created"
        assert kinds[1:] == [
            ("job.completed", {"attempt": 0, "run": 0, "run_id": None, "worker": None,
                               "duration_ms": None})
        ]  # fmt: skip
        assert await waiting_dispatches(db, job) == 0
    # a finished job stays as it ended: a second call completes nothing
    assert await call(db, "SELECT * FROM graphile_worker.complete_jobs(%s)", [now]) == []
    async with WorkerRun(orc) as worker:  # nothing is left for a worker to run
        echo = await orc.get_job(await orc.submit("echo", {"after": True}))
        await worker.until_finished(echo.id)
    assert orc.ran == [{"after": True}]  # type: ignore[attr-defined]


async def test_permanently_fail_jobs_dead_letters_waiting_jobs_with_the_error_given(
    compat: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = compat()
    await orc.migrate()
    await orc.open()
    retried = await add(db, "later")
    async with WorkerRun(orc):  # its first run: retried in an hour
        await status_is(orc, (await job_of(db, orc, retried)).id, Status.RETRY)
    pending = await add(db, "echo")
    before = {n: await job_of(db, orc, n) for n in (retried, pending)}
    histories = {n: await orc.job_events(job.id) for n, job in before.items()}
    rows = await call(
        db, "SELECT * FROM graphile_worker.permanently_fail_jobs(%s, 'no longer wanted')",
        [pending, retried],
    )  # fmt: skip
    assert [(r["id"], r["last_error"], r["is_available"]) for r in rows] == [
        (retried, "no longer wanted", False), (pending, "no longer wanted", False),
    ]  # fmt: skip
    letters = {letter.job_id: letter for letter in await orc.dead_letters()}
    fault = Fault("no longer wanted", "GRAPHILE_PERMANENTLY_FAILED", ErrorClass.PERMANENT)
    for number, was in before.items():
        job = await job_of(db, orc, number)
        assert (job.status, job.attempt, job.next_retry_at) == (Status.FAILED, was.attempt, None)
        assert await waiting_dispatches(db, job) == 0
        # last_error and job.failed shaped as the orchestrator's own failure no attempt held
        state = JobState.model_validate(was.model_dump() | {"lease_token": None})
        (raw,) = await call(db, "SELECT last_error FROM orc_jobs WHERE id = %s", job.id)
        stored = raw["last_error"]
        assert datetime.fromisoformat(stored.pop("ts")) <= datetime.now(UTC)
        # its max_attempts, the attempt, is stamped by the failure writer (orc_fail_jobs_v1)
        expected = events.last_error(state, fault, terminal=True) | {"max_attempts": was.attempt}
        del expected["ts"]
        assert stored == expected
        letter = letters[job.id]
        assert letter.error.message == "no longer wanted"
        history = await orc.job_events(job.id)
        assert history[: len(histories[number])] == histories[number]
        new = history[len(histories[number]) :]
        assert [e.kind for e in new] == ["job.dead_lettered", "job.failed"]  # nobody notified
        assert new[1].payload == events.failed(state, fault, terminal=True) | {
            "dead_letter_id": str(letter.id),
            "max_attempts": was.attempt,
        }
    (default,) = await call(
        db, "SELECT * FROM graphile_worker.permanently_fail_jobs(%s)", [await add(db, "echo")]
    )
    assert default["last_error"] == "Manually marked as failed"  # Graphile Worker's words
    assert (
        await call(db, "SELECT * FROM graphile_worker.permanently_fail_jobs(%s)", [pending]) == []
    )


async def test_reschedule_jobs_moves_waiting_jobs_and_the_workers_follow(
    compat: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = compat()
    await orc.migrate()
    await orc.open()
    later = datetime.now(UTC) + timedelta(hours=1)
    retried = await add(db, "later")
    async with WorkerRun(orc):  # its first run: retried in an hour
        await status_is(orc, (await job_of(db, orc, retried)).id, Status.RETRY)
    first = await add(db, "echo", payload='{"n": 1}', run_at=later, priority=5)
    second = await add(db, "echo", payload='{"n": 2}', run_at=later, priority=5)
    rows = await call(
        db,
        "SELECT * FROM graphile_worker.reschedule_jobs(%s, run_at => now(), priority => 1,"
        " max_attempts => 4)",
        [second, retried, 9999],
    )
    assert [(r["id"], r["priority"], r["max_attempts"], r["is_available"]) for r in rows] == [
        (retried, 1, 4, True), (second, 1, 4, True),
    ]  # fmt: skip
    assert all(r["run_at"] <= datetime.now(UTC) for r in rows)
    for number in (retried, second):
        job = await job_of(db, orc, number)
        assert (job.priority, job.max_attempts) == (1, 4)
        assert await waiting_dispatches(db, job) == 1  # its new one; the old one is gone
        (event,) = [e for e in await orc.job_events(job.id) if e.kind == "job.rescheduled"]
        assert event.payload["priority"] == 1 and event.payload["max_runs"] == 4
        assert datetime.fromisoformat(event.payload["run_at"]) <= datetime.now(UTC)
    (moved,) = await call(
        db, "SELECT * FROM graphile_worker.reschedule_jobs(%s, run_at => now())", [first]
    )
    assert (moved["priority"], moved["run_at"] <= datetime.now(UTC)) == (5, True)  # kept
    jobs = {n: (await job_of(db, orc, n)).id for n in (retried, first, second)}
    async with WorkerRun(orc, concurrency=1) as worker:
        await worker.until_finished(*jobs.values())
    # due now instead of in an hour; the priority given runs first (lowest first)
    assert orc.ran == [{"n": 2}, {"n": 1}]  # type: ignore[attr-defined]
    assert (await orc.get_job(jobs[retried])).result == "done"


async def test_a_running_job_is_left_to_its_attempt(
    compat: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = compat()
    await orc.migrate()
    await orc.open()
    number = await add(db, "hold")
    job_id = (await job_of(db, orc, number)).id
    async with WorkerRun(orc) as worker:
        await status_is(orc, job_id, Status.RUNNING)
        running = await orc.get_job(job_id)
        history = await orc.job_events(job_id)
        for sql in (
            "complete_jobs(%s)",
            "permanently_fail_jobs(%s, 'stop')",
            "reschedule_jobs(%s, run_at => now() + interval '1 day', priority => 9,"
            " max_attempts => 9)",
        ):
            assert await call(db, f"SELECT * FROM graphile_worker.{sql}", [number]) == []
        still = await orc.get_job(job_id)
        assert still.model_dump(exclude={"updated_at", "heartbeat_at"}) == running.model_dump(
            exclude={"updated_at", "heartbeat_at"}
        )
        assert await orc.job_events(job_id) == history
        orc.release.set()  # type: ignore[attr-defined]
        await worker.until_finished(job_id)
    done = await orc.get_job(job_id)
    assert (done.status, done.result) == (Status.COMPLETED, "held")
    completed = (await orc.job_events(job_id))[-1]
    assert completed.kind == "job.completed" and completed.payload["run_id"] is not None


async def test_another_tenants_job_numbers_change_nothing(
    compat: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    victim = compat(graphile_tenant="victim")
    await victim.migrate()
    await victim.open()
    numbers = [await add(db, "echo") for _ in range(3)]
    await compat().migrate()  # no tenant: another scope
    numbers.append(await add(db, "echo"))
    before = [await job_of(db, victim, n) for n in numbers]
    histories = [await victim.job_events(job.id) for job in before]
    await compat(graphile_tenant="attacker").migrate()  # the attacker's API, with the numbers
    for sql in (
        "complete_jobs(%s)",
        "permanently_fail_jobs(%s, 'pwned')",
        "reschedule_jobs(%s, run_at => now() + interval '1 year', priority => -100,"
        " max_attempts => 1)",
    ):
        assert await call(db, f"SELECT * FROM graphile_worker.{sql}", numbers) == []
    assert [await job_of(db, victim, n) for n in numbers] == before
    assert [await victim.job_events(job.id) for job in before] == histories
    assert await victim.dead_letters() == []
    assert [await waiting_dispatches(db, job) for job in before] == [1, 1, 1, 1]


@pytest.mark.parametrize(
    ("sql", "sqlstate", "says"),
    [
        ("reschedule_jobs(%s, attempts => 0)", "0A000", "attempts cannot be set"),
        ("reschedule_jobs(%s, priority => 40000)", "22003", "smallint"),
        ("reschedule_jobs(%s, max_attempts => 40000)", "22003", "smallint"),
        ("reschedule_jobs(%s, max_attempts => 0)", "22023", "max_attempts must be at least 1"),
        ("permanently_fail_jobs(%s, repeat('x', 2001))", "22023", "at most 2000 characters"),
        ("complete_jobs(%s::text)", "42883", "does not exist"),
    ],
    ids=["attempts", "priority", "max-attempts-range", "max-attempts", "message", "type"],
)
async def test_bad_arguments_to_change_jobs_get_graphile_workers_kind_of_error(
    compat: Callable[..., Orchestrator],
    db: psycopg.AsyncConnection[Any],
    sql: str,
    sqlstate: str,
    says: str,
) -> None:
    orc = compat()
    await orc.migrate()
    await orc.open()
    number = await add(db, "echo", run_at=datetime.now(UTC) + timedelta(hours=1))
    job = await job_of(db, orc, number)
    history = await orc.job_events(job.id)
    with pytest.raises(psycopg.Error) as raised:
        await db.execute(f"SELECT * FROM graphile_worker.{sql}", ([number],))
    assert raised.value.sqlstate == sqlstate
    assert says in str(raised.value)
    assert await orc.get_job(job.id) == job
    assert await orc.job_events(job.id) == history
    assert await waiting_dispatches(db, job) == 1


async def test_graphile_workers_own_client_completes_fails_and_reschedules_jobs(
    compat: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any], dsn: str
) -> None:
    await compat(graphile_tenant="other").migrate()
    foreign = await add(db, "echo")
    orc = compat(graphile_tenant="acme")
    await orc.migrate()
    await orc.open()
    later = datetime.now(UTC) + timedelta(hours=1)
    done, failed, moved = [await add(db, "echo", run_at=later) for _ in range(3)]
    at = (datetime.now(UTC) + timedelta(minutes=5)).replace(microsecond=0)
    calls = [
        ["completeJobs", [done, 9999]],
        ["permanentlyFailJobs", [failed], "gave up"],
        ["rescheduleJobs", [moved], {"runAt": at.isoformat(), "priority": 2, "maxAttempts": 3}],
        ["rescheduleJobs", [moved], {"attempts": 1}],
        ["rescheduleJobs", [moved], {"priority": 70000}],
        ["completeJobs", [foreign]],
        ["permanentlyFailJobs", [done]],
    ]
    answers = await asyncio.to_thread(graphile_producer, dsn, calls)
    completed, fail, reschedule, attempts, priority, attack, again = answers
    # ids as node-postgres reads a bigint, and Graphile Worker's own: strings
    assert [(j["id"], j["is_available"]) for j in completed["ok"]] == [(str(done), False)]
    assert [(j["id"], j["last_error"]) for j in fail["ok"]] == [(str(failed), "gave up")]
    (row,) = reschedule["ok"]
    assert (row["id"], row["priority"], row["max_attempts"]) == (str(moved), 2, 3)
    assert datetime.fromisoformat(row["run_at"].replace("Z", "+00:00")) == at
    assert attempts["error"]["code"] == "0A000"
    assert priority["error"]["code"] == "22003"
    assert attack["ok"] == [] and again["ok"] == []

    states = {n: await job_of(db, orc, n) for n in (done, failed, moved, foreign)}
    assert states[done].status == Status.COMPLETED
    assert states[failed].status == Status.FAILED
    assert states[failed].last_error is not None
    assert [letter.job_id for letter in await orc.dead_letters()] == [states[failed].id]
    assert (states[moved].status, states[moved].priority, states[moved].run_at) == (
        Status.PENDING, 2, at,
    )  # fmt: skip
    assert states[foreign].status == Status.PENDING and states[foreign].tenant_id == "other"
    kinds = {n: [e.kind for e in await orc.job_events(j.id)] for n, j in states.items()}
    assert kinds == {
        done: ["job.created", "job.completed"],
        failed: ["job.created", "job.dead_lettered", "job.failed"],
        moved: ["job.created", "job.rescheduled"],
        foreign: ["job.created"],
    }


async def test_a_job_waiting_for_its_serial_queue_is_completed_or_moved_and_leaves_the_line(
    compat: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = compat()
    await orc.migrate()
    await orc.open()
    first, done, moved = [await add(db, "hold", queue_name="serial") for _ in range(3)]
    ids = {n: (await job_of(db, orc, n)).id for n in (first, done, moved)}
    async with WorkerRun(orc, concurrency=3) as worker:
        await status_is(orc, ids[first], Status.RUNNING)

        async def parked() -> bool:
            return all([(await orc.get_job(ids[n])).waiting_for for n in (done, moved)])

        await wait_for(parked)  # one job of the queue at a time: the others wait in its line
        assert len(await call(db, "SELECT * FROM graphile_worker.complete_jobs(%s)", [done])) == 1
        (row,) = await call(
            db, "SELECT * FROM graphile_worker.reschedule_jobs(%s, priority => 2)", [moved]
        )
        assert row["queue_name"] == "serial"
        orc.release.set()  # type: ignore[attr-defined]
        await worker.until_finished(ids[first], ids[moved])
    assert (await orc.get_job(ids[done])).status is Status.COMPLETED
    assert (await orc.get_job(ids[moved])).result == "held"
    (left,) = await call(db, "SELECT count(*) AS n FROM orc_flow_waiters")
    assert left["n"] == 0
