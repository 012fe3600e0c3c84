"""The worker's shutdown, fitted to a Kubernetes ``preStop`` hook and grace period.

first SIGTERM/SIGINT   stop fetching at once, report not ready; running jobs go on (their
                       heartbeats too) until they finish or the drain deadline (45 s)
drain deadline         each attempt still running is aborted: its context's should_abort()
                       turns true and its task is cancelled; it hands its job back (PENDING,
                       a new dispatch in the same transaction, no retry budget, an event
                       job.interrupted), so another worker resumes it from its last checkpoint
                       within moments instead of after the zombie threshold
then                   the pool closes and the process exits 0; EXIT_GRACE seconds after the
                       deadline it exits regardless (by 55 s at worst)
second signal          exit at once; the sweep recovers what was left
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable

from orchestrator.runtime.running import Running

logger = logging.getLogger(__name__)

EXIT_GRACE = 5.0  # seconds after the drain deadline before the process exits regardless
RECANCEL_EVERY = 0.2  # a cancellation can be swallowed on Python 3.11 (gh-86296): repeat it


class Drain:
    def __init__(
        self,
        *,
        stop_fetching: Callable[[], None],
        running: Running,
        deadline: float,
    ) -> None:
        self.stop_fetching = stop_fetching
        self.running = running
        self.deadline = deadline
        self.draining = False
        self._enforcer: asyncio.Task[None] | None = None

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_signal, sig)

    def uninstall(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)

    def close(self) -> None:
        """The worker has stopped: its deadline no longer applies."""
        if self._enforcer is not None:
            self._enforcer.cancel()

    def on_signal(self, sig: signal.Signals) -> None:
        if self.draining:
            logger.warning(
                "%s during the drain: exiting now; the sweep recovers the rest", sig.name
            )
            os._exit(1)
        self.begin(sig.name)

    def begin(self, why: str) -> None:
        """Start draining (idempotent)."""
        if self.draining:
            return
        self.draining = True
        running = len(self.running)
        # A warning only when jobs are at stake: an idle worker's stop is a normal shutdown.
        logger.log(
            logging.WARNING if running else logging.INFO,
            "%s: draining (%d job(s) running, deadline %g s)", why, running, self.deadline,
        )  # fmt: skip
        self.stop_fetching()
        self._enforcer = asyncio.get_running_loop().create_task(self._enforce(), name="drain")

    async def _enforce(self) -> None:
        await asyncio.sleep(self.deadline)
        if self.running:
            still = len(self.running)
            logger.warning("drain deadline: handing back %d job(s) still running", still)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + EXIT_GRACE
        while self.running:
            if loop.time() > give_up:
                logger.error("attempts did not end %g s after the drain deadline", EXIT_GRACE)
                os._exit(0)
            for attempt in self.running:
                attempt.interrupt("drain deadline")
            await asyncio.sleep(RECANCEL_EVERY)
