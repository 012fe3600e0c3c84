"""What wakes a worker's fetch loop: one listening connection and one timer.

- ``orc_wakeup``: every statement that schedules a dispatch for later sends its due time (epoch
  seconds); the timer is kept for the soonest one and wakes the loop when it comes due, so a
  retry starts within milliseconds of its ``next_retry_at`` rather than at the next poll.
- Procrastinate's channels: a dispatch inserted (``job_inserted``: fetch now) or a running
  dispatch asked to abort (its job was cancelled).
- A periodic look at the table re-arms the timer, and catches what was scheduled while the
  listener was away (each reconnection triggers one).

A lost connection is tried again after ``RECONNECT_FIRST`` seconds, doubling up to
``RECONNECT_MAX`` while the database stays away (one log line per attempt): a fleet in an
outage does not knock on the server every second, and the poll goes on meanwhile.

Each insert wakes one server backend and one handler per worker: this is the worker's only
listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from procrastinate import manager
from psycopg import sql

from orchestrator.domain.backoff import doubling_delay
from orchestrator.domain.errors import DatabaseUnavailable, TransactionConflict
from orchestrator.storage.liveness import LivenessStore
from orchestrator.storage.queries import QUERIES

logger = logging.getLogger(__name__)

WAKEUP_CHANNEL = "orc_wakeup"
ANY_QUEUE = tuple(manager.get_channel_for_queues(None))  # Procrastinate's, for every queue
LISTEN_CHECK_SECONDS = 30.0  # as Procrastinate's listener: a silent connection is checked
RECONNECT_FIRST = 1.0
RECONNECT_MAX = 30.0


class Wakeups:
    def __init__(
        self,
        *,
        dsn: str,
        liveness: LivenessStore,
        wake: Callable[[], None],
        notified: Callable[[str, dict[str, Any]], None],
        refresh_interval: float,
        channels: Sequence[str] = ANY_QUEUE,
    ) -> None:
        """``wake()`` makes the worker fetch (a due time came); ``notified(channel,
        notification)`` hands it what Procrastinate's ``channels`` carry (a JSON object
        each)."""
        self.dsn = dsn
        self.channels = [WAKEUP_CHANNEL, *channels]
        self.liveness = liveness
        self.wake = wake
        self.notified = notified
        self.refresh_interval = refresh_interval
        self._timer: asyncio.TimerHandle | None = None
        self._due: float | None = None  # loop time the timer fires at
        self._just_fired = False
        self._refresh_now = asyncio.Event()
        #: The database's clock less this machine's, as the last refresh measured it (the
        #: first runs as the listener connects): due times are announced by the database's.
        self._clock_offset = 0.0

    def note(self, due_epoch: float) -> None:
        """Make sure the worker wakes at ``due_epoch`` (seconds since the epoch by the
        database's clock, which announced it; this machine's may be off)."""
        self.note_in(due_epoch - time.time() - self._clock_offset)

    def note_in(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        at = loop.time() + max(0.0, seconds)
        if self._due is not None and self._due <= at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._due = at
        self._timer = loop.call_at(at, self._fire)

    def _fire(self) -> None:
        self._timer = self._due = None
        self.wake()
        self._just_fired = True
        self._refresh_now.set()  # arm the timer for the next due job

    async def run(self) -> None:
        try:
            await asyncio.gather(self._listen(), self._refresh_loop())
        finally:
            if self._timer is not None:
                self._timer.cancel()

    async def _refresh_loop(self) -> None:
        """Re-arm the timer from the table. A job that came due unseen (scheduled while the
        listener was away) wakes the worker at once, except right after the timer fired: the
        fetch it caused already looked, and waking again would only spin on a job that waits
        for a lock or a free slot."""
        while True:
            self._refresh_now.clear()  # a request made during the query runs the loop again
            just_fired, self._just_fired = self._just_fired, False
            try:
                due = await self.liveness.soonest_due(lookback=self.refresh_interval)
            except (DatabaseUnavailable, TransactionConflict, psycopg.Error, OSError) as exc:
                logger.warning("due-time refresh failed: %s", exc)
            else:
                self._clock_offset = due.now - time.time()
                if due.seconds is not None:
                    self.note_in(due.seconds)
                if due.overdue and not just_fired:
                    self.wake()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._refresh_now.wait(), self.refresh_interval)

    async def _listen(self) -> None:
        """Hear due times, inserted dispatches and abort requests, reconnecting when the
        connection is lost. A dispatch inserted before this connection listens is not missed:
        the refresh that each (re)connection triggers finds it overdue."""
        failures = 0  # attempts in a row that did not get to listen
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
                    for channel in self.channels:
                        await conn.execute(
                            sql.SQL(QUERIES["listen_channel"]).format(sql.Identifier(channel))
                        )
                    if failures:
                        logger.warning("wake-up listener: listening again")
                    failures = 0
                    self._refresh_now.set()  # catch up on anything scheduled while away
                    while True:
                        async for notify in conn.notifies(timeout=LISTEN_CHECK_SECONDS):
                            self.heard(notify.channel, notify.payload)
                        # Quiet for a while: make sure the connection is still there (one the
                        # network dropped silently would otherwise leave the worker polling).
                        await conn.execute(QUERIES["ping"])
            except (psycopg.OperationalError, OSError) as exc:
                failures += 1
                delay = doubling_delay(failures, first=RECONNECT_FIRST, cap=RECONNECT_MAX)
                logger.warning(
                    "wake-up listener %s (%s); reconnecting in %.0f s",
                    "lost its connection" if failures == 1 else "still cannot connect",
                    " ".join(str(exc).split()), delay,
                )  # fmt: skip
                await asyncio.sleep(delay)

    def heard(self, channel: str, payload: str) -> None:
        """One notification; a malformed one is logged and ignored (this listener is the
        worker's only one: nothing it hears may end it)."""
        try:
            if channel == WAKEUP_CHANNEL:
                self.note(float(payload))
                return
            notification = json.loads(payload)
            if not isinstance(notification, dict):
                raise ValueError("not a JSON object")
        except ValueError:
            logger.warning("ignoring malformed notification %r on %s", payload, channel)
            return
        try:
            self.notified(channel, notification)
        except Exception:  # one notification must not end the worker's only listener
            logger.exception("handling notification %r on %s failed", payload, channel)
