"""Heartbeats: one statement per worker per interval for every job it runs.

Each row is fenced by its attempt's lease, and the statement returns the jobs still held. A job
missing from the answer was swept and handed to another attempt: its execution here is
cancelled at once and writes nothing, so a job never runs in two places (seed 001: a heartbeat
extends the lease only for the current token).

A failing heartbeat is logged and tried again at the next interval, never fatal. A worker that
could not heartbeat for most of the zombie threshold stops its executions itself, rather than
risk running beside their replacements. Heartbeats go on during a drain.
"""

from __future__ import annotations

import asyncio
import logging

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
        interval: float,
        zombie_threshold: float,
        expiry_grace: float,
    ) -> None:
        self.store = store
        self.runner = runner
        self.interval = interval
        self.zombie_threshold = zombie_threshold
        self.expiry_grace = expiry_grace
        self.beats = 0  # successful statements so far (tests and metrics watch it)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        last_ok = loop.time()
        while True:
            await asyncio.sleep(self.interval)
            self._cancel_abandoned()
            leases = self.runner.leases()
            if not leases:
                last_ok = loop.time()
                continue
            try:
                held = await self.store.heartbeat(
                    leases, zombie_threshold=self.zombie_threshold, expiry_grace=self.expiry_grace
                )
            except (psycopg.Error, OSError) as exc:
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
