"""What producers that write in SQL read of the orchestrator, written by ``orchestrator migrate``
(docs/graphile.md): the job types with their defaults (``orc_job_types``), and, when the
setting asks for it, Graphile Worker's SQL API for producers in the schema ``graphile_worker``
(``sql/graphile_worker.sql``), both declared as the migrating application's
(docs/applications.md): the job types it withdrew go unless another application declares them,
and the schema, one per database, is kept while an application declares it.

That schema is optional and holds nothing of its own (the orchestrator's jobs are its jobs), so
it is not versioned as the core schema is: when its file changes, ``migrate`` drops the schema
and creates it again; when the setting is off, it drops it (docs/architecture.md, "Where the
SQL lives")."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from typing import Any

import psycopg
from psycopg.rows import tuple_row
from psycopg.types.json import Jsonb

from orchestrator.domain.applications import GRAPHILE_SCHEMA, Application, Declaration, Kind
from orchestrator.domain.errors import MigrationError
from orchestrator.storage.applications import declare
from orchestrator.storage.queries import QUERIES

COMPONENT = "graphile_worker"


@dataclass(frozen=True)
class Producers:
    """The job types' rows ({job_type, queue, max_attempts, max_retries, timeout_seconds,
    external}) of ``application``, and Graphile Worker's API's settings (None: not
    installed)."""

    job_types: list[dict[str, Any]]
    graphile: dict[str, Any] | None
    application: Application

    def declaration(self) -> Declaration:
        """What the application declares of them (withdrawn at once: the act of ``migrate``)."""
        return Declaration(
            self.application,
            {
                Kind.JOB_TYPE: {
                    row["job_type"]: {k: v for k, v in row.items() if k != "job_type"}
                    for row in self.job_types
                },
                Kind.GRAPHILE: {} if self.graphile is None else {GRAPHILE_SCHEMA: self.graphile},
            },
        )


def graphile_sql() -> str:
    return (resources.files("orchestrator.storage") / "sql" / "graphile_worker.sql").read_text(
        "utf-8"
    )


@dataclass(frozen=True)
class ProducersPending:
    """What :func:`publish` would change: the job types to add, change and remove (each by
    name), what it does to the schema ``graphile_worker`` (``install``, ``reinstall`` after its
    file changed, ``drop`` with the setting off and no other application declaring it; None:
    nothing), whether it writes that API's settings, and whether the application's
    declarations change."""

    job_types: dict[str, list[str]]
    graphile: str | None
    graphile_settings: bool
    declarations: bool = False

    @property
    def nothing(self) -> bool:
        return (
            not any(self.job_types.values())
            and self.graphile is None
            and not self.graphile_settings
            and not self.declarations
        )


async def pending(
    conn: psycopg.AsyncConnection[Any], producers: Producers, *, tables_to_come: bool = False
) -> ProducersPending:
    """What :func:`publish` would change on the database as it stands, read only: the one
    place its decisions are taken (``migrate`` acts on them, ``migrate --plan`` says them).
    ``tables_to_come``: ``orc_job_types`` missing now is created by a pending migration."""
    cur = conn.cursor(row_factory=tuple_row)
    declaration = producers.declaration()
    await cur.execute(QUERIES["table_exists"], {"table": "orc_application_definitions"})
    declared = (await cur.fetchone()) == (True,)
    changes: dict[str, list[str]] = {"add": [], "change": [], "remove": []}
    others_declare_graphile = False
    differ = not declared  # before 0056, the first migrate declares everything
    if declared:
        await cur.execute(
            QUERIES["job_types_changes"],
            {"types": Jsonb(producers.job_types), "application": declaration.application.name},
        )
        for job_type, change in await cur.fetchall():
            changes[change].append(job_type)
        await cur.execute(
            QUERIES["declarations_differ"],
            {"application": declaration.application.name,
             "kinds": [kind.value for kind in declaration.kinds],
             "definitions": Jsonb({k.value: dict(d) for k, d in declaration.kinds.items()})},
        )  # fmt: skip
        differ = (await cur.fetchone()) == (True,)
        await cur.execute(QUERIES["graphile_declared_by_others"],
                          {"application": declaration.application.name})  # fmt: skip
        others_declare_graphile = (await cur.fetchone()) == (True,)
    else:
        await cur.execute(QUERIES["table_exists"], {"table": "orc_job_types"})
        if (await cur.fetchone()) == (True,):  # 0056 to come: what it records is `default`'s
            await cur.execute(
                QUERIES["job_types_changes_before_applications"],
                {"types": Jsonb(producers.job_types)},
            )
            for job_type, change in await cur.fetchall():
                changes[change].append(job_type)
        elif tables_to_come:
            changes["add"] = sorted(t["job_type"] for t in producers.job_types)
    await cur.execute(QUERIES["graphile_schema"])
    row = await cur.fetchone()
    present, ours = row if row else (False, False)
    if present and not ours:
        raise MigrationError(
            "the database holds a schema graphile_worker that orchestrator migrate did not "
            "install (Graphile Worker's own?); ORCHESTRATOR_GRAPHILE_COMPAT needs that name: "
            "move Graphile Worker's jobs over and drop it, or turn the setting off"
        )
    if producers.graphile is None:
        drop = present and not others_declare_graphile
        return ProducersPending(changes, "drop" if drop else None, False, differ)
    recorded = None
    await cur.execute(QUERIES["table_exists"], {"table": "orc_schema_migrations"})
    if (await cur.fetchone()) == (True,):
        await cur.execute(QUERIES["graphile_checksum"], {"component": COMPONENT})
        recorded = await cur.fetchone()
    if not present:
        return ProducersPending(changes, "install", True, differ)
    if recorded is None or recorded[0] != _checksum(graphile_sql()):
        return ProducersPending(changes, "reinstall", True, differ)
    await cur.execute(QUERIES["graphile_settings_differ"], producers.graphile)
    return ProducersPending(changes, None, (await cur.fetchone()) == (True,), differ)


def _checksum(sql: str) -> str:
    return hashlib.sha256(sql.encode()).hexdigest()


async def publish(
    conn: psycopg.AsyncConnection[Any],
    producers: Producers,
    decided: ProducersPending | None = None,
) -> None:
    """Inside ``migrate``'s transaction: the job types and Graphile Worker's API declared as the
    application's (ApplicationConflict: another application declares one otherwise), the job
    types written (those withdrawn that nobody else declares deleted), then Graphile Worker's
    API as the setting says (``decided``: :func:`pending`, read in this transaction)."""
    decided = decided or await pending(conn, producers)
    answer = await declare(conn, producers.declaration())
    answer.check()
    await conn.execute(
        QUERIES["sync_job_types"],
        {"types": Jsonb(producers.job_types), "gone": answer.gone(Kind.JOB_TYPE)},
    )
    if decided.graphile == "drop":
        await conn.execute(QUERIES["graphile_drop"])
        await conn.execute(QUERIES["graphile_forget"], {"component": COMPONENT})
    elif decided.graphile is not None:
        sql = graphile_sql()
        await conn.execute(QUERIES["graphile_drop"])
        await conn.execute(sql.encode())
        await conn.execute(
            QUERIES["migrations_record"],
            {"component": COMPONENT, "version": COMPONENT, "name": COMPONENT,
             "checksum": _checksum(sql), "compatible": False},
        )  # fmt: skip
    if producers.graphile is not None and decided.graphile_settings:
        await conn.execute(QUERIES["graphile_settings"], producers.graphile)
