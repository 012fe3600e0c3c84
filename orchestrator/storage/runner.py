"""The query runner every store takes: named queries (the ``.sql`` beside each store) on a pool.

A store method runs on a pooled connection, or inside its caller's transaction when given
``conn`` (so one transaction can span several stores: a failure and the escalation job it
submits, a decision and the dispatch it makes). A connection lost or refused, whatever the
statement, raises :class:`~orchestrator.domain.errors.DatabaseUnavailable` with the reason: the
one error the rest of the code has to know for "the database is away". Inside an API request
the wait for a pooled connection is bounded (orchestrator.storage.availability).

A status change the database's guard refuses (SQLSTATE WF001) raises
:class:`~orchestrator.domain.errors.InvalidTransition` (``by_database``), and is reported to the
runner's ``on_refused`` (the worker counts it: an alert pages on it).

A deadlock or serialization failure (SQLSTATE 40P01, 40001) rolls the whole transaction back,
so a transaction this runner owns is run again, a few times, after a short random pause: a
statement run on a pooled connection (a transaction of its own), and the work given to
:meth:`Queries.in_transaction`. Inside a caller's transaction only the caller can run it again.
What reaches the caller is :class:`~orchestrator.domain.errors.TransactionConflict`, never the
driver's error.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, LiteralString, TypeVar

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import PoolTimeout

from orchestrator.domain.errors import DatabaseUnavailable, InvalidTransition, TransactionConflict
from orchestrator.storage import availability
from orchestrator.storage.database import Conn, Pool
from orchestrator.storage.queries import QUERIES

Row = dict[str, Any]
Params = dict[str, Any]
T = TypeVar("T")
#: What a lost or refused connection raises (psycopg_pool's PoolTimeout is an OperationalError).
LOST = (psycopg.OperationalError, psycopg.InterfaceError)
#: What a transaction the server rolled back to let others go on raises (OperationalErrors too).
CONFLICTS = (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)
#: The SQLSTATE of the state machine's guard (orc_jobs' trigger): WF_STATE_TRANSITION_INVALID.
REFUSED = "WF001"
#: Its messages: "job ID cannot go from A to B", "job ID is finished (S): ...", "job ID is S: ...".
_MOVE = re.compile(r"job (\S+) cannot go from (\w+) to (\w+)")
_STAY = re.compile(r"job (\S+) is (?:finished \()?(\w+)")
OnRefused = Callable[[InvalidTransition], None]
CONFLICT_TRIES = 5
CONFLICT_PAUSE = 0.01  # seconds before the second try; doubled for each further one, jittered


@contextmanager
def as_orchestrator_errors(on_refused: OnRefused | None = None) -> Iterator[None]:
    try:
        yield
    except CONFLICTS as exc:
        raise TransactionConflict(exc) from exc
    except LOST as exc:
        raise DatabaseUnavailable(exc) from exc
    except psycopg.Error as exc:
        if exc.sqlstate != REFUSED:
            raise
        refused = refused_by_database(exc)
        if on_refused is not None:
            on_refused(refused)
        raise refused from exc


def refused_by_database(exc: psycopg.Error) -> InvalidTransition:
    """The guard's refusal, as the error the rest of the code knows: which job, and which
    change (a finished job's outcome rewritten is a change from its status to itself)."""
    message = exc.diag.message_primary or str(exc)
    if moved := _MOVE.search(message):
        job_id, source, target = moved.groups()
    elif stayed := _STAY.search(message):
        job_id, source = stayed.groups()
        target = source
    else:
        job_id, source, target = "?", "?", "?"
    return InvalidTransition(job_id, source, target, by_database=True, message=message)


class Queries:
    def __init__(self, pool: Pool, *, on_refused: OnRefused | None = None) -> None:
        self.pool = pool
        self.on_refused = on_refused

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Conn]:
        """A pooled connection inside a transaction, committed when the block ends."""
        with as_orchestrator_errors(self.on_refused):
            async with self._pooled() as conn, conn.transaction():
                yield conn

    async def in_transaction(self, work: Callable[[Conn], Awaitable[T]]) -> T:
        """``work(conn)`` in a transaction of its own, committed when it returns; run again,
        whole, after a conflict. ``work`` must only write through ``conn``."""

        async def once() -> T:
            async with self.transaction() as conn:
                return await work(conn)

        return await _retried(once)

    @asynccontextmanager
    async def connection(self, conn: Conn | None = None) -> AsyncIterator[Conn]:
        """``conn`` itself, or a pooled connection for the block."""
        if conn is not None:
            with as_orchestrator_errors(self.on_refused):
                yield conn
            return
        with as_orchestrator_errors(self.on_refused):
            async with self._pooled() as pooled:
                yield pooled

    @asynccontextmanager
    async def _pooled(self) -> AsyncIterator[Conn]:
        """A pooled connection; inside a request, waited for as storage.availability says (a
        bounded wait, then on only if the database answers)."""
        bound = availability.BOUND.get()
        if bound is None:
            async with self.pool.connection() as conn:
                yield conn
            return
        async with contextlib.AsyncExitStack() as stack:
            try:
                conn = await stack.enter_async_context(self.pool.connection(timeout=bound.wait))
            except PoolTimeout:
                if not await bound.reachable():
                    raise DatabaseUnavailable(bound.reason) from None
                conn = await stack.enter_async_context(self.pool.connection())
            yield conn

    async def rows(
        self, name: LiteralString, params: Params | None = None, conn: Conn | None = None
    ) -> list[Row]:
        """The rows ``name`` returns ([] for a statement that returns none)."""

        async def run(c: Conn) -> list[Row]:
            cur = c.cursor(row_factory=dict_row)
            await cur.execute(QUERIES[name], params or {})
            return await cur.fetchall() if cur.description else []

        return await self._run(run, conn)

    async def row(
        self, name: LiteralString, params: Params | None = None, conn: Conn | None = None
    ) -> Row | None:
        """The first row ``name`` returns, or None."""

        async def run(c: Conn) -> Row | None:
            cur = c.cursor(row_factory=dict_row)
            await cur.execute(QUERIES[name], params or {})
            return await cur.fetchone() if cur.description else None

        return await self._run(run, conn)

    async def execute(
        self, name: LiteralString, params: Params | None = None, conn: Conn | None = None
    ) -> int:
        """Run ``name``; the number of rows it touched."""

        async def run(c: Conn) -> int:
            cur = await c.execute(QUERIES[name], params or {})
            return cur.rowcount

        return await self._run(run, conn)

    async def _run(self, statement: Callable[[Conn], Awaitable[T]], conn: Conn | None) -> T:
        """``statement`` on ``conn``, or on a pooled connection, where it is a transaction of
        its own and is run again after a conflict."""
        if conn is not None:
            async with self.connection(conn) as c:
                return await statement(c)

        async def once() -> T:
            async with self.connection() as c:
                return await statement(c)

        return await _retried(once)


async def _retried(transaction: Callable[[], Awaitable[T]]) -> T:
    """``transaction()``, run again after a conflict, up to CONFLICT_TRIES times in all."""
    pause = CONFLICT_PAUSE
    for _ in range(CONFLICT_TRIES - 1):
        try:
            return await transaction()
        except TransactionConflict:
            await asyncio.sleep(random.uniform(0, pause))
            pause *= 2
    return await transaction()
