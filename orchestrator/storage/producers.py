"""What producers that write in SQL read of the orchestrator, written by ``orchestrator migrate``
(docs/graphile.md): the job types with their defaults (``orc_job_types``), and, when the
setting asks for it, Graphile Worker's SQL API for producers in the schema ``graphile_worker``
(``sql/graphile_worker.sql``), both declared as the migrating application's
(docs/applications.md): the schema is one per database, kept while an application declares it.

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


def graphile_sql() -> str:
    return (resources.files("orchestrator.storage") / "sql" / "graphile_worker.sql").read_text(
        "utf-8"
    )


async def publish(conn: psycopg.AsyncConnection[Any], producers: Producers) -> None:
    """Inside ``migrate``'s transaction: the job types, declared as the application's (those it
    withdrew go, unless another application declares them; ApplicationConflict: another
    application declares one otherwise), then Graphile Worker's API as the setting says."""
    declaration = Declaration(
        producers.application,
        {
            Kind.JOB_TYPE: {
                row["job_type"]: {k: v for k, v in row.items() if k != "job_type"}
                for row in producers.job_types
            },
            Kind.GRAPHILE: {} if producers.graphile is None else {
                GRAPHILE_SCHEMA: producers.graphile
            },
        },
    )  # fmt: skip
    declared = await declare(conn, declaration)
    declared.check()
    await conn.execute(
        QUERIES["sync_job_types"],
        {"types": Jsonb(producers.job_types), "gone": declared.gone(Kind.JOB_TYPE)},
    )
    cur = conn.cursor(row_factory=tuple_row)
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
        await cur.execute(QUERIES["graphile_declared"])
        if present and (await cur.fetchone()) == (False,):  # no other application runs it
            await conn.execute(QUERIES["graphile_drop"])
            await conn.execute(QUERIES["graphile_forget"], {"component": COMPONENT})
        return
    sql = graphile_sql()
    checksum = hashlib.sha256(sql.encode()).hexdigest()
    await cur.execute(QUERIES["graphile_checksum"], {"component": COMPONENT})
    recorded = await cur.fetchone()
    if not present or recorded is None or recorded[0] != checksum:
        await conn.execute(QUERIES["graphile_drop"])
        await conn.execute(sql.encode())
        await conn.execute(
            QUERIES["migrations_record"],
            {"component": COMPONENT, "version": COMPONENT, "name": COMPONENT,
             "checksum": checksum, "compatible": False},
        )  # fmt: skip
    await conn.execute(QUERIES["graphile_settings"], producers.graphile)
