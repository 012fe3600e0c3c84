"""A rolling deploy (docs/operations.md, "Rollout contract"): the previous release's worker
(tests/support/previous_release.py), a real process of its own code, on today's schema writes
what today's readers expect; and today's worker, API server and migrate, and the previous
release's worker, refuse a schema newer than they know unless every migration since is marked
compatible with older workers, as recorded when it was applied."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import psycopg
import pytest

from orchestrator import Orchestrator, Status
from orchestrator.domain.errors import MigrationError, SchemaTooNew
from orchestrator.domain.principals import Scope
from orchestrator.storage.database import drop_database, ensure_database, with_database
from orchestrator.storage.migrate import Migration, definitions, migrate, own_migrations, release
from tasks import register_all
from tests.support import previous_release
from tests.support.api_server import ApiServer, token
from tests.support.harness import free_port, settings_for_tests, wait_for
from tests.support.workers import WorkerProcess, wait_until

ROOT = Path(__file__).resolve().parent.parent
#: A job of a type both releases have that fails for good at its first attempt: the path passes
#: the payload's model, the tool refuses it (PermanentError, TOOL_PATH_INVALID).
LEAVES_THE_WORKSPACE = {"tool": "file_write", "args": {"path": "../outside", "content": "x"}}


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return previous_release.checkout(tmp_path_factory.mktemp("previous-release"))


@pytest.fixture
def fresh_dsn(server_dsn: str) -> Iterator[str]:
    """A database of its own, migrated by today's code: these tests write its migrations table."""
    name = f"orc_rollout_{uuid.uuid4().hex[:10]}"
    ensure_database(server_dsn, name)
    dsn = with_database(server_dsn, name)

    async def migrated() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await migrate(conn)

    asyncio.run(migrated())
    yield dsn
    drop_database(server_dsn, name)


@pytest.fixture
async def orc(fresh_dsn: str) -> AsyncIterator[Orchestrator]:
    made = Orchestrator(settings=settings_for_tests(), dsn=fresh_dsn)
    register_all(made)
    async with made:
        yield made


async def test_the_previous_release_s_worker_dead_letters_a_job_with_its_tenant(
    previous: Path, fresh_dsn: str, orc: Orchestrator, tmp_path: Path
) -> None:
    job_id = await orc.submit("execute_tool", LEAVES_THE_WORKSPACE, tenant_id="acme")
    old = previous_release.start(
        previous, fresh_dsn, "worker", "--concurrency", "2",
        env={"ORCHESTRATOR_FETCH_POLLING_INTERVAL": "0.5", "ORCHESTRATOR_HEALTH_PORT": "0",
             "ORCHESTRATOR_TOOL_WORKSPACE": str(tmp_path / "workspace")},
    )  # fmt: skip
    try:
        for _ in range(600):
            if (await orc.get_job(job_id)).status is Status.FAILED or old.poll() is not None:
                break
            await asyncio.sleep(0.05)
    finally:
        old.terminate()
        _, log = old.communicate(timeout=60)
    assert (await orc.get_job(job_id)).status is Status.FAILED, log
    assert "TOOL_PATH_INVALID" in log  # the old worker failed it, with its own SQL

    [letter] = await orc.dead_letters(tenant_id="acme")
    assert (letter.job_id, letter.tenant_id) == (job_id, "acme")
    secret = await token(orc.stores.tokens, "acme-reader", Scope.READ, tenants=["acme"])
    with ApiServer(fresh_dsn) as server:
        async with httpx.AsyncClient(
            base_url=server.url, headers={"Authorization": f"Bearer {secret}"}, timeout=30
        ) as client:
            listed = (await client.get("/api/v1/dead-letters")).json()["dead_letters"]
            assert [d["id"] for d in listed] == [str(letter.id)]
            one = await client.get(f"/api/v1/dead-letters/{letter.id}")
            assert one.status_code == 200 and one.json()["tenant_id"] == "acme"

    # The previous release's requeue submits the replay without a tenant: it takes the letter's.
    requeued = previous_release.run(previous, fresh_dsn, "dlq", "requeue", str(letter.id))
    assert requeued.returncode == 0, requeued.stderr
    replay = await orc.get_job(requeued.stdout.split()[0])
    assert (replay.replay_of, replay.tenant_id) == (letter.id, "acme")
    [created] = [e.payload for e in await orc.job_events(replay.id) if e.kind == "job.created"]
    assert created["tenant_id"] == "acme"

    # Its events carry the counters docs/contracts.md lists, taken from the job row.
    job = await orc.get_job(job_id)
    failed = [e.payload for e in await orc.job_events(job_id) if e.kind == "job.failed"]
    [running] = [e.payload for e in await orc.job_events(job_id) if e.kind == "job.running"]
    keys = ("attempt", "run", "max_runs", "retry_count", "max_retries", "layer", "backoff_ms",
            "dead_letter_id", "worker", "run_id")  # fmt: skip
    assert [{k: payload.get(k, "absent") for k in keys} for payload in failed] == [
        {"attempt": 1, "run": 1, "max_runs": job.max_attempts, "retry_count": 0,
         "max_retries": job.max_retries, "layer": None, "backoff_ms": None,
         "dead_letter_id": str(letter.id), "worker": running["worker"],
         "run_id": running["run_id"]}
    ]  # fmt: skip
    assert running["worker"] and running["run_id"]


async def test_the_maintenance_ticks_run_beside_the_previous_release(
    previous: Path, fresh_dsn: str, orc: Orchestrator, tmp_path: Path
) -> None:
    """The documented roll (migrate, then roll): a worker of the previous release and one of
    this release share the maintenance queue, each deferring and fetching ticks every second.
    Every tick ends well, whichever worker takes it: none ends failed ("no task named"), and
    the rollups advance."""
    every_second = {
        f"ORCHESTRATOR_{name}_CRON": "* * * * * *" for name in ("ROLLUP", "RETENTION", "PRUNE")
    }
    old = previous_release.start(
        previous, fresh_dsn, "worker", "--concurrency", "2",
        env={"ORCHESTRATOR_FETCH_POLLING_INTERVAL": "0.5", "ORCHESTRATOR_HEALTH_PORT": "0",
             **every_second},
    )  # fmt: skip
    try:
        with WorkerProcess(fresh_dsn, **every_second) as new:

            async def twenty_ticks() -> bool:
                async with await psycopg.AsyncConnection.connect(fresh_dsn) as conn:
                    cur = await conn.execute(
                        "SELECT count(*) FILTER (WHERE status = 'succeeded'),"
                        " count(*) FILTER (WHERE status = 'failed')"
                        " FROM procrastinate_jobs WHERE queue_name = 'maintenance'"
                    )
                    done, failed = await cur.fetchone() or (0, 0)
                assert failed == 0, new.output()
                return done >= 20

            await wait_for(twenty_ticks, timeout=120)
            new.signal(signal.SIGTERM)
            assert new.wait(timeout=60) == 0, new.output()
            new_log = new.output()
    finally:
        old.terminate()
        _, log = old.communicate(timeout=60)
    assert "no task named" not in log + new_log, log + new_log
    async with await psycopg.AsyncConnection.connect(fresh_dsn) as conn:
        cur = await conn.execute("SELECT rolled_up_to FROM orc_rollup_watermark")
        assert (await cur.fetchone() or (None,))[0] is not None


async def _record_unknown(dsn: str, *, compatible: bool) -> None:
    """A migration a newer release applied (this code has no file of it)."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO orc_schema_migrations"
            " (component, version, name, checksum, compatible_with_older_workers)"
            " VALUES ('orchestrator', '9999', 'from_the_future', 'x', %s)"
            " ON CONFLICT (component, version)"
            " DO UPDATE SET compatible_with_older_workers = excluded.compatible_with_older_workers",
            (compatible,),
        )


def _one_line_naming_the_migration(output: str) -> None:
    assert "Traceback" not in output, output
    named = [line for line in output.splitlines() if "9999_from_the_future" in line]
    assert len(named) == 1 and named[0].startswith("error: the database schema is newer"), output


async def test_a_worker_refuses_a_newer_schema_unless_its_migrations_are_compatible(
    fresh_dsn: str,
) -> None:
    await _record_unknown(fresh_dsn, compatible=False)
    with WorkerProcess(fresh_dsn) as refused:
        assert refused.wait(timeout=60) != 0
        _one_line_naming_the_migration(refused.output())

    await _record_unknown(fresh_dsn, compatible=True)
    with WorkerProcess(fresh_dsn) as worker:
        wait_until(lambda: " started: " in worker.output(), timeout=60, what="the worker's start")
        assert "9999_from_the_future, marked compatible with older workers" in worker.output()
        worker.signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0, worker.output()


async def test_the_previous_release_s_worker_refuses_a_newer_schema_unless_compatible(
    previous: Path, fresh_dsn: str
) -> None:
    """The release before checks the markers too, so a roll can rely on it."""
    await _record_unknown(fresh_dsn, compatible=False)
    refused = await asyncio.to_thread(
        previous_release.run, previous, fresh_dsn, "worker", env={"ORCHESTRATOR_HEALTH_PORT": "0"}
    )
    assert refused.returncode != 0
    _one_line_naming_the_migration(refused.stdout + refused.stderr)


def test_the_api_server_refuses_a_newer_schema_in_one_line(fresh_dsn: str) -> None:
    asyncio.run(_record_unknown(fresh_dsn, compatible=False))
    served = subprocess.run(
        [sys.executable, "-m", "orchestrator", "serve", "--port", str(free_port())],
        cwd=ROOT, env={**os.environ, "DATABASE_URL": fresh_dsn},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert served.returncode != 0
    _one_line_naming_the_migration(served.stdout + served.stderr)


async def test_migrate_refuses_a_newer_schema_and_records_each_marker(fresh_dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(fresh_dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT version, compatible_with_older_workers FROM orc_schema_migrations"
            " WHERE component = 'orchestrator'"
        )
        recorded = dict(await cur.fetchall())
        assert recorded == {m.version: m.compatible_with_older_workers for m in own_migrations()}
        assert recorded["0023"] is True
        await _record_unknown(fresh_dsn, compatible=False)
        with pytest.raises(SchemaTooNew, match="9999_from_the_future"):
            await migrate(conn)
        await _record_unknown(fresh_dsn, compatible=True)
        await conn.execute("DELETE FROM orc_state_transitions WHERE to_status = 'CANCELLED'")
        assert (await migrate(conn)).applied == []
        cur = await conn.execute(
            "SELECT count(*) FROM orc_state_transitions WHERE to_status = 'CANCELLED'"
        )
        assert await cur.fetchone() == (0,)  # the newer release's state machine, left alone


@pytest.mark.parametrize(
    ("text", "compatible"),
    [
        ("-- 0042_x: a note\n--\n-- compatible-with-older-workers: yes\n\nSELECT 1;\n", True),
        ("-- compatible-with-older-workers: no\nSELECT 1;\n", False),
        ("SELECT 1;\n", False),  # a file that does not say is not
        ("-- compatible-with-older-workers: yes, mostly\nSELECT 1;\n", False),
        ("SELECT 1; -- compatible-with-older-workers: yes\n", False),
    ],
)
def test_the_marker_is_one_line_of_the_file(text: str, compatible: bool) -> None:
    assert Migration("0042", "x", text).compatible_with_older_workers is compatible


def test_a_file_that_says_it_twice_is_refused() -> None:
    twice = "-- compatible-with-older-workers: yes\n-- compatible-with-older-workers: no\n"
    with pytest.raises(MigrationError, match="more than once"):
        _ = Migration("0042", "x", twice).compatible_with_older_workers


def _orchestrator(dsn: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """Today's ``orchestrator ARGV``, a real process, on the database ``dsn``."""
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *argv],
        cwd=ROOT, env={**os.environ, "DATABASE_URL": dsn},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def _rows(dsn: str, query: str) -> list[tuple[object, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return list(conn.execute(query).fetchall())  # type: ignore[arg-type]


async def test_migrate_plan_on_the_previous_release_s_database(
    previous: Path, server_dsn: str
) -> None:
    """The roll, planned: a database the previous release migrated, its worker running. The
    plan names every migration and function file since, each migration with its marker, and
    that worker as an older release that records no version; it changes nothing; migrate then
    applies exactly what it named, and a worker of today records its release."""
    name = f"orc_plan_{uuid.uuid4().hex[:10]}"
    ensure_database(server_dsn, name)
    dsn = with_database(server_dsn, name)
    try:
        migrated = await asyncio.to_thread(previous_release.run, previous, dsn, "migrate")
        assert migrated.returncode == 0, migrated.stderr
        known = {v for (v,) in _rows(dsn, "SELECT version FROM orc_schema_migrations"
                                          " WHERE component = 'orchestrator'")}  # fmt: skip
        old = previous_release.start(previous, dsn, "worker", env={"ORCHESTRATOR_HEALTH_PORT": "0"})
        try:
            wait_until(
                lambda: old.poll() is not None
                or _rows(dsn, "SELECT count(*) FROM orc_worker_configs") == [(1,)],
                timeout=60, what="the previous release's worker's registration",
            )  # fmt: skip
            assert old.poll() is None, old.communicate()
            before = _rows(dsn, "SELECT * FROM orc_schema_migrations ORDER BY 1, 2")

            planned = _orchestrator(dsn, "migrate", "--plan", "--json")
            assert planned.returncode == 0, planned.stderr
            plan = json.loads(planned.stdout)
            pending = [m for m in own_migrations() if m.version not in known]
            assert pending and pending[-1].version == release() == plan["release"]
            assert plan["migrations"] == [
                {"name": f"{m.version}_{m.name}",
                 "compatible_with_older_workers": m.compatible_with_older_workers}
                for m in pending
            ]  # fmt: skip
            assert plan["functions"] == [f"functions/{f.name}.sql" for f in definitions()]
            assert plan["nothing_to_do"] is False and plan["newer"] == []
            [worker] = plan["workers"]
            assert (worker["release"], worker["older"]) == (None, True)

            text = _orchestrator(dsn, "migrate", "--plan")
            assert text.returncode == 0, text.stderr
            lines = text.stdout.splitlines()
            assert lines[0] == f"migrate to release {release()} would:"
            assert "  apply migration 0058_worker_releases (compatible with older workers)" in lines
            assert any(line.startswith("  apply functions/") for line in lines)
            assert f"  worker {worker['id']} ({worker['worker']}): an older release (records no" \
                " version)" in lines  # fmt: skip
            assert _orchestrator(dsn, "migrate", "--check").returncode == 3

            # The plans changed nothing: no migration recorded, no column added.
            assert _rows(dsn, "SELECT * FROM orc_schema_migrations ORDER BY 1, 2") == before
            assert _rows(dsn, "SELECT to_jsonb(c) ? 'schema_version' FROM orc_worker_configs c") \
                == [(False,)]  # fmt: skip

            # migrate applies what the plan named, and nothing is left to do.
            applied = _orchestrator(dsn, "migrate")
            assert applied.returncode == 0, applied.stderr
            assert applied.stdout.strip() == "applied: " + ", ".join(
                m["name"] for m in plan["migrations"]
            )
            assert _orchestrator(dsn, "migrate", "--check").returncode == 0

            with WorkerProcess(dsn) as today:
                wait_until(
                    lambda: _rows(dsn, "SELECT count(*) FROM orc_worker_configs"
                                       " WHERE schema_version IS NOT NULL") == [(1,)],
                    timeout=60, what="today's worker's registration",
                )  # fmt: skip
                replanned = _orchestrator(dsn, "migrate", "--plan", "--json")
                assert replanned.returncode == 0, replanned.stderr
                workers = json.loads(replanned.stdout)["workers"]
                assert sorted((w["release"] or "", w["older"]) for w in workers) == [
                    ("", True), (release(), False)
                ], today.output()  # fmt: skip
        finally:
            old.terminate()
            old.communicate(timeout=60)
    finally:
        drop_database(server_dsn, name)


async def test_migrate_plan_on_a_newer_release_s_database(fresh_dsn: str) -> None:
    """A newer release migrated the database: compatibly, the plan says so and that migrate
    would do nothing; incompatibly, it refuses in one line, as migrate does."""
    await _record_unknown(fresh_dsn, compatible=True)
    planned = _orchestrator(fresh_dsn, "migrate", "--plan", "--json")
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    assert plan["newer"] == [
        {"name": "9999_from_the_future", "compatible_with_older_workers": True}
    ]
    assert plan["nothing_to_do"] is True and plan["state_machine"] is None
    text = _orchestrator(fresh_dsn, "migrate", "--plan").stdout.splitlines()
    assert text[0].startswith("nothing to do")
    assert text[1].startswith("a newer release migrated this database (9999_from_the_future")

    await _record_unknown(fresh_dsn, compatible=False)
    refused = _orchestrator(fresh_dsn, "migrate", "--plan")
    assert refused.returncode == 2 and refused.stdout == ""
    _one_line_naming_the_migration(refused.stderr)
