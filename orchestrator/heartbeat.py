"""Heartbeats: one statement per worker per interval for every job it runs.

Each row is fenced by its attempt's lease, and the statement returns the jobs still held. A job
missing from the answer was swept and handed to another attempt: its execution here is
cancelled at once and writes nothing, so a job never runs in two places (seed 001: a heartbeat
extends the lease only for the current token).

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
from typing import Any

import psycopg

from orchestrator.attempt import AttemptRunner
from orchestrator.store import JobStore

logger = logging.getLogger(__name__)

#: Share of the zombie threshold after which a worker that cannot heartbeat stops its attempts.
GIVE_UP_AT = 0.8


class Heartbeats:
    def __init__(
        self,
        store: JobStore,
        runner: AttemptRunner,
        *,
        dsn: str,
        interval: float,
        zombie_threshold: float,
        expiry_grace: float,
    ) -> None:
        self.store = store
        self.runner = runner
        self.dsn = dsn
        self.interval = interval
        self.zombie_threshold = zombie_threshold
        self.expiry_grace = expiry_grace
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self.beats = 0  # successful statements so far (tests and metrics watch it)

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
        last_ok = next_tick = loop.time()
        while True:
            next_tick = max(next_tick + self.interval, loop.time())
            await asyncio.sleep(next_tick - loop.time())
            self._cancel_abandoned()
            leases = self.runner.leases()
            if not leases:
                last_ok = loop.time()
                continue
            try:
                held = await self.store.heartbeat(
                    leases,
                    zombie_threshold=self.zombie_threshold,
                    expiry_grace=self.expiry_grace,
                    conn=await self._connection(),
                )
            except (psycopg.Error, OSError) as exc:
                if self._conn is not None:
                    await self._conn.close()
                    self._conn = None
                silent = loop.time() - last_ok
                logger.warning("heartbeat failed (%s); no heartbeat for %.1f s", exc, silent)
                if silent > GIVE_UP_AT * self.zombie_threshold:
                    for lease in leases:
                        self.runner.abandon(lease, "no heartbeat for most of the threshold")
                continue
            last_ok = loop.time()
            self.beats += 1
            for lease in leases.keys() - held:
                logger.warning(
                    "job %s was handed to another attempt; cancelling it here", leases[lease]
                )
                self.runner.abandon(lease, "lease lost")

    def _cancel_abandoned(self) -> None:
        """Cancel again what was abandoned and still runs: a cancellation can be swallowed on
        Python 3.11 (asyncio.wait_for, gh-86296)."""
        for lease, attempt in list(self.runner.running.items()):
            if attempt.lost is not None:
                self.runner.abandon(lease, attempt.lost)
