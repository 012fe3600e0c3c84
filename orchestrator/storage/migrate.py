"""``orchestrator migrate``: bring a database to the schema this code expects.

One transaction, under an advisory lock (so two pods migrating at once take turns):

1. Procrastinate's schema: the full ``schema.sql`` on a fresh database, otherwise those of its
   migration files not yet recorded (so an older Procrastinate schema is upgraded in order).
2. This project's ``sql/migrations/NNNN_name.sql`` files not yet recorded. An applied file that
   has since changed is refused: migrations are append-only. They hold tables, indexes,
   constraints and data moves.
3. The definitions of ``sql/functions/*.sql``: every function and trigger, each defined once,
   in a file per concept. A file is applied (all of it: each statement a ``CREATE OR
   REPLACE``) when it differs from what the database recorded; ``retired.sql`` first, which
   drops retired functions by name. Function bodies are not checked while they are created
   (as a restore does), so no file depends on another's order.
4. The state machine of :mod:`orchestrator.domain.states`, copied into ``orc_states`` and
   ``orc_state_transitions`` for the guard trigger.
5. What each character of a principal's name looks like, case-folded and as written
   (:mod:`orchestrator.domain.principals`, from Unicode's confusables data), copied into
   ``orc_principal_looks`` for ``orc_principal_persons_v1``.

Steps 3 to 5 are left alone when a newer release migrated the database (compatibly: otherwise
nothing is done at all): its definitions and its state machine are its own, not this code's to
undo. A function file changes only together with a migration that names it (``-- revises:``),
so that the migrations' order is the releases' order (docs/architecture.md, "Where the SQL
lives").

Everything applied is recorded in ``orc_schema_migrations``; running it again applies nothing.
With each of ours goes its marker (``-- compatible-with-older-workers: yes``, a line of the file;
absent: no), so that an older release, which has no copy of the file, can read from the database
whether it may run on a schema newer than it knows (:func:`check_schema`; docs/operations.md,
"Rollout contract").
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from dataclasses import dataclass, field
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import psycopg
from procrastinate.schema import SchemaManager
from psycopg.rows import tuple_row

from orchestrator.domain.errors import MigrationError, SchemaOutdated, SchemaTooNew
from orchestrator.domain.principals import look_rows
from orchestrator.domain.states import TERMINAL, Status, transition_rows
from orchestrator.storage.producers import Producers, publish
from orchestrator.storage.queries import QUERIES

logger = logging.getLogger(__name__)

ORCHESTRATOR = "orchestrator"
PROCRASTINATE = "procrastinate"
DEFINITIONS = "functions"
RETIRED = "retired"
_OWN_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_DEFINITIONS_FILE = re.compile(r"^([a-z0-9_]+)\.sql$")
_COMPATIBLE = re.compile(r"^-- compatible-with-older-workers: (yes|no)[ \t]*$", re.MULTILINE)
_REVISES = re.compile(
    r"^-- revises: functions/([a-z0-9_]+)\.sql ([0-9a-f]{64})[ \t]*$", re.MULTILINE
)


@dataclass(frozen=True)
class Migration:
    version: str
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()

    @property
    def compatible_with_older_workers(self) -> bool:
        """Whether the file says the release before it runs correctly on the schema it leaves;
        a file that does not say is not."""
        marks = _COMPATIBLE.findall(self.sql)
        if len(marks) > 1:
            raise MigrationError(
                f"migration {self.version}_{self.name} says more than once whether it is "
                "compatible with older workers"
            )
        return marks == ["yes"]

    @property
    def revises(self) -> dict[str, str]:
        """The function files this migration ships a change of, each with the checksum of the
        file as changed (``-- revises: functions/claim.sql <sha256>`` lines)."""
        return dict(_REVISES.findall(self.sql))


def revisions(migrations: list[Migration]) -> dict[str, tuple[str, str]]:
    """Each function file's last revision: (the migration that shipped it, its checksum)."""
    last: dict[str, tuple[str, str]] = {}
    for migration in migrations:
        for name, checksum in migration.revises.items():
            last[name] = (f"{migration.version}_{migration.name}", checksum)
    return last


@dataclass
class MigrationReport:
    applied: list[str] = field(default_factory=list)
    #: Function files applied (new or changed): logged; the report's text names the versioned
    #: steps only, each of which a function file's change comes with.
    defined: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        if not self.applied:
            return "database is up to date"
        return "applied: " + ", ".join(self.applied)


def own_migrations(folder: Traversable | None = None) -> list[Migration]:
    folder = folder or resources.files("orchestrator.storage") / "sql" / "migrations"
    found = []
    for entry in folder.iterdir():
        match = _OWN_FILE.match(entry.name)
        if match:
            found.append(Migration(match[1], match[2], entry.read_text("utf-8")))
        elif entry.name.endswith(".sql"):
            raise MigrationError(f"migration file {entry.name!r} is not named NNNN_name.sql")
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"two migration files share a version: {versions}")
    return found


def definitions(folder: Traversable | None = None) -> list[Migration]:
    """The files of ``sql/functions``, ``retired.sql`` first, then by name (a file's version
    and name are its stem)."""
    folder = folder or resources.files("orchestrator.storage") / "sql" / "functions"
    found = []
    for entry in folder.iterdir():
        match = _DEFINITIONS_FILE.match(entry.name)
        if match:
            found.append(Migration(match[1], match[1], entry.read_text("utf-8")))
        elif entry.name.endswith(".sql"):
            raise MigrationError(f"function file {entry.name!r} is not named name.sql")
    found.sort(key=lambda m: (m.name != RETIRED, m.name))
    return found


def procrastinate_migrations() -> list[Migration]:
    folder = Path(SchemaManager.get_migrations_path())
    return [
        Migration(path.stem, path.stem, path.read_text("utf-8"))
        for path in sorted(folder.glob("*.sql"))
    ]


#: The SQLSTATEs of a statement naming what the database lacks: a table, a column, a function,
#: a type, a schema (42P01, 42703, 42883, 42704, 3F000).
UNDEFINED = frozenset({"42P01", "42703", "42883", "42704", "3F000"})


def names_what_is_missing(exc: BaseException) -> bool:
    """Whether ``exc`` is the database refusing a statement for naming what it does not have:
    this version's schema missing (a database restored from an older backup, or emptied), or a
    bug (:func:`check_schema` tells them apart)."""
    return isinstance(exc, psycopg.Error) and exc.sqlstate in UNDEFINED


async def schema_outdated(conn: psycopg.AsyncConnection[Any]) -> SchemaOutdated | None:
    """What :func:`check_schema` says when this version's schema is missing; None when it is
    whole (or the check itself fails: the caller's error stands)."""
    try:
        await check_schema(conn)
    except SchemaOutdated as outdated:
        return outdated
    except (SchemaTooNew, psycopg.Error):
        return None
    return None


async def check_schema(conn: psycopg.AsyncConnection[Any]) -> None:
    """Refuse a database this version's schema is missing from (SchemaOutdated, saying what to
    run), rather than fail later on a missing table or function. Any connection will do,
    whatever its rows' shape."""
    cur = conn.cursor(row_factory=tuple_row)
    await cur.execute(QUERIES["migrations_table_exists"])
    row = await cur.fetchone()
    if not row or not row[0]:
        raise SchemaOutdated(
            "the database has no orchestrator schema: run `orchestrator migrate` first"
        )
    await cur.execute(QUERIES["migrations_applied"])
    applied = [r[1] for r in await cur.fetchall() if r[0] == ORCHESTRATOR]
    needed = [m.version for m in own_migrations()]
    missing = sorted(set(needed) - set(applied))
    if missing:
        at = max(applied) if applied else "none"
        raise SchemaOutdated(
            f"the database schema is at {at}; this version needs {needed[-1]}: run "
            "`orchestrator migrate`"
        )
    await _refuse_unknown_migrations(conn, set(needed))


async def _refuse_unknown_migrations(
    conn: psycopg.AsyncConnection[Any], known: set[str]
) -> list[str]:
    """A newer release migrated this database: this code may run on it only if every migration
    it does not know was recorded as compatible with older workers (SchemaTooNew otherwise).
    Returns those it does not know."""
    cur = conn.cursor(row_factory=tuple_row)
    await cur.execute(QUERIES["migrations_unknown"], {"known": sorted(known)})
    unknown = [(f"{row[0]}_{row[1]}", row[2]) for row in await cur.fetchall()]
    refused = [name for name, compatible in unknown if not compatible]
    if unknown and not refused:
        logger.info(
            "the database schema is newer than this version (%s, marked compatible with older "
            "workers)", ", ".join(name for name, _ in unknown),
        )  # fmt: skip
    if refused:
        raise SchemaTooNew(
            f"the database schema is newer than this version: migration(s) {', '.join(refused)} "
            "not marked compatible with older workers; run the release that applied them (or a "
            "newer one)"
        )
    return [name for name, _ in unknown]


async def migrate(
    conn: psycopg.AsyncConnection[Any],
    *,
    folder: Traversable | None = None,
    functions: Traversable | None = None,
    producers: Producers | None = None,
) -> MigrationReport:
    """Apply what is missing or changed; ``folder`` and ``functions`` replace the packaged
    migrations and function files (tests: a folder of migrations of a test's own comes with
    no function files unless it names some); ``producers``: what the code that migrates
    publishes for producers writing in SQL (its job types; Graphile Worker's API)."""
    report = MigrationReport()
    async with conn.transaction():
        await conn.execute(QUERIES["migrations_lock"])
        await conn.execute(QUERIES["migrations_table"])
        await conn.execute(QUERIES["migrations_table_compatibility"])
        migrations = own_migrations(folder)
        newer = await _refuse_unknown_migrations(conn, {m.version for m in migrations})
        cur = await conn.execute(QUERIES["migrations_applied"])
        applied: dict[tuple[str, str], str] = {
            (row[0], row[1]): row[2] for row in await cur.fetchall()
        }
        await _procrastinate(conn, applied, report)
        for migration in migrations:
            key = (ORCHESTRATOR, migration.version)
            if key in applied:
                if applied[key] != migration.checksum:
                    raise MigrationError(
                        f"migration {migration.version}_{migration.name} was changed after it "
                        "was applied; add a new migration instead"
                    )
                continue
            await conn.execute(migration.sql.encode())
            await _record(conn, ORCHESTRATOR, migration)
            report.applied.append(f"{migration.version}_{migration.name}")
        if not newer:  # a newer release's definitions are its own, not this code's to undo
            files = definitions(functions) if functions is not None or folder is None else []
            await _define(conn, files, applied, report)
            await _sync_state_machine(conn)
            await _sync_principal_looks(conn)
            if producers is not None:
                await publish(conn, producers)
    for name in report.applied:
        logger.info("applied migration %s", name)
    for name in report.defined:
        logger.info("applied %s", name)
    return report


async def _procrastinate(
    conn: psycopg.AsyncConnection[Any],
    applied: dict[tuple[str, str], str],
    report: MigrationReport,
) -> None:
    files = procrastinate_migrations()
    done = {version for component, version in applied if component == PROCRASTINATE}
    if not done:
        cur = await conn.execute(QUERIES["procrastinate_installed"])
        row = await cur.fetchone()
        if row is None or row[0] is None:
            await conn.execute(SchemaManager.get_schema().encode())
            report.applied.append("procrastinate schema")
        else:
            logger.warning(
                "Procrastinate tables exist but were not installed by orchestrator migrate; "
                "assuming they match the installed Procrastinate version"
            )
        for migration in files:  # schema.sql already contains every migration file
            await _record(conn, PROCRASTINATE, migration)
        return
    latest = max(done)
    for migration in files:
        if migration.version not in done and migration.version > latest:
            await conn.execute(migration.sql.encode())
            await _record(conn, PROCRASTINATE, migration)
            report.applied.append(f"procrastinate {migration.name}")


async def _define(
    conn: psycopg.AsyncConnection[Any],
    files: list[Migration],
    applied: dict[tuple[str, str], str],
    report: MigrationReport,
) -> None:
    """Apply each function file that differs from what the database recorded."""
    changed = [f for f in files if applied.get((DEFINITIONS, f.version)) != f.checksum]
    if not changed:
        return
    await conn.execute(QUERIES["definitions_unchecked"])
    for definition in changed:
        await conn.execute(definition.sql.encode())
        await _record(conn, DEFINITIONS, definition)
        report.defined.append(f"functions/{definition.name}.sql")


async def _record(conn: psycopg.AsyncConnection[Any], component: str, m: Migration) -> None:
    await conn.execute(
        QUERIES["migrations_record"],
        {
            "component": component, "version": m.version, "name": m.name, "checksum": m.checksum,
            "compatible": component == ORCHESTRATOR and m.compatible_with_older_workers,
        },
    )  # fmt: skip


async def _sync_state_machine(conn: psycopg.AsyncConnection[Any]) -> None:
    statuses = [s.value for s in Status]
    pairs = transition_rows()
    await conn.execute(
        QUERIES["sync_states"],
        {"statuses": statuses, "terminal": [Status(s) in TERMINAL for s in statuses]},
    )
    await conn.execute(
        QUERIES["sync_transitions"],
        {"sources": [p[0] for p in pairs], "targets": [p[1] for p in pairs]},
    )


async def _sync_principal_looks(conn: psycopg.AsyncConnection[Any]) -> None:
    """orc_principal_looks from Unicode's confusables data (the Python side of the rule), and
    the persons of the discards it may have changed."""
    cur = conn.cursor(row_factory=tuple_row)
    await cur.execute(QUERIES["principal_looks_table_exists"])
    if (await cur.fetchone()) != (True,):
        return  # a test's own folder of migrations, stopped before 0057
    rows = await asyncio.to_thread(look_rows)
    await conn.execute(
        QUERIES["sync_principal_looks"],
        {
            "chars": [ch for ch, _, _ in rows],
            "looks": [folded for _, folded, _ in rows],
            "written": [written for _, _, written in rows],
        },
    )
    await conn.execute(QUERIES["rederive_requested_persons"])
