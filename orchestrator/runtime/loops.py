"""How a worker's loops outlive their errors: a side loop is run again after it fails, and a
write the database could not take (it was away, or rolled the write back in a conflict) is tried
again, each after a delay that doubles up to a cap, through an outage of any length."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import psycopg

from orchestrator.domain.backoff import doubling_delay
from orchestrator.domain.errors import DatabaseUnavailable, TransactionConflict

logger = logging.getLogger(__name__)

FIRST_DELAY = 0.5
MAX_DELAY = 30.0
#: What a lost or refused connection raises: the stores' DatabaseUnavailable, and psycopg's own
#: errors on the worker's own connections (psycopg_pool's PoolTimeout is an OperationalError).
CONNECTION_ERRORS = (DatabaseUnavailable, psycopg.OperationalError, psycopg.InterfaceError)
#: What a write tried again is tried again after: those, and a transaction the database rolled
#: back to break a deadlock (nothing of it was kept).
RETRYABLE = (*CONNECTION_ERRORS, TransactionConflict)
T = TypeVar("T")


class Backoff:
    """Delays that double from ``first`` up to ``cap``; ``reset`` once things work again."""

    def __init__(self, first: float = 0.1, cap: float = 5.0) -> None:
        self.first = first
        self.cap = cap
        self.failures = 0

    def next(self) -> float:
        self.failures += 1
        return doubling_delay(self.failures, first=self.first, cap=self.cap)

    def reset(self) -> None:
        self.failures = 0


async def until_written(what: str, write: Callable[[], Awaitable[T]]) -> T:
    """``write()``, tried again while the database cannot be reached, or rolls it back in a
    conflict. Writes retried here are idempotent or fenced: a second one after a lost
    acknowledgement changes nothing."""
    backoff = Backoff()
    while True:
        try:
            return await write()
        except RETRYABLE as exc:
            delay = backoff.next()
            if backoff.failures == 1:
                logger.warning("%s: %s (%s); trying again", what, _trouble(exc), _reason(exc))
            await asyncio.sleep(delay)


def _trouble(exc: BaseException) -> str:
    return (
        "rolled back in a conflict"
        if isinstance(exc, TransactionConflict)
        else "database unreachable"
    )


def _reason(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


async def keep_running(
    name: str,
    body: Callable[[], Awaitable[None]],
    *,
    first_delay: float = FIRST_DELAY,
    max_delay: float = MAX_DELAY,
) -> None:
    """Run ``body`` until it returns or this is cancelled. When it raises, log it and run it
    again after a delay that doubles up to ``max_delay`` (reset once a run has lasted that long),
    so a side loop never takes its worker down with it, whatever the outage."""
    loop = asyncio.get_running_loop()
    delay = first_delay
    while True:
        started = loop.time()
        try:
            await body()
            return
        except Exception as exc:
            if loop.time() - started >= max_delay:
                delay = first_delay
            logger.warning("%s failed (%s: %s); again in %.1f s", name,
                           type(exc).__name__, exc, delay)  # fmt: skip
        await asyncio.sleep(delay)
        delay = min(max_delay, delay * 2)
