"""Connections (storage/database.py): the pool checks a connection before use only when it sat
idle; a worker loop's own connection stays the same while it works, and is replaced after an
error; a request's wait for one is bounded while the database is away, and only then
(storage/availability.py)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import psycopg
import pytest

from orchestrator.domain.errors import DatabaseUnavailable
from orchestrator.storage.availability import Availability
from orchestrator.storage.database import OwnConnection, create_pool, with_connect_timeout
from orchestrator.storage.runner import Queries
from tests.support.harness import free_port


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


async def test_a_request_s_wait_outlasts_its_bound_when_the_pool_is_only_busy(dsn: str) -> None:
    # A request waits api_database_wait_seconds for a pooled connection, then checks that the
    # database answers (storage.availability): it does, so the pool is only busy, and the
    # request waits on for the connection rather than failing as if the database were away.
    pool = create_pool(dsn, min_size=1, max_size=1)
    await pool.open(wait=True)
    queries = Queries(pool)
    availability = Availability(dsn, wait=0.1)
    held = asyncio.Event()

    async def hold() -> None:
        async with queries.connection():
            held.set()
            await asyncio.sleep(1.0)  # ten times the request's bound

    async def request() -> int:
        with availability.bounding():
            row = await queries.row("ping")
        assert row is not None
        return int(row["ok"])

    try:
        holder = asyncio.create_task(hold())
        await held.wait()
        assert await request() == 1
        await holder
        assert not availability.away
    finally:
        await pool.close()


async def test_a_request_fails_fast_while_the_database_is_away_and_not_after_it(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    # No server answers (a port nobody listens on): the request's bounded wait ends, one probe
    # fails, and it is DATABASE_UNAVAILABLE; later ones answer at once (away) until a probe
    # connects, which clears it. Said once each way, not per request.
    away = psycopg.conninfo.make_conninfo(dsn, host="127.0.0.1", port=str(free_port()))
    pool = create_pool(with_connect_timeout(away, 2), min_size=1, max_size=1)
    await pool.open()
    availability = Availability(away, wait=0.2, probe_every=0.1, log_every=1.0)
    try:
        with availability.bounding(), pytest.raises(DatabaseUnavailable):
            await Queries(pool).row("ping")
        assert availability.away and not await availability.reachable()
        for _ in range(5):
            availability.refused()  # within log_every of the first line: said nothing more
        await asyncio.sleep(1.0)
        availability.refused()  # once log_every has passed: said again, with the count
        availability.dsn = dsn  # the database is back
        assert await availability.reachable() and not availability.away
    finally:
        await pool.close(timeout=1)
    said = [r.getMessage() for r in caplog.records if r.name == "orchestrator.database"]
    assert len(said) == 3, said
    assert said[0].startswith("database unreachable (")
    assert re.match(r"database still unreachable, for \d+ s \(6 requests answered 503", said[1])
    assert re.match(r"database reachable again, after \d+ s away \(0 requests", said[2])
