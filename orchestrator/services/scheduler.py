"""The users' schedules, fired: each tick of each schedule submits one ordinary job, once in the
fleet however many workers and API servers run.

Every worker and ``serve`` runs a ``Scheduler`` over the schedules its application defines,
declared first as that application's (docs/applications.md: another application's are never
touched, and one defined otherwise by another application fires nothing here). A
check is one read of where they all stand (``schedules_to_fire``, with the database's clock,
which every process reads ticks by), then, for each schedule with due ticks, one transaction
that moves it past them with a compare-and-set and submits their jobs (job key
``schedule/<name>/<tick>``): of several processes racing for a tick, one fires it and the
others match nothing. Between checks the scheduler sleeps until the soonest next tick (at most
``max_sleep``, so that a pause, a resume or a change made elsewhere is seen), never polling.

Why a loop in every process, not a maintenance-lane periodic task: a tick runs when it is due
(to the second; Procrastinate's periodic tasks tick at minutes and need a worker's maintenance
lane, which ``serve`` has not), and a schedule keeps firing while any one process of the fleet
runs. Its cost is one indexed read per process per tick or per ``max_sleep``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from orchestrator.domain.applications import Application
from orchestrator.domain.errors import (
    ApplicationConflict,
    DatabaseUnavailable,
    TransactionConflict,
)
from orchestrator.domain.schedules import MAX_TICKS, Schedule, due_ticks, next_tick
from orchestrator.storage.database import Conn
from orchestrator.storage.stores import Stores

logger = logging.getLogger(__name__)

#: The job rows (as ``JobStore.submit`` takes them) of a schedule's runs at these ticks.
Runs = Callable[[Schedule, list[datetime]], list[dict[str, Any]]]


@dataclass(frozen=True)
class FireResult:
    #: Jobs this process submitted.
    fired: int
    #: Schedules whose due ticks another process fired first.
    lost: int
    #: Seconds until the soonest next tick of a schedule not paused (None: none), 0 when a
    #: schedule has more due ticks than one transaction fires.
    wait: float | None

    @property
    def handled(self) -> int:
        return self.fired

    def sentence(self) -> str:
        return f"scheduled runs submitted: {self.fired}"


class Scheduler:
    name = "schedules"

    def __init__(
        self,
        *,
        stores: Stores,
        application: Application,
        declares: Callable[[], str],
        schedules: Mapping[str, Schedule],
        runs: Runs,
        grace: float,
        max_sleep: float,
    ) -> None:
        self.stores = stores
        self.application = application
        self.declares = declares  # the fingerprint of what this process declares
        self.schedules = dict(schedules)
        self.runs = runs
        self.grace = grace
        self.max_sleep = max_sleep
        #: name -> (the fire_after it was computed from, the next tick): a schedule whose row
        #: has not moved and whose next tick is still ahead costs a check no cron arithmetic.
        self._upcoming: dict[str, tuple[datetime, datetime]] = {}

    async def run(self) -> None:
        """Declare the definitions as the application's, then fire each tick when it comes,
        until cancelled (with none, return once declared). A database away is waited for; a
        failed check is logged and tried again; a declaration refused (another application
        defines one of these schedules otherwise) fires nothing and is tried again."""
        settled = False
        while True:
            delay = self.max_sleep
            try:
                if not settled:
                    declared = await self.stores.schedules.sync(
                        self.application, self.schedules.values(), declares=self.declares()
                    )
                    settled = not declared.deferred
                if not self.schedules:
                    if settled:
                        return
                else:
                    result = await self.run_once()
                    if result.wait is not None:
                        delay = min(result.wait, self.max_sleep)
                    if result.fired:
                        logger.info("%s: %s", self.name, result.sentence())
            except ApplicationConflict as exc:
                logger.error("%s: %s; no schedule fires here until it is mended (checking "
                             "again in %g s)", self.name, exc, self.max_sleep)  # fmt: skip
            except (DatabaseUnavailable, TransactionConflict) as exc:
                logger.warning("%s: %s; checking again in %g s", self.name, exc, self.max_sleep)
            except Exception:
                logger.exception("%s: the check failed; checking again in %g s", self.name,
                                 self.max_sleep)  # fmt: skip
            await asyncio.sleep(delay)

    async def run_once(self) -> FireResult:
        """Fire every due tick of the schedules not paused, each schedule in one transaction."""
        fired = lost = 0
        wake: float | None = None
        for state in await self.stores.schedules.states(self.schedules):
            if state.paused:
                continue
            known = self._upcoming.get(state.name)
            if known is not None and known[0] == state.fire_after and known[1] > state.now:
                wait = (known[1] - state.now).total_seconds() + 0.001
                wake = wait if wake is None else min(wake, wait)
                continue
            schedule = self.schedules[state.name]
            ticks = due_ticks(
                schedule.options, after=state.fire_after, now=state.now, grace=self.grace
            )
            moved = bool(ticks) and await self._fire(schedule, state.fire_after, ticks)
            fired += len(ticks) if moved else 0
            lost += 1 if ticks and not moved else 0
            if len(ticks) == MAX_TICKS:
                wait = 0.0
            else:
                upcoming = next_tick(schedule.options, max([state.now, *ticks]))
                if not ticks or moved:  # where the row now stands, as this process left it
                    self._upcoming[state.name] = (ticks[-1] if ticks else state.fire_after,
                                                  upcoming)  # fmt: skip
                # a millisecond past the tick: a process woken at it finds it due
                wait = (upcoming - state.now).total_seconds() + 0.001
            wake = wait if wake is None else min(wake, wait)
        return FireResult(fired=fired, lost=lost, wait=wake)

    async def _fire(self, schedule: Schedule, seen: datetime, ticks: list[datetime]) -> bool:
        """The ticks' jobs submitted and the schedule moved past them, in one transaction, if
        no other process moved it since ``seen``; whether this one did."""
        rows = self.runs(schedule, ticks)
        stores = self.stores

        async def fire(conn: Conn) -> bool:
            made = UUID(rows[-1]["id"])
            moved = await stores.schedules.fire(
                schedule.name, seen=seen, tick=ticks[-1], job_id=made, conn=conn
            )
            if moved:
                last = (await stores.jobs.submit(rows, conn))[-1].job_id
                if last != made:  # the tick's key was held: its run is the job holding it
                    await stores.schedules.last_job(schedule.name, last, conn)
            return moved

        return await stores.queries.in_transaction(fire)
