"""Shared set-up for the benchmarks: a fresh, migrated database on the configured server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import psycopg
from procrastinate.schema import SchemaManager

from orchestrator.database import drop_database, ensure_database, start_embedded, with_database
from orchestrator.migrate import migrate

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def fresh_database(
    prefix: str = "orc_bench",
    *,
    schema: Literal["orchestrator", "procrastinate"] | None = "orchestrator",
) -> Iterator[str]:
    """A new database (dropped afterwards) on DATABASE_URL's server, or the embedded one, with
    the orchestrator's schema, Procrastinate's alone, or none."""
    server = os.environ.get("DATABASE_URL") or start_embedded(ROOT / ".orchestrator")
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    ensure_database(server, name)
    dsn = with_database(server, name)

    async def apply() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            if schema == "orchestrator":
                await migrate(conn)
            else:
                await conn.execute(SchemaManager.get_schema().encode())

    if schema is not None:
        asyncio.run(apply())
    try:
        yield dsn
    finally:
        drop_database(server, name)


def machine() -> str:
    server = "DATABASE_URL" if os.environ.get("DATABASE_URL") else "embedded PostgreSQL"
    python = f"{platform.python_implementation()} {platform.python_version()}"
    return f"{os.cpu_count()} cores, {python}, {server}"


async def server_version(dsn: str) -> str:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute("SHOW server_version")
        row = await cur.fetchone()
        return str(row[0]) if row else "?"


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]
