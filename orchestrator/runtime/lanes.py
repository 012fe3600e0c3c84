"""A worker's lanes: each a share of its capacity, with a fetch loop and wake-ups of its own.

    jobs         ``concurrency`` slots; the worker's queues (every queue when none is named)
    maintenance  one slot; the maintenance queue only: the services' ticks (zombie sweep, retry
                 safety net, ...) start on time whatever the backlog, never waiting for a job's
                 slot to free (a backlog of jobs is what a sweep must not wait behind)

A lane fetches at most its free slots. A dispatch it started frees its slot when its attempt has
ended, before its outcome is written: the next fetch then overlaps that write (as Graphile
Worker's workers fetch their next job while the last one's completion is written), rather than
waiting for it. Writes in flight are bounded too: a lane never holds more than twice its
capacity in dispatches, running or being written, so a database that writes slowly stops the
fetches. What Procrastinate announces on a lane's channels (a dispatch inserted) wakes that
lane; a job's due time wakes the jobs lane.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from procrastinate import manager


@dataclass(eq=False)
class Lane:
    name: str
    queues: list[str] | None  # None: every queue
    capacity: int
    #: Queues it never takes, even as "every queue": those of external job types, and of other
    #: applications' job types (refreshed by the worker's registry heartbeat).
    excluded: tuple[str, ...] = ()
    woken: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    slot_freed: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    #: Every dispatch it started and that has not ended (a drain waits for them).
    tasks: set[asyncio.Task[None]] = field(default_factory=set, init=False)
    #: Those whose attempt still runs: each holds a slot.
    holding: set[asyncio.Task[None]] = field(default_factory=set, init=False)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"{self.name} lane: capacity must be >= 1, got {self.capacity}")

    @property
    def free(self) -> int:
        """Slots free, as long as the outcomes being written leave room."""
        return min(self.capacity - len(self.holding), 2 * self.capacity - len(self.tasks))

    @property
    def channels(self) -> list[str]:
        """Procrastinate's notification channels for the lane's queues."""
        return list(manager.get_channel_for_queues(self.queues))

    @property
    def idle(self) -> bool:
        """Nothing started is left, not even an outcome's write (which may add a dispatch)."""
        return not self.tasks

    def wake(self) -> None:
        self.woken.set()

    def stop(self) -> None:
        """Wake every wait of the lane's loop, so that it sees the stop."""
        self.woken.set()
        self.slot_freed.set()

    def take(self, task: asyncio.Task[None]) -> None:
        """A slot for ``task``, freed when its attempt has ended (:meth:`ran`), or else when it
        ends."""
        self.tasks.add(task)
        self.holding.add(task)
        task.add_done_callback(self._release)

    def ran(self, task: asyncio.Task[Any] | None) -> None:
        """``task``'s attempt has ended: its slot is free while its outcome is written."""
        if task in self.holding:
            self.holding.discard(task)
            self.slot_freed.set()

    def _release(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self.holding.discard(task)
        self.slot_freed.set()


def lanes_for(
    *,
    queues: Sequence[str] | None,
    concurrency: int,
    maintenance_queue: str | None,
    excluded: Sequence[str] = (),
) -> tuple[Lane, ...]:
    """The jobs lane (never taking the ``excluded`` queues), and a maintenance lane unless
    ``maintenance_queue`` is None."""
    jobs = Lane("jobs", list(queues) if queues is not None else None, concurrency, tuple(excluded))
    if maintenance_queue is None:
        return (jobs,)
    return jobs, Lane("maintenance", [maintenance_queue], 1)
