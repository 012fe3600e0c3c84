"""One bad row costs only itself: a batch is written in a savepoint of its caller's
transaction and, if the database refuses it, written again a row at a time, each in a savepoint
of its own. The rows it still refuses come back with the reason, for the caller to record and
log; the others are written. A lost connection is not a row's fault: it ends the batch
(DatabaseUnavailable), as anywhere else."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import psycopg

from orchestrator.domain.errors import DatabaseUnavailable, InvalidTransition
from orchestrator.domain.events import message_of
from orchestrator.storage.database import Conn
from orchestrator.storage.runner import REFUSED

T = TypeVar("T")
R = TypeVar("R")


#: What the database's refusal of a row raises: the driver's error, or the state machine's guard
#: (SQLSTATE WF001) as the query runner raises it.
ROW_REFUSED = (psycopg.Error, InvalidTransition)


@dataclass(frozen=True)
class Refused(Generic[T]):
    item: T
    error: Exception


async def each_alone(
    conn: Conn, items: Sequence[T], write: Callable[[Sequence[T]], Awaitable[Sequence[R]]]
) -> tuple[list[R], list[Refused[T]]]:
    """``write(items)``; if the database refuses it, ``write([item])`` for each item. Returns
    what the writes returned, and the items refused alone."""
    if not items:
        return [], []
    try:
        async with conn.transaction():
            return list(await write(items)), []
    except ROW_REFUSED as exc:
        _raise_if_lost(conn, exc)
        if len(items) == 1:
            return [], [Refused(items[0], exc)]
    written: list[R] = []
    refused: list[Refused[T]] = []
    for item in items:
        try:
            async with conn.transaction():
                written.extend(await write([item]))
        except ROW_REFUSED as exc:
            _raise_if_lost(conn, exc)
            refused.append(Refused(item, exc))
    return written, refused


def _raise_if_lost(conn: Conn, exc: Exception) -> None:
    if conn.broken or conn.closed:
        raise DatabaseUnavailable(exc) from exc


def reason_of(error: Exception) -> tuple[str, str]:
    """(message, code) of why a row could not be handled: the database's primary message and
    SQLSTATE, or the exception's message and class."""
    if isinstance(error, psycopg.Error):
        return error.diag.message_primary or message_of(error), error.sqlstate or "?"
    if isinstance(error, InvalidTransition) and error.by_database:
        return message_of(error), REFUSED
    return message_of(error), type(error).__name__
