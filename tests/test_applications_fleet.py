"""Several applications on one database (issue 43, migration 0056), end to end: two
applications, ``a`` and ``b`` (tests/support/app_a.py, app_b.py: their own job types, limits,
schedules and retry configs), each in processes of its own on one database: real worker
processes, a real ``orchestrator serve`` of B, B's ``orchestrator migrate`` and B's config
reload. B's whole deploy leaves A's limits, limited job types, job types, schedules and
declarations as they were; A's LLM jobs stay within A's limit all through it (counted at the
local LLM server); A's Graphile Worker producer adds its job after B's migrate; and a limit B
defines otherwise than A refuses B's worker, naming both applications and what differs, while
A's limit stands."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from demo import llm_server as llm
from orchestrator import Orchestrator
from tests.support import app_a, app_b
from tests.support.api_server import ApiServer
from tests.support.harness import ROOT, wait_for
from tests.support.workers import WorkerProcess

KEY = "sk-test-applications-0123456789"
MODEL = "a-model"
LLM_JOBS = 6

#: What B's refused worker logs (the worker's start fails on it).
REFUSED = r"application 'b' refused: limit 'a_llm' is defined otherwise by application 'a'"

#: A's rows in the shared tables and its declarations, whole (timestamps too: not rewritten).
SNAPSHOT = {
    "limits": "SELECT to_jsonb(r) FROM orc_flow_limits AS r WHERE name = ANY(%(limits)s)"
    " ORDER BY name",
    "limited types": "SELECT to_jsonb(r) FROM orc_flow_job_types AS r"
    " WHERE job_type = ANY(%(types)s) ORDER BY job_type",
    "job types": "SELECT to_jsonb(r) FROM orc_job_types AS r WHERE job_type = ANY(%(types)s)"
    " ORDER BY job_type",
    "schedules": "SELECT jsonb_build_object('name', name, 'job_type', job_type, 'cron', cron,"
    " 'tz', tz, 'tenant_id', tenant_id, 'backfill_seconds', backfill_seconds,"
    " 'defined_at', defined_at, 'paused_at', paused_at)"
    " FROM orc_schedules WHERE name = ANY(%(schedules)s) ORDER BY name",
    "declarations": "SELECT to_jsonb(r) FROM orc_application_definitions AS r"
    " WHERE application = 'a' ORDER BY kind, name",
}


def snapshot_of_a(dsn: str) -> dict[str, list[Any]]:
    params = {
        "limits": list(app_a.LIMITS),
        "types": list(app_a.JOB_TYPES),
        "schedules": list(app_a.SCHEDULES),
    }
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {
            what: [row[0] for row in conn.execute(sql, params).fetchall()]
            for what, sql in SNAPSHOT.items()
        }


def forget_applications(dsn: str) -> None:
    """Every application's declarations and refusals, and Graphile Worker's API, gone: the
    session's database carries them from test to test (clear_tables leaves them), and another
    test's ``default`` may declare a name of A's otherwise (flow_app's ``llm_generate``)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM orc_application_definitions")
        conn.execute("DELETE FROM orc_application_conflicts")
        conn.execute("DROP SCHEMA IF EXISTS graphile_worker CASCADE")
        conn.execute("DELETE FROM orc_schema_migrations WHERE component = 'graphile_worker'")


@pytest.fixture
def database(empty_dsn: str) -> Iterator[str]:
    forget_applications(empty_dsn)
    yield empty_dsn
    forget_applications(empty_dsn)


def environment(application: str, config: Path, **more: Any) -> dict[str, Any]:
    return {
        "ORCHESTRATOR_APPLICATION": application,
        "ORCHESTRATOR_RETRY_CONFIG": config,
        "ORCHESTRATOR_RETRY_CONFIG_POLL_SECONDS": "0.2",
        "ORCHESTRATOR_GRAPHILE_COMPAT": "true",
        **more,
    }


def migrate(dsn: str, app: str, env: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """``orchestrator --app tests.support.APP:orc migrate`` as a deploy runs it."""
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "--app", f"tests.support.{app}:orc", "migrate"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "DATABASE_URL": dsn, **{k: str(v) for k, v in env.items()}},
    )  # fmt: skip


async def rows(conn: psycopg.AsyncConnection[Any], sql: str, *args: Any) -> list[Any]:
    cur = await conn.execute(sql, args)
    return [row if len(row) > 1 else row[0] for row in await cur.fetchall()]


async def declared_by(conn: psycopg.AsyncConnection[Any], application: str) -> set[str]:
    """``kind name`` of each of the application's declarations."""
    found = await rows(
        conn,
        "SELECT kind || ' ' || name FROM orc_application_definitions WHERE application = %s",
        application,
    )
    return set(found)


A_DECLARES = {
    "limit a_llm", "limit a_notes", "limit_of_type llm_generate", "limit_of_type a_note",
    "schedule a_note", "job_type a_note", "job_type llm_generate",
    "graphile graphile_worker",  # A migrates with Graphile Worker's API on
}  # fmt: skip


async def a_is_declared(conn: psycopg.AsyncConnection[Any]) -> None:
    """Until A's migrate and A's worker (limits, limited types, schedule) declared it all, and
    wrote the shared rows."""

    async def whole() -> bool:
        return await declared_by(conn, "a") == A_DECLARES and await rows(
            conn, "SELECT name FROM orc_schedules WHERE name = 'a_note'"
        ) == ["a_note"]

    await wait_for(whole, timeout=60)


async def test_b_s_deploy_leaves_a_as_it_was_and_a_s_llm_jobs_within_a_s_limit(
    database: str, make_orc: Callable[..., Orchestrator], tmp_path: Path
) -> None:
    """A runs (its migrate with Graphile Worker's API, a worker, six LLM jobs queued under its
    limit of one call at a time); B deploys: its migrate, its ``serve``, its worker, then a
    reload of its config (a limit raised, one withdrawn). After each step A's rows and
    declarations are exactly as before (not even rewritten); A's producer adds a job in SQL
    after B's migrate and A's worker runs it; the LLM server never saw two of A's calls at
    once."""
    dsn = database
    a_env = environment("a", app_a.config(tmp_path / "a.toml"))
    b_file = app_b.config(tmp_path / "b.toml")
    b_env = environment("b", b_file)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        with llm.serve(api_key=KEY) as server, contextlib.ExitStack() as stack:
            server.script(MODEL, [llm.Text("a slow but steady answer", chunks=5, every=0.3)])
            migrated = await asyncio.to_thread(migrate, dsn, "app_a", a_env)
            assert migrated.returncode == 0, migrated.stderr
            llm_env = {"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": KEY}
            stack.enter_context(WorkerProcess(dsn, "tests.support.app_a:orc", **a_env, **llm_env))
            await a_is_declared(conn)

            producer = make_orc(application="a", retry_config=a_env["ORCHESTRATOR_RETRY_CONFIG"])
            app_a.register(producer)
            await producer.open()
            ask = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 50,
            }
            ids = [await producer.submit("llm_generate", ask) for _ in range(LLM_JOBS)]

            async def a_call_is_made() -> bool:
                return server.requests[MODEL] > 0

            await wait_for(a_call_is_made, timeout=60)  # B's deploy starts while A's jobs run
            before = await asyncio.to_thread(snapshot_of_a, dsn)
            assert [len(before[what]) for what in SNAPSHOT] == [2, 2, 2, 1, 8], before

            async def a_stands(step: str) -> None:
                assert await asyncio.to_thread(snapshot_of_a, dsn) == before, step

            # B's migrate: its job types declared and written beside A's, Graphile's API kept
            migrated = await asyncio.to_thread(migrate, dsn, "app_b", b_env)
            assert migrated.returncode == 0, migrated.stderr
            assert await declared_by(conn, "b") == {
                "job_type b_report", "job_type b_work", "graphile graphile_worker"
            }  # fmt: skip
            await a_stands("B's migrate")
            [note] = await rows(conn, "SELECT id FROM graphile_worker.add_job('a_note', "
                                      "json_build_object('n', 1))")  # fmt: skip

            async def noted() -> bool:
                return await rows(
                    conn,
                    "SELECT status FROM orc_jobs WHERE number = %s AND job_type = 'a_note'",
                    note,
                ) == ["COMPLETED"]

            await wait_for(noted, timeout=60)  # A's worker ran what A's producer added

            # B's serve: B's limits and schedule declared and written
            b_limits = "SELECT name, concurrency FROM orc_flow_limits WHERE name LIKE 'b\\_%%'"
            server_b = stack.enter_context(ApiServer(dsn, "tests.support.app_b:orc", **b_env))

            async def b_serves() -> bool:
                return await rows(conn, b_limits + " ORDER BY name") == [
                    ("b_extra", 2),
                    ("b_pool", 3),
                ] and await rows(
                    conn, "SELECT name FROM orc_schedules WHERE name = 'b_report'"
                ) == ["b_report"]

            await wait_for(b_serves, timeout=60)
            await a_stands("B's serve")

            # B's worker: it records its application and config version, then declares its
            # limits and schedules (the reload below waits for it to apply the next version)
            stack.enter_context(WorkerProcess(dsn, "tests.support.app_b:orc", **b_env))

            async def b_works() -> bool:
                return await rows(
                    conn, "SELECT application FROM orc_worker_configs WHERE application = 'b'"
                ) == ["b"]

            await wait_for(b_works, timeout=60)
            await a_stands("B's worker")

            # B's reload: b_pool raised, b_extra withdrawn, once both of B's processes run it
            app_b.config(b_file, pool=5, extra=False)

            async def reloaded() -> bool:
                return await rows(conn, b_limits) == [("b_pool", 5)]

            await wait_for(reloaded, timeout=60)
            assert "limit b_extra" not in await declared_by(conn, "b")
            await a_stands("B's reload")

            async def a_done() -> bool:
                statuses = await rows(conn, "SELECT status FROM orc_jobs WHERE id = ANY(%s)", ids)
                return statuses == ["COMPLETED"] * LLM_JOBS

            await wait_for(a_done, timeout=90)
            assert server.requests[MODEL] == LLM_JOBS
            assert server.max_in_flight == 1  # A's limit held through B's whole deploy
            await a_stands("the end")
            assert server_b.process.poll() is None


@pytest.mark.logs_errors(REFUSED)
async def test_a_limit_b_defines_otherwise_refuses_b_s_worker_and_a_s_limit_stands(
    database: str, tmp_path: Path
) -> None:
    """B's config defines A's limit ``a_llm`` with a concurrency of 4 (A's: 1): B's worker
    exits non-zero saying that application 'b' is refused because application 'a' defines
    'a_llm' otherwise, with the concurrency each gives; the refusal is recorded; A's limit,
    and everything of A's, stands; B declared no limit."""
    dsn = database
    a_env = environment("a", app_a.config(tmp_path / "a.toml"))
    clash = '\n[limits.a_llm]\nkey = "a_llm:{payload.model}"\nconcurrency = 4\n'
    b_env = environment("b", app_b.config(tmp_path / "b.toml", more=clash))
    migrated = await asyncio.to_thread(migrate, dsn, "app_a", a_env)
    assert migrated.returncode == 0, migrated.stderr
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        with WorkerProcess(dsn, "tests.support.app_a:orc", **a_env) as worker_a:
            await a_is_declared(conn)
            before = await asyncio.to_thread(snapshot_of_a, dsn)
            with WorkerProcess(dsn, "tests.support.app_b:orc", **b_env) as worker_b:
                code = await asyncio.to_thread(worker_b.wait, 60)
                said = worker_b.output()
            assert code != 0, said
            assert REFUSED.replace("\\", "") in said, said
            assert "concurrency: 4 here, 1 there" in said, said
            refusals = await rows(
                conn, "SELECT application, kind, name, other, difference"
                " FROM orc_application_conflicts"
            )  # fmt: skip
            assert refusals == [("b", "limit", "a_llm", "a", {"concurrency": [4, 1]})]
            assert await asyncio.to_thread(snapshot_of_a, dsn) == before
            assert await rows(
                conn, "SELECT concurrency FROM orc_flow_limits WHERE name = 'a_llm'"
            ) == [1]
            assert not {d for d in await declared_by(conn, "b") if d.startswith("limit")}
            assert worker_a.process.poll() is None  # A's worker goes on


async def test_a_s_worker_leaves_b_s_jobs_waiting_for_b_s_workers(
    database: str, tmp_path: Path
) -> None:
    """A worker listening on every queue leaves those of another application's job types
    (docs/applications.md): A's worker alone, B's jobs (B's types, declared by B's migrate)
    added before A's: A's worker runs A's job, and B's wait unclaimed, no attempt spent, until
    a worker of B's is back (failed before: A's worker claimed them, and each attempt died with
    ``KeyError: 'b_work'``)."""
    dsn = database
    a_env = environment("a", app_a.config(tmp_path / "a.toml"))
    b_env = environment("b", app_b.config(tmp_path / "b.toml"))
    for app, env in (("app_a", a_env), ("app_b", b_env)):
        migrated = await asyncio.to_thread(migrate, dsn, app, env)
        assert migrated.returncode == 0, migrated.stderr
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        works = [
            (await rows(conn, "SELECT id FROM graphile_worker.add_job('b_work', '{}'::json)"))[0]
            for _ in range(3)
        ]
        [note] = await rows(conn, "SELECT id FROM graphile_worker.add_job('a_note', '{}'::json)")
        with WorkerProcess(dsn, "tests.support.app_a:orc", **a_env):

            async def noted() -> bool:
                return await rows(conn, "SELECT status FROM orc_jobs WHERE number = %s", note) == [
                    "COMPLETED"
                ]

            await wait_for(noted, timeout=60)  # A's worker fetched past B's jobs
            b_jobs = await rows(
                conn,
                "SELECT status, attempt, (SELECT array_agg(kind ORDER BY id) FROM orc_job_events"
                " AS e WHERE e.job_id = j.id) FROM orc_jobs AS j WHERE number = ANY(%s)",
                works,
            )
            assert b_jobs == [("PENDING", 0, ["job.created"])] * 3, b_jobs


async def test_b_s_migrate_leaves_a_s_graphile_producer_api_as_a_set_it(
    database: str, tmp_path: Path
) -> None:
    """Graphile Worker's API is one per database, with one row of settings: each application
    migrating with it on declares it with its settings (docs/applications.md). B's migrate with
    other settings (no tenant, where A's jobs get tenant-a) is refused, naming both applications
    and the tenant, and A's settings stand; B's migrate without the API leaves it to A; the
    schema goes once no application declares it (A's own migrate without it)."""
    dsn = database
    a_env = environment("a", app_a.config(tmp_path / "a.toml"))
    a_env["ORCHESTRATOR_GRAPHILE_TENANT"] = "tenant-a"
    b_env = environment("b", app_b.config(tmp_path / "b.toml"))
    without_api = {k: v for k, v in b_env.items() if k != "ORCHESTRATOR_GRAPHILE_COMPAT"}
    tenant = "SELECT tenant_id FROM graphile_worker._orc_settings"
    schema = "SELECT count(*) FROM pg_namespace WHERE nspname = 'graphile_worker'"
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        migrated = await asyncio.to_thread(migrate, dsn, "app_a", a_env)
        assert migrated.returncode == 0, migrated.stderr
        assert await rows(conn, tenant) == ["tenant-a"]
        migrated = await asyncio.to_thread(migrate, dsn, "app_b", b_env)
        assert migrated.returncode == 2, migrated.stderr
        for said in ("application 'b' refused", "graphile 'graphile_worker'",
                     "application 'a'", "tenant_id"):  # fmt: skip
            assert said in migrated.stderr, migrated.stderr
        assert "Traceback" not in migrated.stderr
        assert await rows(conn, tenant) == ["tenant-a"], "B's migrate changed A's tenant"
        migrated = await asyncio.to_thread(migrate, dsn, "app_b", without_api)
        assert migrated.returncode == 0, migrated.stderr
        assert await rows(conn, schema) == [1], "B's migrate dropped A's Graphile API"
        assert await rows(conn, tenant) == ["tenant-a"]
        a_without = {k: v for k, v in a_env.items() if k != "ORCHESTRATOR_GRAPHILE_COMPAT"}
        migrated = await asyncio.to_thread(migrate, dsn, "app_a", a_without)
        assert migrated.returncode == 0, migrated.stderr
        assert await rows(conn, schema) == [0]
