"""A bad row, made the way a database makes one: a trigger that refuses every write to one job
(SQLSTATE P0001, "refused by the test"), as a constraint or a user's trigger would."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any
from uuid import UUID

import psycopg


@contextlib.asynccontextmanager
async def refusing_writes_to(db: psycopg.AsyncConnection[Any], job_id: UUID) -> AsyncIterator[None]:
    """Every UPDATE of this job fails until the block ends."""
    await db.execute(
        "CREATE FUNCTION test_refuse() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$"
    )
    await db.execute(
        f"CREATE TRIGGER test_refuse BEFORE UPDATE ON orc_jobs FOR EACH ROW "
        f"WHEN (OLD.id = '{job_id}') EXECUTE FUNCTION test_refuse()"
    )
    try:
        yield
    finally:
        await db.execute("DROP TRIGGER test_refuse ON orc_jobs")
        await db.execute("DROP FUNCTION test_refuse()")
