"""Heartbeats: one statement per worker per interval for every job it runs.

Each row is fenced by its attempt's lease, and the statement returns the jobs still held. A job
missing from the answer was swept and handed to another attempt: its execution here is
cancelled at once and writes nothing, so a job never runs in two places (a heartbeat extends
the lease only for the current token: docs/contracts.md, "Leases and fencing"). Unless its
attempt let the lease go itself meanwhile: its outcome, written while the statement ran, ended
the lease (a race, not a lost lease: nothing to cancel, no warning; a write of that outcome
that finds the lease taken says so itself, "stale write refused").

The statement runs on a connection of its own, not the pool's, so a burst of job writes (a
thousand completions at once) never makes it wait in the pool's queue and arrive late; ticks
keep their cadence (the statement's time is not added to the interval).

A failing heartbeat is logged and tried again at the next interval (on a new connection),
never fatal. A worker that
could not heartbeat for most of the zombie threshold stops its executions itself, rather than
risk running beside their replacements. Heartbeats go on during a drain.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import psycopg

from orchestrator.domain.errors import DatabaseUnavailable, TransactionConflict
from orchestrator.runtime.metrics import Metrics
from orchestrator.runtime.running import Running
from orchestrator.storage.liveness import LivenessStore

logger = logging.getLogger(__name__)

#: Share of the zombie threshold after which a worker that cannot heartbeat stops its attempts.
GIVE_UP_AT = 0.8


class Heartbeats:
    def __init__(
        self,
        store: LivenessStore,
        running: Running,
        *,
        dsn: str,
        interval: float,
        zombie_threshold: float,
        expiry_grace: float,
        metrics: Metrics,
    ) -> None:
        self.store = store
        self.running = running
        self.dsn = dsn
        self.interval = interval
        self.zombie_threshold = zombie_threshold
        self.expiry_grace = expiry_grace
        self.metrics = metrics
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self.beats = 0  # successful statements so far (tests watch it)
        self._last_ok = time.monotonic()  # the last heartbeat, or the last tick with no job

    def age(self) -> float:
        """Seconds since the running jobs' last heartbeat; 0 when none runs."""
        return time.monotonic() - self._last_ok if len(self.running) else 0.0

    async def run(self) -> None:
        try:
            await self._beat()
        finally:
            if self._conn is not None:
                await self._conn.close()
                self._conn = None

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
        return self._conn

    async def _beat(self) -> None:
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        while True:
            next_tick = max(next_tick + self.interval, loop.time())
            await asyncio.sleep(next_tick - loop.time())
            self._cancel_abandoned()
            leases = self.running.leases()
            if not leases:
                self._last_ok = time.monotonic()
                continue
            started = time.monotonic()
            try:
                held = await self.store.heartbeat(
                    leases,
                    zombie_threshold=self.zombie_threshold,
                    expiry_grace=self.expiry_grace,
                    conn=await self._connection(),
                )
            except (DatabaseUnavailable, TransactionConflict, psycopg.Error, OSError) as exc:
                if self._conn is not None:
                    await self._conn.close()
                    self._conn = None
                self.metrics.heartbeat(ok=False, seconds=time.monotonic() - started)
                silent = time.monotonic() - self._last_ok
                logger.warning("heartbeat failed (%s); no heartbeat for %.1f s", exc, silent)
                if silent > GIVE_UP_AT * self.zombie_threshold:
                    for lease in leases:
                        self.running.abandon(lease, "no heartbeat for most of the threshold")
                continue
            self._last_ok = time.monotonic()
            self.metrics.heartbeat(ok=True, seconds=self._last_ok - started)
            self.beats += 1
            for lease in leases.keys() - held:
                if self.running.released_here(lease):
                    logger.debug("job %s: its own outcome ended its lease", leases[lease])
                    continue
                logger.warning(
                    "job %s was handed to another attempt; cancelling it here", leases[lease]
                )
                self.running.abandon(lease, "lease lost")

    def _cancel_abandoned(self) -> None:
        """Cancel again what was abandoned and still runs: a cancellation can be swallowed on
        Python 3.11 (asyncio.wait_for, gh-86296)."""
        for attempt in self.running:
            if attempt.lost is not None:
                attempt.abandon(attempt.lost)
