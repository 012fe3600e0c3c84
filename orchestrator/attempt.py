"""One attempt of one job, run inside one Procrastinate job: claim, run the task, record.

    claim (PENDING/RETRY -> RUNNING, with the fetch; dispatching.py)   none: stale dispatch, no-op
    run the task under the job timeout, each checkpointed step under the step timeout
    success                     -> COMPLETED, written with Procrastinate's finish (dispatching.py)
    TRANSIENT_APP, budget left  -> RETRY + a new dispatch at next_retry_at; return normally
    TRANSIENT_INFRA, runs left  -> RETRY (no app budget used); raise InfraRetry so Procrastinate
                                   re-runs this dispatch after exp(min(10, run)) s
    anything else, or exhausted -> FAILED + dead letter (infra exhaustion re-raises, so the
                                   Procrastinate job ends failed too)
    job timeout                 -> FAILED ("Job timed out after N seconds"), dead letter
    step timeout                -> the step is cancelled; TRANSIENT_APP: RETRY from the last
                                   checkpoint (or FAILED once the budget is spent)
    cancelled (drain, abort)    -> handed back to PENDING, no budget used; cancellation re-raised
    waiting for an approval     -> nothing more: the wait itself was written by the task's step

Before any outcome, side-effect results the attempt still holds are committed (ledger flush).
A write refused because the attempt lost its lease (the job was cancelled, swept, or replaced)
is logged, not retried: a stale attempt never changes the job. An attempt the heartbeats found
superseded is cancelled and writes nothing at all.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast
from uuid import UUID

import httpx
import procrastinate
from pydantic import ValidationError

from checkpoints import AwaitingApproval, CheckpointStore, Fence, Ledger
from orchestrator import events
from orchestrator.calls import http_client
from orchestrator.classification import Classified, Classifier, ErrorClass, classify
from orchestrator.context import JobContext
from orchestrator.degradation import Degrader
from orchestrator.errors import InvalidOutput, InvalidTransition, StaleLease, StepTimedOut
from orchestrator.models import Claim
from orchestrator.policy import Budget, Fail, Layer, decide
from orchestrator.registry import JobType
from orchestrator.retry_strategy import InfraRetry
from orchestrator.secrets import Secrets
from retry_config import JobRetryConfig, RetryConfig

if TYPE_CHECKING:
    from orchestrator.dispatching import DispatchManager
    from orchestrator.store import JobStore

logger = logging.getLogger("orchestrator.attempt")


class AsyncClosable(Protocol):
    async def aclose(self) -> None: ...


C = TypeVar("C", bound=AsyncClosable)

#: This process, as it appears in ``locked_by`` (``/w<procrastinate worker id>`` is added).
HOST = f"{socket.gethostname()}/{os.getpid()}"


class AttemptRunner:
    """Runs the attempts of one worker (shared); each dispatch gets an :class:`Attempt`."""

    def __init__(
        self,
        *,
        store: JobStore,
        checkpoints: CheckpointStore,
        job_types: Mapping[str, JobType],
        config: Callable[[], RetryConfig],
        classifiers: Sequence[Classifier],
        dispatches: DispatchManager,
        degrade: Degrader,
        secrets: Secrets,
        rng: random.Random | None = None,
    ) -> None:
        self.store = store
        self.degrade = degrade
        self.secrets = secrets
        self.checkpoints = checkpoints
        self.dispatches = dispatches
        self.job_types = job_types
        self.config = config
        self.classifiers = classifiers
        self.rng = rng or random.Random()
        #: Called with the job id whenever an attempt gave its job a dispatch that may already
        #: be due (the worker then fetches again once this dispatch has finished).
        self.on_redispatch: Callable[[UUID], None] = lambda job_id: None
        #: The attempts running now, by lease token (the heartbeats refresh their leases). One
        #: job can have two here: a superseded attempt not yet stopped, and its replacement.
        self.running: dict[UUID, Attempt] = {}
        self._shared: dict[Hashable, AsyncClosable] = {}

    def http(self, job_type: str, config: JobRetryConfig) -> httpx.AsyncClient:
        """The job type's HTTP client (shared by its attempts, so connections are reused)."""
        return self.shared(("http", job_type), lambda: http_client(config))

    def shared(self, key: Hashable, make: Callable[[], C]) -> C:
        """One client per ``key`` for the attempts of this worker (``ctx.shared``); closed
        (``aclose()``) when the worker stops."""
        client = self._shared.get(key)
        if client is None:
            client = self._shared[key] = make()
        return cast("C", client)

    async def aclose(self) -> None:
        """Close the shared clients (the worker stopped; the next run makes new ones)."""
        clients, self._shared = list(self._shared.values()), {}
        for client in clients:
            await client.aclose()

    def leases(self) -> dict[UUID, UUID]:
        """Lease token -> job id, of the attempts still believed to hold their job."""
        return {lease: a.claim.id for lease, a in self.running.items() if a.lost is None}

    def running_jobs(self) -> set[UUID]:
        return {a.claim.id for a in self.running.values()}

    def abandon(self, lease_token: UUID, reason: str) -> None:
        """Stop an attempt that no longer holds its job (or cannot prove it does): it is
        cancelled and writes nothing more."""
        attempt = self.running.get(lease_token)
        if attempt is not None:
            attempt.abandon(reason)

    async def run(
        self, pctx: procrastinate.JobContext, job_id: str, claimed: dict[str, Any] | None
    ) -> None:
        if claimed is None:
            logger.info(
                "dispatch %s of job %s is stale or a duplicate; skipped", pctx.job.id, job_id
            )
            return
        await Attempt(self, pctx, Claim.model_validate(claimed)).run()


class Attempt:
    def __init__(self, runner: AttemptRunner, pctx: procrastinate.JobContext, claim: Claim):
        self.runner = runner
        self.lost: str | None = None  # why the attempt was abandoned, if it was
        self.interrupted: str | None = None  # why it was asked to stop (drain), if it was
        self._task: asyncio.Task[Any] | None = None
        self.store = runner.store
        self.pctx = pctx
        self.claim = claim
        self.job_type = runner.job_types[claim.job_type]
        self.config: JobRetryConfig = runner.config().for_type(claim.job_type)
        self.timeout_seconds = claim.timeout_seconds or self.config.job_timeout_seconds
        self.step_clock = StepDeadline(
            self.config.step_timeout(self.timeout_seconds), self._step_overran
        )
        self.ledger = Ledger(
            runner.checkpoints,
            Fence(claim.id, claim.lease_token, claim.attempt),
            list(runner.classifiers),
        )

    def _context(self) -> JobContext:
        """The task's view of this attempt. Made when the task starts and not kept here, so
        the attempt and its context form no reference cycle: both are freed as soon as the
        attempt is over, without waiting for the garbage collector."""
        runner, claim, pctx = self.runner, self.claim, self.pctx
        return JobContext(
            job_id=claim.id,
            job_type=claim.job_type,
            attempt=claim.attempt,
            run=claim.dispatch_attempt,
            retry_count=claim.retry_count,
            max_retries=claim.max_retries,
            lease_token=claim.lease_token,
            worker=claim.locked_by,
            trace_id=claim.trace_id,
            agent_id=claim.agent_id,
            config=self.config,
            http=runner.http(claim.job_type, self.config),
            secrets=runner.secrets,
            log=logging.LoggerAdapter(
                logging.getLogger(f"orchestrator.job.{claim.job_type}"),
                {"job_id": str(claim.id), "attempt": claim.attempt, "trace_id": claim.trace_id},
            ),
            _should_abort=lambda: (
                self.interrupted is not None
                or self.lost is not None
                or self.step_clock.overran is not None
                or pctx.should_abort()
            ),
            _shared=runner.shared,
            _ledger=self.ledger,
            _checkpoints=runner.checkpoints,
            _step_clock=self.step_clock,
        )

    def abandon(self, reason: str) -> None:
        """It no longer holds its job: cancel it, and let it write nothing."""
        self.lost = reason
        if self._task is not None:
            self._task.cancel()  # repeated at each heartbeat while it runs (see heartbeat.py)

    def interrupt(self, reason: str) -> None:
        """Stop it and hand its job back (drain): ``ctx.should_abort()`` and a cancellation."""
        self.interrupted = reason
        if self._task is not None:
            self._task.cancel()  # repeated by the drain while it runs (see drain.py)

    def _step_overran(self) -> None:
        if self._task is not None and self.lost is None and self.interrupted is None:
            self._task.cancel()

    async def run(self) -> None:
        self._task = asyncio.current_task()
        lease = self.claim.lease_token
        self.runner.running[lease] = self
        try:
            await self._run()
        finally:
            del self.runner.running[lease]
            self.step_clock.close()

    async def _run(self) -> None:
        claim = self.claim
        timeout_seconds = self.timeout_seconds
        started = time.perf_counter()
        output: Any = None
        deadline: asyncio.Timeout | None = None
        try:
            try:
                payload = self.job_type.parse_payload(claim.payload)
            except ValidationError as exc:
                raise _StoredPayloadInvalid(str(exc)) from exc
            async with asyncio.timeout(timeout_seconds) as deadline:
                try:
                    output = await self.job_type.fn(self._context(), payload)
                finally:
                    self.step_clock.cancel()
            result = self.job_type.result_json(output)
        except AwaitingApproval:
            return  # the job waits for a decision; asking was this attempt's outcome
        except StaleLease as exc:  # a checkpoint or ledger write of the task was refused
            self._superseded("step", exc)
            return
        except asyncio.CancelledError:
            overran = self.step_clock.overran
            if overran is not None and self.lost is None and self.interrupted is None:
                assert self._task is not None
                self._task.uncancel()  # our own cancellation: the step's time was up
                await self._failed(overran, output=None)
                return
            if self.lost is None:  # a drain or an abort: hand the job back
                await asyncio.shield(self._hand_back(self.interrupted or "cancelled"))
            raise
        except TimeoutError as exc:
            if deadline is None or not deadline.expired():
                if exc is self.step_clock.overran and self._task and self._task.cancelling():
                    self._task.uncancel()  # the task swallowed our cancellation
                await self._failed(exc, output=None)
                return
            timed_out = _JobTimedOut(timeout_seconds)
            await self._terminal(timed_out, Classified(ErrorClass.PERMANENT, "JOB_TIMEOUT"))
        except _StoredPayloadInvalid as exc:
            await self._terminal(exc, Classified(ErrorClass.PERMANENT, "PAYLOAD_INVALID"))
        except Exception as exc:
            await self._failed(exc, output=output)
        else:
            event = events.completed(claim, (time.perf_counter() - started) * 1_000)
            pjob_id = self.pctx.job.id
            assert pjob_id is not None
            if not await self._write("completed", self.ledger.flush, flush=False):
                return

            async def complete(delete_dispatch: bool) -> bool:
                return await self._write(
                    "completed",
                    lambda: self.store.complete(
                        claim, result, event,
                        procrastinate_job_id=pjob_id, delete_dispatch=delete_dispatch,
                    ),
                    flush=False,
                )  # fmt: skip

            self.runner.dispatches.leave_completion(pjob_id, complete)

    async def _failed(self, exc: Exception, *, output: Any) -> None:
        claim = self.claim
        classified = classify(exc, self.runner.classifiers)
        budget = Budget(
            retry_count=claim.retry_count,
            max_retries=claim.max_retries,
            run=claim.dispatch_attempt,
            max_attempts=claim.max_attempts,
        )
        decision = decide(classified, budget, self.config.backoff, self.runner.rng)
        if isinstance(decision, Fail):
            rejected = (
                _rejected_output(exc, output)
                if classified.error_class is ErrorClass.INVALID_OUTPUT
                else None
            )
            written = await self._terminal(exc, classified, output=rejected)
            if written and classified.error_class is ErrorClass.TRANSIENT_INFRA:
                raise exc  # the dispatch's last run: Procrastinate records it failed as well
            return
        retry_at = datetime.now(UTC) + timedelta(milliseconds=decision.delay_ms)
        written = await self._write(
            f"retry ({decision.layer})",
            lambda: self.store.schedule_retry(
                claim,
                layer=decision.layer,
                next_retry_at=retry_at,
                error=events.last_error(
                    exc, classified, claim, terminal=False,
                    backoff_ms=decision.delay_ms, next_available_at=retry_at,
                ),
                failed_event=events.failed(
                    exc, classified, claim, terminal=False,
                    layer=decision.layer, backoff_ms=decision.delay_ms,
                ),
                retry_event=events.retry_scheduled(decision.layer, decision.delay_ms),
            ),
        )  # fmt: skip
        if not written:
            return
        if decision.layer is Layer.INFRA:
            raise InfraRetry(retry_at, exc) from exc
        if decision.delay_ms < 1_000:
            self.runner.on_redispatch(claim.id)

    async def _terminal(
        self, exc: BaseException, classified: Classified, *, output: Any = None
    ) -> bool:
        claim = self.claim
        error = events.last_error(exc, classified, claim, terminal=True, output=output)
        degraded = self.runner.degrade(
            job_id=claim.id, job_type=claim.job_type, payload=claim.payload,
            error_class=classified.error_class, error=error,
        )  # fmt: skip
        return await self._write(
            "failed",
            lambda: self.store.fail(
                claim, error, events.failed(exc, classified, claim, terminal=True), degraded
            ),
        )

    async def _hand_back(self, reason: str) -> None:
        claim = self.claim
        written = await self._write(
            "interrupted", lambda: self.store.hand_back(claim, events.interrupted(claim, reason))
        )
        if written:
            self.runner.on_redispatch(claim.id)

    async def _write(
        self, outcome: str, write: Callable[[], Awaitable[Any]], *, flush: bool = True
    ) -> bool:
        """Commit the side-effect results still held, then one fenced outcome write. A refusal
        means this attempt was superseded: the job is left alone, and nothing is written."""
        if self.lost is not None:
            return False
        try:
            if flush:
                await self.ledger.flush()
            await write()
        except (StaleLease, InvalidTransition) as exc:
            self._superseded(outcome, exc)
            return False
        return True

    def _superseded(self, outcome: str, exc: Exception) -> None:
        claim = self.claim
        self.lost = str(exc)
        logger.warning(
            "stale write refused: attempt %s of job %s (%s): %s",
            claim.attempt, claim.id, outcome, exc,
            extra={"job_id": str(claim.id), "attempt": claim.attempt, "outcome": outcome},
        )  # fmt: skip


class StepDeadline:
    """The step timeout (seed 004: an AbortController per step). A step overrunning it has the
    attempt cancelled, which then fails with :class:`StepTimedOut` (TRANSIENT_APP): the job
    retries from its last checkpoint."""

    def __init__(self, seconds: float, on_overrun: Callable[[], None]) -> None:
        self.seconds = seconds
        self.on_overrun = on_overrun
        self.overran: StepTimedOut | None = None
        self._timer: asyncio.TimerHandle | None = None

    def start(self, step: int) -> None:
        self.cancel()
        self._timer = asyncio.get_running_loop().call_later(self.seconds, self._fire, step)

    def stop(self) -> None:
        self.cancel()
        if self.overran is not None:  # the task swallowed the cancellation: fail the step now
            raise self.overran

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        """The attempt is over: no timer, and no reference back to it (so the attempt is freed
        at once, not by the garbage collector)."""
        self.cancel()
        self.on_overrun = _nothing

    def _fire(self, step: int) -> None:
        self._timer = None
        self.overran = StepTimedOut(step, self.seconds)
        self.on_overrun()


def _nothing() -> None:
    pass


class _StoredPayloadInvalid(Exception):
    """The stored payload no longer fits the job type's payload type (the code changed)."""


class _JobTimedOut(Exception):
    def __init__(self, seconds: float) -> None:
        super().__init__(f"Job timed out after {seconds:g} seconds")


def _rejected_output(exc: Exception, output: Any) -> Any:
    if isinstance(exc, InvalidOutput):
        return exc.output
    if output is not None:
        return output
    if isinstance(exc, ValidationError):
        return exc.errors(include_url=False)
    return None
