"""How every background service works through its rows: in bounded batches, each one
transaction, going on only while a batch came back full (a River-style ``runOnce``); and what
becomes of a row it cannot handle (:class:`PassedOver`)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from uuid import UUID

from orchestrator.domain import events
from orchestrator.storage.database import Conn
from orchestrator.storage.isolation import each_alone, reason_of
from orchestrator.storage.jobs import JobStore

logger = logging.getLogger("orchestrator.services")

#: A run stops after this many batches even if they keep coming back full: the next tick goes on.
MAX_BATCHES_PER_RUN = 10


async def in_batches(
    batch: Callable[[int], Awaitable[int]], *, size: int, limit: int | None = None
) -> int:
    """Run ``batch(n)``, which handles at most ``n`` rows and says how many it did, until a
    batch comes back short, ``limit`` rows are done, or MAX_BATCHES_PER_RUN batches have run;
    returns the rows handled."""
    total = 0
    for _ in range(MAX_BATCHES_PER_RUN):
        n = size if limit is None else min(size, limit - total)
        if n <= 0:
            break
        done = await batch(n)
        total += done
        if done < n:
            break
    return total


class PassedOver:
    """The rows one run of a service could not handle (its decision raised, or the database
    refused its write even alone): each is logged, recorded on its job (``job.maintenance_failed``,
    once while the reason stays the same), and left out of the run's later batches. The rest of
    the batch is written; the next run tries these again."""

    def __init__(self, service: str, jobs: JobStore) -> None:
        self.service = service
        self.jobs = jobs
        self.keys: list[UUID] = []  # the rows' own ids, which the service's query leaves out

    async def record(self, conn: Conn, rows: Sequence[tuple[UUID, UUID, Exception]]) -> None:
        """Record (row id, job id, error) each, inside ``conn``'s transaction."""
        for key, job_id, error in rows:
            self.keys.append(key)
            logger.error(
                "%s: job %s could not be handled, the rest of its batch goes on (tried again at "
                "the next run): %s", self.service, job_id, reason_of(error)[0],
                extra={"job_id": str(job_id), "service": self.service},
            )  # fmt: skip
        failures = [
            (job_id, events.maintenance_failed(self.service, *reason_of(error)))
            for _, job_id, error in rows
        ]
        _, refused = await each_alone(
            conn, failures, lambda some: self.jobs.record_maintenance_failures(some, conn)
        )
        for r in refused:
            logger.error("%s: could not record that on job %s either: %s", self.service,
                         r.item[0], r.error)  # fmt: skip


def passed_over_words(n: int) -> str:
    """How a run's log line ends when it passed ``n`` rows over ("" for none)."""
    return f"; {n} passed over (refused even alone: tried again at the next run)" if n else ""
