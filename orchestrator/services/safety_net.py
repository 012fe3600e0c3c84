"""The retry safety net: every waiting job (PENDING, or RETRY past due) has a live dispatch.

One can be lost: its Procrastinate job deleted by hand, finished by mistake, or held ``doing``
by a worker that stopped heartbeating in Procrastinate's registry. The net settles such a dead
worker's dispatch and gives the job a new one (``job.redispatched``), a batch per transaction. A
job whose write the database refuses even alone is passed over
(orchestrator.services.batches.PassedOver); the rest of its batch is dispatched.

A job parked for capacity on a flow key has no dispatch on purpose; the net leaves it to its
key, and hands the free capacity of any key whose line has waiters and none on its way to
them: the backstop of a wake-up that was missed (docs/flow-control.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.services.batches import PassedOver, in_batches, passed_over_words
from orchestrator.storage.isolation import each_alone
from orchestrator.storage.stores import Stores


@dataclass(frozen=True)
class SafetyNetResult:
    redispatched: int
    passed_over: int = 0
    #: Jobs waiting for capacity on a flow key that a pump let go.
    woken: int = 0

    @property
    def handled(self) -> int:
        return self.redispatched + self.passed_over + self.woken

    def sentence(self) -> str:
        woken = f", waiting for capacity woken: {self.woken}" if self.woken else ""
        return (
            f"waiting jobs given a new dispatch: {self.redispatched}"
            f"{passed_over_words(self.passed_over)}{woken}"
        )


class RetrySafetyNet:
    name = "retry_safety_net"

    def __init__(
        self,
        *,
        stores: Stores,
        grace_seconds: float,
        stalled_seconds: float,
        batch_size: int,
    ) -> None:
        """A waiting job is past due by ``grace_seconds`` before the net looks at it; a worker
        silent for ``stalled_seconds`` is dead."""
        self.stores = stores
        self.grace_seconds = grace_seconds
        self.stalled_seconds = stalled_seconds
        self.batch_size = batch_size

    async def run_once(self) -> SafetyNetResult:
        redispatched = 0
        passed_over = PassedOver(self.name, self.stores.jobs)

        async def batch(limit: int) -> int:
            nonlocal redispatched
            done, refused = await self.redispatch_batch(limit, passed_over)
            redispatched += done
            return done + refused

        await in_batches(batch, size=self.batch_size)
        woken = await self.stores.flow.backstop()
        return SafetyNetResult(redispatched, len(passed_over.keys), woken)

    async def redispatch_batch(self, limit: int, passed_over: PassedOver) -> tuple[int, int]:
        """One transaction: (jobs redispatched, jobs passed over)."""
        liveness = self.stores.liveness
        async with self.stores.queries.transaction() as conn:
            lost = await liveness.lost_dispatches(
                grace_seconds=self.grace_seconds, stalled_seconds=self.stalled_seconds,
                limit=limit, passed_over=passed_over.keys, conn=conn,
            )  # fmt: skip
            done, refused = await each_alone(
                conn, lost, lambda some: liveness.redispatch(some, conn)
            )
            await passed_over.record(conn, [(r.item.id, r.item.id, r.error) for r in refused])
        return len(done), len(refused)
