"""The zombie sweep: recover the jobs of workers that died, froze or lost the database.

A zombie is a RUNNING job whose heartbeat is older than the threshold, or whose attempt is still
running ``expiry_grace`` seconds past its job timeout (the backstop: heartbeats stop advancing
then, see the ``heartbeat`` query). Each batch, in one transaction, takes at most ``batch_size``
zombies locked with SKIP LOCKED (sweepers running at once never share one):

    budget left   -> RETRY with the type's backoff, retry_count + 1 (attempt is bumped at the
                     next claim), a new dispatch;     job.zombie_detected, job.retry_scheduled
    budget spent  -> a terminal failure (orchestrator.domain.failures), job.zombie_detected
                     first
    either way    -> the lease is superseded (the old attempt's writes are refused, and its
                     worker cancels it at its next heartbeat), and the dispatch the dead worker
                     left ``doing`` is settled (failed)

The decision is the same pure policy as an attempt's, for a TRANSIENT_APP failure coded ZOMBIE
(or ZOMBIE_DEADLINE). Its times (a deadline overrun, the retry's time) are measured from the
database's now in the batch's transaction, never from the sweeper's clock. A run handles at
most ``limit`` zombies, so a mass recovery after an outage is spread over several ticks. A
zombie it cannot handle (its decision raises, or the database refuses its write even alone) is
passed over (orchestrator.services.batches.PassedOver): the others of its batch are recovered
all the same.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import timedelta
from uuid import UUID

from orchestrator.domain import events
from orchestrator.domain.classification import Classified, ErrorClass
from orchestrator.domain.events import Fault
from orchestrator.domain.failures import Failures, TerminalFailure
from orchestrator.domain.policy import Budget, Fail, Layer, decide
from orchestrator.services.batches import PassedOver, in_batches, passed_over_words
from orchestrator.storage.isolation import each_alone
from orchestrator.storage.liveness import Zombie, ZombieRetry
from orchestrator.storage.stores import Stores
from retry_config import LiveConfig


@dataclass(frozen=True)
class SweepResult:
    retried: int = 0
    failed: int = 0
    passed_over: int = 0

    @property
    def handled(self) -> int:
        return self.retried + self.failed + self.passed_over

    def sentence(self) -> str:
        return (
            f"zombie jobs recovered: {self.retried + self.failed} ({self.retried} retried, "
            f"{self.failed} failed, their budget spent){passed_over_words(self.passed_over)}"
        )

    def __add__(self, other: SweepResult) -> SweepResult:
        return SweepResult(
            self.retried + other.retried,
            self.failed + other.failed,
            self.passed_over + other.passed_over,
        )


class ZombieSweep:
    name = "sweep_zombies"

    def __init__(
        self,
        *,
        stores: Stores,
        failures: Failures,
        config: LiveConfig,
        threshold: float,
        expiry_grace: float,
        batch_size: int,
        limit: int,
        rng: random.Random | None = None,
    ) -> None:
        self.stores = stores
        self.failures = failures
        self.config = config
        self.threshold = threshold
        self.expiry_grace = expiry_grace
        self.batch_size = batch_size
        self.limit = limit
        self.rng = rng

    async def run_once(self) -> SweepResult:
        result = SweepResult()
        passed_over = PassedOver(self.name, self.stores.jobs)

        async def batch(n: int) -> int:
            nonlocal result
            done = await self.sweep_batch(n, passed_over)
            result += done
            return done.handled

        await in_batches(batch, size=self.batch_size, limit=self.limit)
        return result

    async def sweep_batch(self, limit: int, passed_over: PassedOver) -> SweepResult:
        """One transaction over at most ``limit`` zombies, but those ``passed_over``."""
        liveness = self.stores.liveness
        async with self.stores.queries.transaction() as conn:
            zombies = await liveness.zombies(
                threshold=self.threshold, limit=limit, passed_over=passed_over.keys, conn=conn
            )
            retries: list[ZombieRetry] = []
            failures: list[TerminalFailure] = []
            broken: list[tuple[UUID, UUID, Exception]] = []
            for zombie in zombies:
                try:
                    decided = self._decide(zombie)
                except Exception as exc:  # no decision for this one: the others go on
                    broken.append((zombie.id, zombie.id, exc))
                    continue
                if isinstance(decided, ZombieRetry):
                    retries.append(decided)
                else:
                    failures.append(decided)
            retried, refused = await each_alone(
                conn, retries, lambda some: liveness.retry_zombies(some, conn)
            )
            broken += [(r.item.zombie.id, r.item.zombie.id, r.error) for r in refused]
            letters, refused_failures = await each_alone(
                conn, failures, lambda some: self.stores.jobs.fail(some, conn)
            )
            broken += [(r.item.job_id, r.item.job_id, r.error) for r in refused_failures]
            # The dispatches the dead workers left doing, of the zombies handled.
            skipped = {job_id for job_id, _, _ in broken}
            await liveness.settle(
                [z.procrastinate_job_id for z in zombies
                 if z.id not in skipped and z.procrastinate_job_id is not None],
                conn,
            )  # fmt: skip
            await passed_over.record(conn, broken)
        return SweepResult(
            retried=len(retried),
            failed=sum(1 for x in letters if x is not None),
            passed_over=len(broken),
        )

    def _decide(self, zombie: Zombie) -> ZombieRetry | TerminalFailure:
        now = zombie.swept_at  # the database's clock
        overran = (
            zombie.deadline_at is not None
            and zombie.deadline_at + timedelta(seconds=self.expiry_grace) <= now
        )
        code = "ZOMBIE_DEADLINE" if overran else "ZOMBIE"
        classified = Classified(ErrorClass.TRANSIENT_APP, code)
        backoff = self.config.current.for_type(zombie.job_type).backoff
        verdict = decide(classified, Budget.of(zombie), backoff, self.rng)
        fault = Fault(self._message(zombie, overran), code, ErrorClass.TRANSIENT_APP)
        detected = events.zombie_detected(
            zombie,
            last_heartbeat=zombie.heartbeat_at,
            threshold=self.threshold,
            reason="deadline" if overran else "heartbeat",
        )
        if isinstance(verdict, Fail):
            before = (("job.zombie_detected", detected),)
            return self.failures.terminal(zombie, fault, before=before)
        return ZombieRetry(
            zombie=zombie,
            delay_ms=verdict.delay_ms,
            last_error=events.last_error(
                zombie, fault, terminal=False, layer=Layer.APP, backoff_ms=verdict.delay_ms
            ),
            detected=detected,
            retry=events.retry_scheduled(zombie, Layer.APP, verdict.delay_ms),
        )

    def _message(self, zombie: Zombie, overran: bool) -> str:
        if overran:
            return f"Zombie job detected: attempt {zombie.attempt} overran its deadline"
        return (
            f"Zombie job detected: no heartbeat since {zombie.heartbeat_at.isoformat()} "
            f"(threshold {self.threshold:g} s)"
        )
