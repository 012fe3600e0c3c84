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

What is pending is decided in one place, read only: :func:`_versioned` (steps 1 to 3) and
:func:`_synced` (4, 5 and the producers' rows, :func:`orchestrator.storage.producers.pending`).
:func:`migrate` takes the steps they name, and only those, so a database with nothing pending
gets no write; :func:`plan` (``orchestrator migrate --plan``) reports them in a read-only
transaction, with the registry's live workers of an older release (docs/operations.md,
"Planning a migrate").
"""

from __future__ import annotations

import asyncio
import functools
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
from orchestrator.storage.producers import Producers, ProducersPending, publish
from orchestrator.storage.producers import pending as producers_pending
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
    unknown = await _unknown_migrations(conn, known)
    _refuse_newer(unknown)
    return [name for name, _ in unknown]


async def _unknown_migrations(
    conn: psycopg.AsyncConnection[Any], known: set[str]
) -> list[tuple[str, bool]]:
    """Our migrations the database recorded that this code does not have, each with its
    marker (compatible with older workers)."""
    cur = conn.cursor(row_factory=tuple_row)
    await cur.execute(QUERIES["migrations_unknown"], {"known": sorted(known)})
    return [(f"{row[0]}_{row[1]}", row[2]) for row in await cur.fetchall()]


def _refuse_newer(unknown: list[tuple[str, bool]]) -> None:
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


@functools.cache
def release() -> str:
    """This code's release, as the schema counts releases: the newest migration it has. Each
    worker and API server records it (0058), for ``migrate --plan``."""
    return own_migrations()[-1].version


@dataclass
class Versioned:
    """The versioned steps ``migrate`` would take on a database (1 to 3 of the module's
    docstring), as :func:`_versioned` reads them, before any is taken."""

    #: Procrastinate's full schema (a database without it), then every file recorded.
    install_procrastinate: bool = False
    #: Procrastinate's tables are there but were not installed by migrate: its files are
    #: recorded as applied, none is run.
    adopt_procrastinate: bool = False
    #: Procrastinate's migration files to apply (or, with either flag, to record).
    procrastinate: list[Migration] = field(default_factory=list)
    migrations: list[Migration] = field(default_factory=list)
    #: Our migrations the database has that this code does not (a newer release's), each with
    #: its marker; when there are any (all compatible: otherwise SchemaTooNew), steps 3 to 5
    #: are left alone.
    newer: list[tuple[str, bool]] = field(default_factory=list)
    functions: list[Migration] = field(default_factory=list)


async def _versioned(
    conn: psycopg.AsyncConnection[Any],
    migrations: list[Migration],
    files: list[Migration],
) -> Versioned:
    """What is pending of steps 1 to 3, read only: the one place these decisions are taken
    (``migrate`` then takes the steps, ``migrate --plan`` says them). Refuses a database a
    newer release migrated incompatibly (SchemaTooNew) and an applied migration since edited
    (MigrationError)."""
    found = Versioned()
    applied: dict[tuple[str, str], str] = {}
    cur = conn.cursor(row_factory=tuple_row)
    await cur.execute(QUERIES["migrations_table_exists"])
    if (await cur.fetchone()) == (True,):
        found.newer = await _unknown_migrations(conn, {m.version for m in migrations})
        _refuse_newer(found.newer)
        await cur.execute(QUERIES["migrations_applied"])
        applied = {(row[0], row[1]): row[2] for row in await cur.fetchall()}
    files_of_procrastinate = procrastinate_migrations()
    done = {version for component, version in applied if component == PROCRASTINATE}
    if not done:
        await cur.execute(QUERIES["procrastinate_installed"])
        row = await cur.fetchone()
        found.install_procrastinate = row is None or row[0] is None
        found.adopt_procrastinate = not found.install_procrastinate
        found.procrastinate = files_of_procrastinate
    else:
        latest = max(done)
        found.procrastinate = [
            m for m in files_of_procrastinate if m.version not in done and m.version > latest
        ]
    for migration in migrations:
        key = (ORCHESTRATOR, migration.version)
        if key not in applied:
            found.migrations.append(migration)
        elif applied[key] != migration.checksum:
            raise MigrationError(
                f"migration {migration.version}_{migration.name} was changed after it "
                "was applied; add a new migration instead"
            )
    if not found.newer:  # a newer release's definitions are its own, not this code's to undo
        found.functions = [f for f in files if applied.get((DEFINITIONS, f.version)) != f.checksum]
    return found


@dataclass
class Synced:
    """What steps 4 and 5, and the producers' (job types, Graphile Worker's API), would write,
    read by :func:`_synced` on the database as it stands."""

    #: States and transitions to write or delete.
    states: int = 0
    transitions: int = 0
    #: Characters' looks to write or delete.
    looks: int = 0
    producers: ProducersPending | None = None

    @property
    def nothing(self) -> bool:
        return not (self.states or self.transitions or self.looks) and (
            self.producers is None or self.producers.nothing
        )


async def _synced(
    conn: psycopg.AsyncConnection[Any], producers: Producers | None, *, tables_to_come: bool
) -> Synced:
    """What is pending of steps 4 and 5 and of publishing the producers' rows, read only (the
    one place these decisions are taken, as :func:`_versioned` for the others).
    ``tables_to_come``: a table missing now is created by a pending migration (the plan of an
    older database): all its rows are to be written."""
    found = Synced()
    statuses = [s.value for s in Status]
    pairs = transition_rows()
    if await _table_exists(conn, "orc_state_transitions"):
        cur = conn.cursor(row_factory=tuple_row)
        await cur.execute(QUERIES["state_machine_changes"], _state_machine_params())
        row = await cur.fetchone()
        found.states, found.transitions = row if row else (0, 0)
    elif tables_to_come:
        found.states, found.transitions = len(statuses), len(pairs)
    if await _looks_table(conn):
        cur = conn.cursor(row_factory=tuple_row)
        await cur.execute(QUERIES["principal_looks_changes"], await _looks_params())
        row = await cur.fetchone()
        found.looks = row[0] if row else 0
    elif tables_to_come:
        found.looks = len((await _looks_params())["chars"])
    if producers is not None:
        found.producers = await producers_pending(conn, producers, tables_to_come=tables_to_come)
    return found


async def _table_exists(conn: psycopg.AsyncConnection[Any], table: str) -> bool:
    cur = conn.cursor(row_factory=tuple_row)
    await cur.execute(QUERIES["table_exists"], {"table": table})
    return (await cur.fetchone()) == (True,)


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
    publishes for producers writing in SQL (its job types; Graphile Worker's API). What is
    pending is read as :func:`plan` reads it; a database with nothing pending gets no write."""
    report = MigrationReport()
    async with conn.transaction():
        await conn.execute(QUERIES["migrations_lock"])
        await conn.execute(QUERIES["migrations_table"])
        await conn.execute(QUERIES["migrations_table_compatibility"])
        files = definitions(functions) if functions is not None or folder is None else []
        versioned = await _versioned(conn, own_migrations(folder), files)
        await _procrastinate(conn, versioned, report)
        for migration in versioned.migrations:
            await conn.execute(migration.sql.encode())
            await _record(conn, ORCHESTRATOR, migration)
            report.applied.append(f"{migration.version}_{migration.name}")
        if not versioned.newer:  # a newer release's definitions are its own
            await _define(conn, versioned.functions, report)
            synced = await _synced(conn, producers, tables_to_come=False)
            if synced.states or synced.transitions:
                await _sync_state_machine(conn)
            if await _looks_table(conn):
                if synced.looks:
                    await conn.execute(QUERIES["sync_principal_looks"], await _looks_params())
                # The persons of the discards awaiting confirmation, by the looks (and the
                # functions) now in force: only those that change are written.
                await conn.execute(QUERIES["rederive_requested_persons"])
            if producers is not None:
                await publish(conn, producers, synced.producers)
    for name in report.applied:
        logger.info("applied migration %s", name)
    for name in report.defined:
        logger.info("applied %s", name)
    return report


async def _procrastinate(
    conn: psycopg.AsyncConnection[Any], versioned: Versioned, report: MigrationReport
) -> None:
    if versioned.install_procrastinate:
        await conn.execute(SchemaManager.get_schema().encode())
        report.applied.append("procrastinate schema")
    elif versioned.adopt_procrastinate:
        logger.warning(
            "Procrastinate tables exist but were not installed by orchestrator migrate; "
            "assuming they match the installed Procrastinate version"
        )
    for migration in versioned.procrastinate:
        # schema.sql already contains every migration file: installed or adopted, each is
        # recorded only
        if not (versioned.install_procrastinate or versioned.adopt_procrastinate):
            await conn.execute(migration.sql.encode())
            report.applied.append(f"procrastinate {migration.name}")
        await _record(conn, PROCRASTINATE, migration)


async def _define(
    conn: psycopg.AsyncConnection[Any], changed: list[Migration], report: MigrationReport
) -> None:
    """Apply each function file that differs from what the database recorded."""
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


def _state_machine_params() -> dict[str, list[Any]]:
    statuses = [s.value for s in Status]
    pairs = transition_rows()
    return {
        "statuses": statuses, "terminal": [Status(s) in TERMINAL for s in statuses],
        "sources": [p[0] for p in pairs], "targets": [p[1] for p in pairs],
    }  # fmt: skip


async def _sync_state_machine(conn: psycopg.AsyncConnection[Any]) -> None:
    params = _state_machine_params()
    await conn.execute(
        QUERIES["sync_states"], {"statuses": params["statuses"], "terminal": params["terminal"]}
    )
    await conn.execute(
        QUERIES["sync_transitions"], {"sources": params["sources"], "targets": params["targets"]}
    )


async def _looks_params() -> dict[str, list[str]]:
    """orc_principal_looks's rows, from Unicode's confusables data (what each character looks
    like case-folded, and as written: the Python side of the rule)."""
    rows = await asyncio.to_thread(look_rows)
    return {
        "chars": [ch for ch, _, _ in rows],
        "looks": [folded for _, folded, _ in rows],
        "written": [written for _, _, written in rows],
    }


async def _looks_table(conn: psycopg.AsyncConnection[Any]) -> bool:
    """orc_principal_looks as this code writes it (0057: both looks), not a test's own folder of
    migrations stopped before it."""
    cur = conn.cursor(row_factory=tuple_row)
    await cur.execute(QUERIES["principal_looks_table_exists"])
    return (await cur.fetchone()) == (True,)


@dataclass(frozen=True)
class LiveWorker:
    """A live process of the registry (a worker, or an API server) and the release it recorded
    (0058; None: it records none, as a release before 0058)."""

    worker_id: int
    worker: str | None
    release: str | None

    def __str__(self) -> str:
        return f"worker {self.worker_id}" + (f" ({self.worker})" if self.worker else "")


@dataclass
class Plan:
    """What ``migrate`` would do to a database, read by :func:`plan` without changing it."""

    release: str
    versioned: Versioned
    synced: Synced | None
    workers: list[LiveWorker]

    @property
    def nothing_to_do(self) -> bool:
        v = self.versioned
        return not (
            v.install_procrastinate or v.adopt_procrastinate or v.procrastinate or v.migrations
            or v.functions
        ) and (self.synced is None or self.synced.nothing)  # fmt: skip

    @property
    def older_workers(self) -> list[LiveWorker]:
        return [w for w in self.workers if w.release is None or w.release < self.release]

    @property
    def newer_workers(self) -> list[LiveWorker]:
        return [w for w in self.workers if w.release is not None and w.release > self.release]

    @property
    def incompatible(self) -> list[str]:
        """The pending migrations of ours not marked compatible with older workers."""
        return [
            f"{m.version}_{m.name}"
            for m in self.versioned.migrations
            if not m.compatible_with_older_workers
        ]

    def steps(self) -> list[str]:
        """What ``migrate`` would do, a line each, in its order."""
        v, steps = self.versioned, []
        if v.install_procrastinate:
            steps.append("install Procrastinate's schema")
        elif v.adopt_procrastinate:
            steps.append(
                "record Procrastinate's migrations as applied (its tables exist, not installed "
                "by orchestrator migrate)"
            )
        else:
            steps += [f"apply Procrastinate's migration {m.name}" for m in v.procrastinate]
        for m in v.migrations:
            compatible = "compatible" if m.compatible_with_older_workers else "NOT compatible"
            steps.append(f"apply migration {m.version}_{m.name} ({compatible} with older workers)")
        steps += [f"apply functions/{f.name}.sql" for f in v.functions]
        s = self.synced
        if s is None:
            return steps
        if s.states or s.transitions:
            steps.append(
                f"write the state machine ({s.states} state(s), {s.transitions} transition(s))"
            )
        if s.looks:
            steps.append(f"write the principal looks ({s.looks} character(s))")
        p = s.producers
        if p is not None:
            changes = [f"{change} {', '.join(names)}" for change, names in p.job_types.items()
                       if names]  # fmt: skip
            if changes:
                steps.append(f"write the job types: {'; '.join(changes)}")
            if p.graphile is not None:
                steps.append(f"{p.graphile} Graphile Worker's API (schema graphile_worker)")
            if p.graphile_settings:
                steps.append("write Graphile Worker's API's settings")
        return steps

    def lines(self) -> list[str]:
        """The plan as text for an operator."""
        lines = []
        if self.nothing_to_do:
            lines.append(f"nothing to do: the database is up to date (release {self.release})")
        else:
            lines.append(f"migrate to release {self.release} would:")
            lines += [f"  {step}" for step in self.steps()]
        if self.versioned.newer:
            names = ", ".join(name for name, _ in self.versioned.newer)
            lines.append(
                f"a newer release migrated this database ({names}, marked compatible with older "
                "workers): migrate leaves its functions, state machine and principal looks alone"
            )
        older, newer = self.older_workers, self.newer_workers
        lines.append(
            f"live workers: {len(self.workers)}"
            + (f" ({len(older)} of an older release)" if older else "")
        )
        for w in older:
            lines.append(
                f"  {w}: an older release "
                + ("(records no version)" if w.release is None else f"({w.release})")
            )
        lines += [f"  {w}: a newer release ({w.release})" for w in newer]
        if self.incompatible and older:
            lines.append(
                f"warning: {', '.join(self.incompatible)} not marked compatible with older "
                f"workers, and {len(older)} live worker(s) run an older release: stop them "
                'before migrating (docs/operations.md, "Rollout contract")'
            )
        return lines

    def as_json(self) -> dict[str, Any]:
        v, s = self.versioned, self.synced
        p = s.producers if s is not None else None
        return {
            "release": self.release,
            "nothing_to_do": self.nothing_to_do,
            "steps": self.steps(),
            "procrastinate": {
                "install_schema": v.install_procrastinate,
                "record_existing": v.adopt_procrastinate,
                "migrations": [m.name for m in v.procrastinate],
            },
            "migrations": [
                {"name": f"{m.version}_{m.name}",
                 "compatible_with_older_workers": m.compatible_with_older_workers}
                for m in v.migrations
            ],
            "functions": [f"functions/{f.name}.sql" for f in v.functions],
            "newer": [
                {"name": name, "compatible_with_older_workers": compatible}
                for name, compatible in v.newer
            ],
            "state_machine": None if s is None else {"states": s.states,
                                                     "transitions": s.transitions},
            "principal_looks": None if s is None else s.looks,
            "job_types": None if p is None else p.job_types,
            "graphile_worker": None if p is None else {"schema": p.graphile,
                                                       "settings": p.graphile_settings},
            "workers": [
                {"id": w.worker_id, "worker": w.worker, "release": w.release,
                 "older": w in self.older_workers}
                for w in self.workers
            ],
        }  # fmt: skip


async def plan(
    conn: psycopg.AsyncConnection[Any],
    *,
    stale_after: float,
    folder: Traversable | None = None,
    functions: Traversable | None = None,
    producers: Producers | None = None,
) -> Plan:
    """What :func:`migrate` (same arguments) would do, read in a read-only transaction: the
    same decisions (:func:`_versioned`, :func:`_synced`), taken on the database as it stands,
    and the registry's workers whose heartbeat is younger than ``stale_after`` seconds, each
    with its release. Refuses what migrate refuses (SchemaTooNew, MigrationError)."""
    migrations = own_migrations(folder)
    files = definitions(functions) if functions is not None or folder is None else []
    async with conn.transaction():
        await conn.execute(QUERIES["read_only"])
        versioned = await _versioned(conn, migrations, files)
        synced = None
        if not versioned.newer:
            to_come = bool(versioned.migrations or versioned.install_procrastinate)
            synced = await _synced(conn, producers, tables_to_come=to_come)
        workers = await _live_workers(conn, stale_after)
    return Plan(migrations[-1].version if migrations else "none", versioned, synced, workers)


async def _live_workers(conn: psycopg.AsyncConnection[Any], seconds: float) -> list[LiveWorker]:
    if not await _table_exists(conn, "procrastinate_workers"):
        return []
    recorded = await _table_exists(conn, "orc_worker_configs")
    cur = conn.cursor(row_factory=tuple_row)
    await cur.execute(
        QUERIES["live_worker_releases" if recorded else "live_workers"], {"seconds": seconds}
    )
    return [LiveWorker(row[0], row[1], row[2]) for row in await cur.fetchall()]
