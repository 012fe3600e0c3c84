"""orchestrator migrate: idempotent, upgrades older databases in order, refuses edited history."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from orchestrator.domain.errors import MigrationError
from orchestrator.domain.states import transition_rows
from orchestrator.storage.database import drop_database, ensure_database, with_database
from orchestrator.storage.migrate import (
    PROCRASTINATE,
    migrate,
    own_migrations,
    procrastinate_migrations,
)

ROOT = Path(__file__).resolve().parent.parent
PACKAGED = (
    Path(__file__).resolve().parent.parent / "orchestrator" / "storage" / "sql" / "migrations"
)
OURS = [f"{m.version}_{m.name}" for m in own_migrations()]


@pytest.fixture
def fresh_dsn(server_dsn: str) -> Iterator[str]:
    name = f"orc_migrate_{uuid.uuid4().hex[:10]}"
    ensure_database(server_dsn, name)
    yield with_database(server_dsn, name)
    drop_database(server_dsn, name)


async def connect(dsn: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(dsn, autocommit=True)


async def recorded(conn: psycopg.AsyncConnection[Any]) -> list[tuple[str, str]]:
    cur = await conn.execute("SELECT component, version FROM orc_schema_migrations ORDER BY 1, 2")
    return [(r[0], r[1]) for r in await cur.fetchall()]


async def event_triggers(conn: psycopg.AsyncConnection[Any]) -> dict[str, str]:
    """Procrastinate's triggers that write procrastinate_events, and whether each is enabled
    ('O') or disabled ('D'): 0009 disables them all."""
    cur = await conn.execute(
        "SELECT t.tgname, t.tgenabled FROM pg_trigger AS t JOIN pg_proc AS p ON p.oid = t.tgfoid"
        " WHERE t.tgrelid = 'procrastinate_jobs'::regclass"
        "   AND pg_get_functiondef(p.oid) LIKE '%INSERT INTO procrastinate_events%'"
    )
    return dict(await cur.fetchall())


EVENT_TRIGGERS_OFF = {
    "procrastinate_trigger_status_events_insert_v1": "D",
    "procrastinate_trigger_status_events_update_v1": "D",
    "procrastinate_trigger_scheduled_events_v1": "D",
    "procrastinate_trigger_abort_requested_events_v1": "D",
}


async def test_migrate_twice_applies_everything_once(fresh_dsn: str) -> None:
    async with await connect(fresh_dsn) as conn:
        first = await migrate(conn)
        assert first.applied == ["procrastinate schema", *OURS]
        before = await recorded(conn)
        second = await migrate(conn)
        assert second.applied == [] and str(second) == "database is up to date"
        assert await recorded(conn) == before
        assert await event_triggers(conn) == EVENT_TRIGGERS_OFF
    assert ("orchestrator", "0001") in before
    assert len([c for c, _ in before if c == PROCRASTINATE]) == len(procrastinate_migrations())


async def test_two_pods_migrating_at_once_take_turns(fresh_dsn: str) -> None:
    async with await connect(fresh_dsn) as a, await connect(fresh_dsn) as b:
        reports = await asyncio.gather(migrate(a), migrate(b))
    assert sorted(len(r.applied) for r in reports) == [0, 1 + len(OURS)]


async def test_an_older_database_gets_only_the_newer_migrations(
    fresh_dsn: str, tmp_path: Path
) -> None:
    older = tmp_path / "v1"
    older.mkdir()
    shutil.copy(PACKAGED / "0001_core.sql", older)
    newer = tmp_path / "v2"
    shutil.copytree(older, newer)
    (newer / "0002_add_note.sql").write_text("ALTER TABLE orc_jobs ADD COLUMN note text;\n")
    async with await connect(fresh_dsn) as conn:
        await migrate(conn, folder=older)
        report = await migrate(conn, folder=newer)
        assert report.applied == ["0002_add_note"]
        cur = await conn.execute("SELECT note FROM orc_jobs LIMIT 0")
        assert [c.name for c in cur.description or []] == ["note"]


async def test_an_edited_migration_is_refused_and_nothing_changes(
    fresh_dsn: str, tmp_path: Path
) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy(PACKAGED / "0001_core.sql", folder)
    async with await connect(fresh_dsn) as conn:
        await migrate(conn, folder=folder)
        (folder / "0001_core.sql").write_text(
            (folder / "0001_core.sql").read_text() + "\n-- edited\n"
        )
        (folder / "0002_more.sql").write_text("CREATE TABLE orc_should_not_exist (x int);\n")
        with pytest.raises(MigrationError, match="0001_core was changed after it was applied"):
            await migrate(conn, folder=folder)
        cur = await conn.execute("SELECT to_regclass('orc_should_not_exist')")
        assert (await cur.fetchone()) == (None,)


def test_badly_named_migration_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "2_oops.sql").write_text("SELECT 1;")
    with pytest.raises(MigrationError, match=r"not named NNNN_name\.sql"):
        own_migrations(tmp_path)


async def test_an_older_procrastinate_schema_is_upgraded_in_order(fresh_dsn: str) -> None:
    files = procrastinate_migrations()
    cut = next(i for i, m in enumerate(files) if m.version.startswith("03.02"))
    async with await connect(fresh_dsn) as conn:
        # A database built by Procrastinate's own migrations up to 3.1, recorded as such.
        await conn.execute(
            "CREATE TABLE orc_schema_migrations (component text, version text, name text, "
            "checksum text, applied_at timestamptz DEFAULT now(), PRIMARY KEY (component, version))"
        )
        for m in files[:cut]:
            await conn.execute(m.sql.encode())
            await conn.execute(
                "INSERT INTO orc_schema_migrations VALUES ('procrastinate', %s, %s, %s)",
                (m.version, m.name, m.checksum),
            )
        cur = await conn.execute(
            "SELECT to_regprocedure('procrastinate_retry_job_v2(bigint, timestamptz, integer, varchar, varchar)')"
        )
        assert (await cur.fetchone()) == (None,)
        report = await migrate(conn)
        assert report.applied == [f"procrastinate {m.name}" for m in files[cut:]] + OURS
        cur = await conn.execute(
            "SELECT to_regprocedure('procrastinate_retry_job_v2(bigint, timestamptz, integer, varchar, varchar)')"
        )
        assert (await cur.fetchone()) != (None,)
        assert await event_triggers(conn) == EVENT_TRIGGERS_OFF
        assert own_migrations()[0].version == "0001"


async def test_a_database_at_0015_keeps_its_jobs_and_takes_tenants_after_0016(
    fresh_dsn: str, tmp_path: Path
) -> None:
    """0016 alters the spec type and replaces functions a live session has already run: the
    same connection submits a job before the upgrade and a tenant's job after it."""
    older = tmp_path / "0015"
    older.mkdir()
    for path in PACKAGED.glob("*.sql"):
        if path.name < "0016":
            shutil.copy(path, older)

    async def submit(conn: psycopg.AsyncConnection[Any], **spec: Any) -> uuid.UUID:
        spec = {"ord": 0, "id": str(uuid.uuid4()), "job_type": "t", "queue": "t", "priority": 0,
                "max_attempts": 1, "max_retries": 0, "trace_id": "x", **spec}  # fmt: skip
        cur = await conn.execute(
            "SELECT job_id FROM orc_submit_jobs_v2(%s, 'PENDING', ARRAY['PENDING'], 'orc.')",
            (Jsonb([spec]),),
        )
        row = await cur.fetchone()
        assert row is not None
        return uuid.UUID(str(row[0]))

    async with await connect(fresh_dsn) as conn:
        await migrate(conn, folder=older)
        before = await submit(conn)
        report = await migrate(conn)
        assert report.applied == [name for name in OURS if name >= "0016"]
        after = await submit(conn, tenant_id="acme")
        cur = await conn.execute(
            "SELECT c.tenant_id FROM orc_jobs AS j, orc_claim_v1(j.id, j.procrastinate_job_id,"
            " 1, 'w', ARRAY['PENDING'], 'RUNNING') AS c WHERE j.id = %s",
            (after,),
        )
        assert await cur.fetchall() == [("acme",)]  # the claim carries it to the attempt
        cur = await conn.execute(
            "SELECT id, tenant_id FROM orc_jobs ORDER BY tenant_id NULLS FIRST"
        )
        assert await cur.fetchall() == [(before, None), (after, "acme")]


async def test_a_database_at_0020_keeps_its_job_keys_and_scopes_them_by_tenant_after_0021(
    fresh_dsn: str, tmp_path: Path
) -> None:
    """0021 moves the live keys to a uniqueness per tenant: every keyed job keeps its key, and
    the connection that submitted them before the upgrade finds them in their own scope after
    it, while another tenant (or no tenant) gets a job of its own."""
    older = tmp_path / "0020"
    older.mkdir()
    for path in PACKAGED.glob("*.sql"):
        if path.name < "0021":
            shutil.copy(path, older)

    async def submit(
        conn: psycopg.AsyncConnection[Any], key: str, tenant: str | None, mode: str = "replace"
    ) -> tuple[uuid.UUID, str]:
        spec = {"ord": 0, "id": str(uuid.uuid4()), "job_type": "t", "queue": "t", "priority": 0,
                "max_attempts": 1, "max_retries": 0, "trace_id": "x", "job_key": key,
                "job_key_mode": mode, "tenant_id": tenant, "payload": {"by": tenant}}  # fmt: skip
        cur = await conn.execute(
            "SELECT job_id, outcome"
            "  FROM orc_submit_jobs_v2(%s, 'PENDING', ARRAY['PENDING'], 'orc.')",
            (Jsonb([spec]),),
        )
        row = await cur.fetchone()
        assert row is not None
        return uuid.UUID(str(row[0])), row[1]

    async def keys(conn: psycopg.AsyncConnection[Any]) -> list[tuple[Any, ...]]:
        cur = await conn.execute("SELECT id, tenant_id, job_key, payload FROM orc_jobs ORDER BY id")
        return await cur.fetchall()

    async with await connect(fresh_dsn) as conn:
        await migrate(conn, folder=older)
        finished, _ = await submit(conn, "report", "acme")
        await conn.execute(  # a finished job keeps its key, as history
            "UPDATE orc_jobs SET status = 'CANCELLED' WHERE id = %s", (finished,)
        )
        acme, _ = await submit(conn, "report", "acme")
        nobody, _ = await submit(conn, "daily", None)
        before = await keys(conn)
        report = await migrate(conn)
        assert report.applied == [name for name in OURS if name >= "0021"]
        assert await keys(conn) == before  # every key where it was
        assert await submit(conn, "report", "acme") == (acme, "replaced")
        assert await submit(conn, "daily", None, "unsafe_dedupe") == (nobody, "deduplicated")
        globex, outcome = await submit(conn, "report", "globex")
        nobody_s, also = await submit(conn, "report", None, "unsafe_dedupe")
        assert (outcome, also) == ("created", "created")
        assert len({finished, acme, globex, nobody_s}) == 4
        with pytest.raises(psycopg.errors.UniqueViolation, match="per_tenant"):
            await conn.execute(
                "UPDATE orc_jobs SET job_key = 'report', tenant_id = 'globex' WHERE id = %s",
                (nobody,),
            )
        cur = await conn.execute("SELECT tenant_id, payload FROM orc_jobs WHERE id = %s", (acme,))
        assert await cur.fetchone() == ("acme", {"by": "acme"})


def _orchestrator(dsn: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``orchestrator ARGV``, a real process, with Graphile Worker's API on (so that its step
    is covered too)."""
    env = {**os.environ, "DATABASE_URL": dsn, "ORCHESTRATOR_GRAPHILE_COMPAT": "true"}
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *argv],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


async def tuples_written(dsn: str) -> dict[str, tuple[int, int, int]]:
    """Each table's tuples inserted, updated and deleted so far, once every other session of
    the database has ended: a backend flushes its counts as it exits, before it leaves
    pg_stat_activity (its own, flushed at once, and the snapshot cleared, to be current)."""
    async with await connect(dsn) as conn:
        for _ in range(1200):
            cur = await conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
            )
            if await cur.fetchone() == (0,):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("another session of the database never ended")
        await conn.execute("SELECT pg_stat_force_next_flush()")
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        cur = await conn.execute(
            "SELECT schemaname || '.' || relname, n_tup_ins, n_tup_upd, n_tup_del"
            "  FROM pg_stat_user_tables"
        )
        return {row[0]: (row[1], row[2], row[3]) for row in await cur.fetchall()}


async def test_a_plan_or_a_migrate_with_nothing_to_do_writes_nothing(fresh_dsn: str) -> None:
    """Through the real CLI, on a database migrated by it: `migrate --plan` says there is
    nothing to do and `migrate` that the database is up to date, and neither writes a tuple
    to any table (the state machine, the principal looks, the job types, Graphile Worker's
    API's settings: each step is conditional)."""
    first = _orchestrator(fresh_dsn, "migrate")
    assert first.returncode == 0 and first.stdout.startswith("applied: "), first.stderr
    written = await tuples_written(fresh_dsn)
    for table in ("public.orc_states", "public.orc_job_types", "graphile_worker._orc_settings"):
        assert written[table][0] > 0, table  # the first migrate wrote them: they are counted

    planned = _orchestrator(fresh_dsn, "migrate", "--plan")
    assert planned.returncode == 0, planned.stderr
    assert planned.stdout.splitlines()[0] == "nothing to do: the database is up to date (release " \
        f"{own_migrations()[-1].version})"  # fmt: skip
    assert _orchestrator(fresh_dsn, "migrate", "--check").returncode == 0
    assert await tuples_written(fresh_dsn) == written

    again = _orchestrator(fresh_dsn, "migrate")
    assert (again.returncode, again.stdout.strip()) == (0, "database is up to date"), again.stderr
    assert await tuples_written(fresh_dsn) == written


async def test_a_plan_names_what_migrate_would_change(fresh_dsn: str) -> None:
    """A state machine, a principal look and a job type changed by hand, and Graphile Worker's
    API's settings: the plan names each, exits 3 under --check, and migrate puts them back."""
    assert _orchestrator(fresh_dsn, "migrate").returncode == 0
    async with await connect(fresh_dsn) as conn:
        await conn.execute("DELETE FROM orc_state_transitions WHERE to_status = 'CANCELLED'")
        await conn.execute("UPDATE orc_states SET terminal = NOT terminal WHERE status = 'RETRY'")
        await conn.execute("DELETE FROM orc_principal_looks WHERE ch = (SELECT min(ch)"
                           " FROM orc_principal_looks)")  # fmt: skip
        await conn.execute("UPDATE orc_job_types SET max_retries = max_retries + 1"
                           " WHERE job_type = 'http_request'")  # fmt: skip
        await conn.execute(
            "INSERT INTO orc_job_types (job_type, queue, max_attempts, max_retries,"
            " timeout_seconds, external) VALUES ('gone', 'q', 1, 0, 1, false)"
        )
        # ... as the application declared it once (docs/applications.md): its to withdraw
        await conn.execute(
            "INSERT INTO orc_application_definitions (kind, name, application, definition)"
            " VALUES ('job_type', 'gone', 'default', '{}')"
        )
        await conn.execute("UPDATE graphile_worker._orc_settings SET max_message = 1")
    checked = _orchestrator(fresh_dsn, "migrate", "--check", "--json")
    assert checked.returncode == 3, checked.stderr
    plan = json.loads(checked.stdout)
    cancelled = sum(1 for _, target in transition_rows() if target == "CANCELLED")
    assert plan["state_machine"] == {"states": 1, "transitions": cancelled}
    assert plan["principal_looks"] == 1
    assert plan["job_types"] == {"add": [], "change": ["http_request"], "remove": ["gone"]}
    assert plan["graphile_worker"] == {"schema": None, "settings": True}
    assert plan["migrations"] == [] and plan["functions"] == []
    text = _orchestrator(fresh_dsn, "migrate", "--plan").stdout.splitlines()
    assert "  write the job types: change http_request; remove gone" in text
    assert "  write Graphile Worker's API's settings" in text

    assert _orchestrator(fresh_dsn, "migrate").returncode == 0
    assert _orchestrator(fresh_dsn, "migrate", "--check").returncode == 0
