"""Connections (storage/database.py): the pool checks a connection before use only when it sat
idle; a worker loop's own connection stays the same while it works, and is replaced after an
error."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from orchestrator.domain.errors import DatabaseUnavailable
from orchestrator.storage.database import OwnConnection, create_pool
from orchestrator.storage.runner import Queries


async def dropped_while_idle(dsn: str, idle_check_seconds: float, pause: float) -> Any:
    """Use the pool's one connection, have the server end it, wait, and use the pool again."""
    pool = create_pool(dsn, min_size=1, max_size=1, idle_check_seconds=idle_check_seconds)
    await pool.open(wait=True)
    try:
        async with pool.connection() as conn:
            pid = conn.info.backend_pid
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as admin:
            await admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        await asyncio.sleep(pause)
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT pg_backend_pid() AS pid")
            row = await cur.fetchone()
            assert row is not None
            assert row["pid"] != pid
            return row["pid"]
    finally:
        await pool.close()


async def test_a_connection_dropped_while_idle_is_replaced_before_use(dsn: str) -> None:
    assert await dropped_while_idle(dsn, idle_check_seconds=0.2, pause=0.4)


async def test_a_connection_dropped_in_steady_use_fails_one_statement_then_is_replaced(
    dsn: str,
) -> None:
    # Handed out again within the threshold, it is not checked (a check per checkout doubles a
    # busy worker's round trips): the one statement that finds it dead fails, as the stores'
    # DatabaseUnavailable (never run again by itself: it may have committed), and the pool
    # drops it; the next statement runs on a new connection.
    pool = create_pool(dsn, min_size=1, max_size=1, idle_check_seconds=60)
    await pool.open(wait=True)
    queries = Queries(pool)

    async def backend() -> int:
        async with queries.connection() as conn:
            pid: int = conn.info.backend_pid
            await conn.execute("SELECT 1")
            return pid

    try:
        first = await backend()
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as admin:
            await admin.execute("SELECT pg_terminate_backend(%s)", (first,))
        await asyncio.sleep(0.4)
        with pytest.raises(DatabaseUnavailable):
            await backend()
        assert await backend() != first
    finally:
        await pool.close()


async def test_a_loops_own_connection_is_kept_and_replaced_after_an_error(dsn: str) -> None:
    own = OwnConnection(dsn, "test")
    try:
        pids = []
        for _ in range(3):  # one backend for consecutive statements: its caches stay warm
            async with own.connection() as conn:
                pids.append(conn.info.backend_pid)
        assert len(set(pids)) == 1
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as admin:
            await admin.execute("SELECT pg_terminate_backend(%s)", (pids[0],))
        with pytest.raises(psycopg.OperationalError):
            async with own.connection() as conn:
                await conn.execute("SELECT 1")
        async with own.connection() as conn:  # the failed one was dropped: a new one
            cur = await conn.execute("SELECT pg_backend_pid() AS pid")
            row = await cur.fetchone()
            assert row is not None and row["pid"] != pids[0]
    finally:
        await own.close()
