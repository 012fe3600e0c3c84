"""Where the SQL lives (docs/architecture.md, "Where the SQL lives"): every function and trigger
defined once, in a file per concept, applied by ``migrate`` when it changes; migrations from
0035 on hold no function body; each function file's text shipped by a migration that names it;
the current schema in one file; and a database the release before populated, upgraded, holds
the catalog of a fresh one and finishes its jobs."""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from orchestrator import JobContext, Orchestrator, Status
from orchestrator.storage.catalog import SCHEMA_FILE, current_schema, describe
from orchestrator.storage.database import scratch_database
from orchestrator.storage.migrate import (
    DEFINITIONS,
    definitions,
    migrate,
    own_migrations,
    revisions,
)
from tests.support import previous_release
from tests.support.harness import ROOT, settings_for_tests

FUNCTIONS = ROOT / "orchestrator" / "storage" / "sql" / "functions"
#: The first migration written after functions moved to their files.
FIRST_WITHOUT_BODIES = "0035"
DEFINED = re.compile(
    r"^CREATE OR REPLACE (FUNCTION|TRIGGER|VIEW) ([a-z0-9_]+)", re.MULTILINE | re.IGNORECASE
)
ANY_DEFINITION = re.compile(
    r"\bCREATE\s+(OR\s+REPLACE\s+)?(FUNCTION|TRIGGER|VIEW|PROCEDURE)\b", re.I
)
RETIRED = re.compile(r"^DROP FUNCTION IF EXISTS ([a-z0-9_]+)\(", re.MULTILINE)


@pytest.fixture
def fresh() -> Iterator[str]:
    with scratch_database(settings_for_tests(), "orc_layout") as dsn:
        yield dsn


async def connect(dsn: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(dsn, autocommit=True)


async def ours(conn: psycopg.AsyncConnection[Any]) -> set[tuple[str, str]]:
    """The functions and triggers of ours the database holds."""
    cur = await conn.execute(
        "SELECT 'FUNCTION', proname FROM pg_proc WHERE proname LIKE 'orc\\_%'"
        " UNION ALL SELECT 'TRIGGER', tgname FROM pg_trigger"
        " WHERE NOT tgisinternal AND tgname LIKE 'orc\\_%'"
    )
    return {(kind, name) for kind, name in await cur.fetchall()}


def defined() -> list[tuple[str, str]]:
    return [
        (kind.upper(), name)
        for definition in definitions()
        for kind, name in DEFINED.findall(definition.sql)
    ]


async def test_each_function_and_trigger_has_one_definition_and_the_database_exactly_these(
    fresh: str,
) -> None:
    found = defined()
    twice = sorted({d for d in found if found.count(d) > 1})
    assert not twice, f"defined more than once in sql/functions: {twice}"
    retired = {name for d in definitions() for name in RETIRED.findall(d.sql)}
    assert retired and not retired & {name for _, name in found}
    async with await connect(fresh) as conn:
        await migrate(conn)
        assert await ours(conn) == set(found)


def test_migrations_from_0035_on_hold_no_function_body() -> None:
    later = [m for m in own_migrations() if m.version >= FIRST_WITHOUT_BODIES]
    assert later, "the migration that moved the functions to their files is missing"
    for migration in later:
        assert not ANY_DEFINITION.search(migration.sql) and "$$" not in migration.sql, (
            f"migration {migration.version}_{migration.name} defines a function, trigger or "
            "view: its definition belongs in sql/functions (docs/architecture.md)"
        )


def test_each_function_file_is_the_text_a_migration_shipped() -> None:
    """A function file changes only with a migration that names its new text, so that an
    older release can tell from the migrations whether it may run on the database."""
    shipped = revisions(own_migrations())
    for definition in definitions():
        migration, checksum = shipped.get(definition.name, ("no migration", ""))
        assert checksum == definition.checksum, (
            f"sql/functions/{definition.name}.sql is not the text {migration} shipped: add a "
            "migration (with its compatible-with-older-workers marker) holding `-- revises: "
            f"functions/{definition.name}.sql {definition.checksum}` (./dev schema prints it)"
        )


def changed_copy(tmp_path: Path) -> Path:
    """The function files, the rollups' watermark answering a day earlier."""
    folder = tmp_path / "functions"
    shutil.copytree(FUNCTIONS, folder)
    rollups = folder / "rollups.sql"
    text = rollups.read_text()
    assert "SELECT rolled_up_to FROM" in text
    rollups.write_text(text.replace("SELECT rolled_up_to FROM", "SELECT rolled_up_to - interval '1 day' FROM"))  # fmt: skip
    return folder


async def watermark_body(conn: psycopg.AsyncConnection[Any]) -> str:
    cur = await conn.execute("SELECT prosrc FROM pg_proc WHERE proname = 'orc_rolled_up_to_v1'")
    row = await cur.fetchone()
    assert row is not None
    return str(row[0])


async def test_a_changed_function_file_is_applied_again_and_only_once(
    fresh: str, tmp_path: Path
) -> None:
    folder = changed_copy(tmp_path)
    async with await connect(fresh) as conn:
        assert (await migrate(conn)).defined == [f"functions/{d.name}.sql" for d in definitions()]
        assert "interval" not in await watermark_body(conn)
        changed = await migrate(conn, functions=folder)  # type: ignore[arg-type]
        assert changed.applied == [] and changed.defined == ["functions/rollups.sql"]
        assert "interval '1 day'" in await watermark_body(conn)
        again = await migrate(conn, functions=folder)  # type: ignore[arg-type]
        assert again.applied == [] and again.defined == []


async def test_a_newer_release_s_definitions_are_left_alone(fresh: str, tmp_path: Path) -> None:
    """An older release migrating after a newer one (a rollback's migrate job) keeps the newer
    definitions: they came with migrations it does not know."""
    folder = changed_copy(tmp_path)
    async with await connect(fresh) as conn:
        await migrate(conn)
        await conn.execute(
            "INSERT INTO orc_schema_migrations (component, version, name, checksum,"
            " compatible_with_older_workers) VALUES ('orchestrator', '9999', 'newer', '', true)"
        )
        older = await migrate(conn, functions=folder)  # type: ignore[arg-type]
        assert older.defined == [] and "interval" not in await watermark_body(conn)
        cur = await conn.execute(
            "SELECT count(*) FROM orc_schema_migrations WHERE component = %s", (DEFINITIONS,)
        )
        assert (await cur.fetchone()) == (len(definitions()),)


async def test_the_schema_file_is_current(fresh: str) -> None:
    assert await current_schema(fresh) == SCHEMA_FILE.read_text(), (
        "orchestrator/storage/sql/schema.sql is stale: run ./dev schema"
    )


# -- an upgrade from the release before ---------------------------------------------------------

POPULATE = """
import asyncio, os
from orchestrator import JobContext, Orchestrator, Settings

async def main() -> None:
    orc = Orchestrator(settings=Settings(metrics=False, health_port=0),
                       dsn=os.environ["DATABASE_URL"])

    @orc.job_type("noop")
    async def noop(ctx: JobContext, payload: int) -> int:
        return payload

    async with orc:
        await orc.submit_many([{"job_type": "noop", "payload": i} for i in range(3)])
        await orc.run_worker(concurrency=2, wait=False, install_signal_handlers=False)
        await orc.submit_many([{"job_type": "noop", "payload": i} for i in range(3, 6)])

asyncio.run(main())
"""


def run_release_before(root: Path, dsn: str, *argv: str) -> None:
    done = previous_release.python(root, dsn, *argv, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


async def test_a_database_the_release_before_populated_upgrades_to_a_fresh_one(
    fresh: str, tmp_path: Path
) -> None:
    root = previous_release.checkout(tmp_path / "release-before")
    with scratch_database(settings_for_tests(), "orc_upgrade") as upgraded:
        await asyncio.to_thread(run_release_before, root, upgraded, "-m", "orchestrator", "migrate")
        await asyncio.to_thread(run_release_before, root, upgraded, "-c", POPULATE)
        async with await connect(fresh) as a, await connect(upgraded) as b:
            await migrate(a)
            await migrate(b)
            assert await describe(b, bodies=True) == await describe(a, bodies=True)
        orc = Orchestrator(settings=settings_for_tests(), dsn=upgraded)

        @orc.job_type("noop")
        async def noop(ctx: JobContext, payload: int) -> int:
            return payload

        async with orc:
            await orc.run_worker(concurrency=2, wait=False, install_signal_handlers=False)
            jobs = await orc.list_jobs(job_type="noop")
        assert sorted((j.status, j.result) for j in jobs) == [
            (Status.COMPLETED, i) for i in range(6)
        ]
