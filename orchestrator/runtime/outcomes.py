"""What an attempt ends with, as a value, and the one code path that writes it.

An :class:`~orchestrator.runtime.attempt.Attempt` returns one of these; its worker hands it to
:class:`OutcomeWriter`, which writes it together with the end of the dispatch that ran it, in one
transaction (orchestrator.storage.dispatches):

    Completed    COMPLETED + job.completed; the dispatch succeeded (several at once: group commit;
                 a job others wait for: alone, with its worker's next fetch)
    Retried      RETRY + job.failed + job.retry_scheduled, due again ``delay_ms`` after the
                 database's now; app layer: a new dispatch (this one succeeded); infra layer:
                 Procrastinate re-runs this dispatch then;
                 pause (a 429 with a hint on a flow key): as app, no budget used, and the key
                 paused for the fleet in the same transaction
    Failed       dead letter, FAILED, degradation (orchestrator.domain.failures)
    HandedBack   PENDING + job.interrupted, a new dispatch, no budget used (drain)
    Waiting      nothing more (the step wrote WAITING_APPROVAL, or BLOCKED on its children); the
                 dispatch succeeded
    Parked       PENDING + job.waiting_for_capacity, a waiter of its flow key (its next call's
                 room is far off), no budget used; the dispatch succeeded
    Abandoned    nothing: the attempt lost its job (swept, cancelled); the dispatch is aborted
    Superseded   nothing: a write of the task itself was refused by the lease

A write refused by the lease (the job was swept, cancelled or replaced meanwhile) changes
nothing and is logged as a stale write; the dispatch is ended all the same.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from orchestrator.domain import events
from orchestrator.domain.classification import Classified, ErrorClass
from orchestrator.domain.errors import InvalidTransition, TransactionConflict
from orchestrator.domain.events import Fault
from orchestrator.domain.failures import DispatchEnd, Failures, TerminalFailure
from orchestrator.domain.flow_window import CallParked
from orchestrator.domain.models import Claim
from orchestrator.domain.policy import Budget, Fail, Layer, decide
from orchestrator.domain.states import Status
from orchestrator.runtime.group_commit import GroupCommit
from orchestrator.runtime.metrics import Metrics
from orchestrator.storage.database import OwnConnection
from orchestrator.storage.dispatches import Completion, Dispatch, DispatchStore, Taker, Throttle
from orchestrator.storage.jobs import JobStore
from retry_config import BackoffConfig

logger = logging.getLogger("orchestrator.outcomes")


@dataclass(frozen=True)
class Completed:
    result: Any
    duration_ms: float  # the attempt's, as its worker measured it


@dataclass(frozen=True)
class Retried:
    layer: Layer
    delay_ms: float  # from the database's now when it is written: no worker's clock is read
    last_error: dict[str, Any]
    failed_event: dict[str, Any]
    retry_event: dict[str, Any]
    #: The provider behind the job's flow key throttled it (docs/flow-control.md).
    throttle: Throttle | None = None


@dataclass(frozen=True)
class Failed:
    failure: TerminalFailure


@dataclass(frozen=True)
class HandedBack:
    event: dict[str, Any]


@dataclass(frozen=True)
class Parked:
    """Its next LLM call found no room on its flow key for a while (docs/flow-control.md)."""

    key: str
    blocked: str  # requests, units, share or paused
    cost: int  # the call's estimate
    release: bool  # the claim's reservation, unused, leaves the window
    not_before: float | None = None  # seconds before which its call cannot go, when known

    @classmethod
    def of(cls, parked: CallParked) -> Parked:
        return cls(parked.key, parked.blocked, parked.cost, parked.release, parked.not_before)


@dataclass(frozen=True)
class Waiting:
    what: str  # what the job waits for: an approval, or children


@dataclass(frozen=True)
class Abandoned:
    reason: str


@dataclass(frozen=True)
class Superseded:
    what: str
    error: Exception


Outcome = Completed | Retried | Failed | HandedBack | Parked | Waiting | Abandoned | Superseded
NONE = "none"


def of_failure(
    claim: Claim,
    fault: Fault,
    classified: Classified,
    *,
    dispatch_id: int,
    backoff: BackoffConfig,
    rng: random.Random,
    failures: Failures,
) -> Retried | Failed:
    """The outcome of a failed attempt, whoever ran it (a worker of this process, or an
    external worker over the API): a retry at the layer the policy picks while the budget
    lasts, else the terminal failure."""
    verdict = decide(classified, Budget.of(claim), backoff, rng, flow_key=claim.flow_key)
    if isinstance(verdict, Fail):
        return terminal(claim, fault, classified, dispatch_id=dispatch_id, failures=failures)
    throttle = None
    if claim.flow_key is not None and classified.throttled:
        pause = verdict.delay_ms / 1000 if verdict.layer is Layer.PAUSE else None
        throttle = Throttle(claim.flow_key, pause, f"{fault.code}: {fault.message}"[:500])
    return Retried(
        throttle=throttle,
        layer=verdict.layer,
        delay_ms=verdict.delay_ms,
        last_error=events.last_error(
            claim, fault, terminal=False, layer=verdict.layer, backoff_ms=verdict.delay_ms
        ),
        failed_event=events.failed(
            claim, fault, terminal=False, layer=verdict.layer, backoff_ms=verdict.delay_ms
        ),
        retry_event=events.retry_scheduled(claim, verdict.layer, verdict.delay_ms),
    )


def terminal(
    claim: Claim, fault: Fault, classified: Classified, *, dispatch_id: int, failures: Failures
) -> Failed:
    """The attempt fails its job for good. The last run of a dispatch whose infrastructure
    budget is spent ends failed in Procrastinate too; any other terminal failure was the
    task's own answer, and its dispatch succeeded."""
    infra = classified.error_class is ErrorClass.TRANSIENT_INFRA
    end = DispatchEnd(dispatch_id, "failed" if infra else "succeeded")
    return Failed(failures.terminal(claim, fault, dispatch=end))


def named(outcome: Outcome) -> tuple[str, str, str]:
    """How metrics name an outcome: (outcome, error class, layer), "none" where it has none."""
    match outcome:
        case Retried(layer=layer, last_error=error):
            return "retried", str(error.get("classification", NONE)), layer.value
        case Failed(failure=failure):
            return "failed", str(failure.last_error.get("classification", NONE)), NONE
        case HandedBack():
            return "handed_back", NONE, NONE
        case _:
            return type(outcome).__name__.lower(), NONE, NONE


class OutcomeWriter:
    """Writes one worker's outcomes. Completions that arrive while one is being written go
    together in the next statement (orchestrator.runtime.group_commit), on a connection of the
    worker's own."""

    def __init__(
        self, dispatches: DispatchStore, jobs: JobStore, connection: OwnConnection,
        metrics: Metrics,
    ) -> None:  # fmt: skip
        self.dispatches = dispatches
        self.jobs = jobs
        self.connection = connection
        self.metrics = metrics
        self._completions: GroupCommit[Completion, bool] = GroupCommit(self._complete)

    async def write(self, dispatch_id: int, claim: Claim, outcome: Outcome) -> bool:
        """Write ``outcome`` with the end of the dispatch that ran it; False when the lease or
        the state machine refused it (a stale write: logged, counted, nothing changed)."""
        match outcome:
            case Completed(result=result, duration_ms=duration_ms):
                written = await self.complete(Completion(claim, result, duration_ms, dispatch_id))
                return await self._refused_unless(written, claim, Status.COMPLETED, "completed")
            case Retried() as retried:
                written = await self.dispatches.retry(
                    claim, dispatch_id, layer=retried.layer, delay_ms=retried.delay_ms,
                    error=retried.last_error, failed_event=retried.failed_event,
                    retry_event=retried.retry_event, throttle=retried.throttle,
                )  # fmt: skip
                what = f"retry ({retried.layer})"
                return await self._refused_unless(written, claim, Status.RETRY, what)
            case Failed(failure=failure):
                [letter] = await self.jobs.fail([failure])
                return await self._refused_unless(
                    letter is not None, claim, Status.FAILED, "failed"
                )
            case HandedBack(event=event):
                written = await self.dispatches.hand_back(claim, dispatch_id, event)
                return await self._refused_unless(written, claim, Status.PENDING, "interrupted")
            case Parked(cost=cost, blocked=blocked, release=release, not_before=not_before):
                written = await self.dispatches.park(
                    claim, dispatch_id, cost=cost, blocked=blocked, release=release,
                    not_before=not_before,
                )  # fmt: skip
                return await self._refused_unless(written, claim, Status.PENDING, "parked")
            case Waiting():
                await self.dispatches.end(dispatch_id, "succeeded")
                return True
            case Abandoned(reason=reason):
                logger.info("attempt %s of job %s abandoned: %s", claim.attempt, claim.id, reason)
                await self.dispatches.end(dispatch_id, "aborted")
                return False
            case Superseded(what=what, error=error):
                self._stale(claim, what, error)
                await self.dispatches.end(dispatch_id, "aborted")
                return False

    async def complete_and_fetch(self, completion: Completion, taker: Taker) -> list[Dispatch]:
        """Write a completion alone, with a fetch of one dispatch for ``taker`` in the same
        statement, run after it: for a job others wait for, whose end may release them, its
        worker's slot passes to what that end released (a chain's next link) with no wake-up
        and one commit. If that statement fails for anything but a lost connection, the
        completion is written alone and nothing is fetched: the worker's fetch loop takes
        over. The dispatches fetched (claimed)."""
        try:
            async with self.connection.connection() as conn:
                written, fetched = await self.dispatches.complete_and_fetch(completion, taker, conn)
        except (TransactionConflict, InvalidTransition, psycopg.Error) as exc:
            logger.warning("job %s's completion with a fetch failed (%s): written alone",
                           completion.claim.id, exc)  # fmt: skip
            written, fetched = await self.complete(completion), []
        await self._refused_unless(written, completion.claim, Status.COMPLETED, "completed")
        return fetched

    async def complete(self, completion: Completion) -> bool:
        """Write a completion, with whatever others are waiting; whether its job was
        COMPLETED."""
        return await self._completions.submit(completion)

    async def _complete(self, completions: Sequence[Completion]) -> list[bool]:
        async with self.connection.connection() as conn:
            return await self.dispatches.complete(completions, conn)

    async def _refused_unless(self, written: bool, claim: Claim, target: Status, what: str) -> bool:
        if not written:
            self._stale(claim, what, await self.jobs.refusal(claim.id, target, claim.lease_token))
        return written

    def _stale(self, claim: Claim, what: str, error: Exception) -> None:
        """A superseded attempt's write was refused: the job is left as it was."""
        logger.warning(
            "stale write refused: attempt %s of job %s (%s): %s",
            claim.attempt, claim.id, what, error,
            extra={"job_id": str(claim.id), "attempt": claim.attempt, "outcome": what},
        )  # fmt: skip
        self.metrics.stale_write(claim.job_type, what.split(" ")[0])
        if isinstance(error, InvalidTransition):
            self.metrics.transition_refused(error.source, error.target, "worker")
