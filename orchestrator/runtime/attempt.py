"""One attempt of one job, run inside one dispatch: run the task, decide, return the outcome.

    the claim (PENDING/RETRY -> RUNNING) was made by the fetch, and is this attempt's to run
    run the task under the job timeout, each checkpointed step under the step timeout
    success                     -> Completed
    TRANSIENT_APP, budget left  -> Retried (app): RETRY, and a new dispatch at next_retry_at
    TRANSIENT_INFRA, runs left  -> Retried (infra): RETRY (no app budget used), and Procrastinate
                                   re-runs this dispatch after exp(min(10, run)) s
    anything else, or exhausted -> Failed: dead letter, FAILED, degradation (an exhausted
                                   infrastructure budget ends the dispatch failed too)
    job timeout                 -> Failed ("Job timed out after N seconds")
    step timeout                -> the step is cancelled; TRANSIENT_APP: Retried from the last
                                   checkpoint (or Failed once the budget is spent)
    interrupted (drain), or its -> HandedBack: PENDING, no budget used
    own database unreachable
    abandoned (lease lost, job cancelled) -> Abandoned: nothing is written
    waiting for an approval     -> Waiting: the wait itself was written by the task's step
    a call's room is far off    -> Parked: PENDING, a waiter of its flow key, no budget used

Before any outcome, side-effect results the attempt still holds are committed (ledger flush);
if that write is refused, the attempt was superseded and its outcome is not written
(orchestrator.runtime.outcomes writes the outcome it returns, with its dispatch's end).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from checkpoints import (
    ApprovalGate,
    AwaitingApproval,
    AwaitingChildren,
    CheckpointStore,
    Children,
    Ledger,
)
from checkpoints.children import ChildRows
from orchestrator.domain import events
from orchestrator.domain.classification import Classified, Classifier, ErrorClass, classify
from orchestrator.domain.errors import (
    DatabaseUnavailable,
    InvalidOutput,
    StaleLease,
    StepTimedOut,
    TransactionConflict,
)
from orchestrator.domain.events import Fault
from orchestrator.domain.failures import Failures
from orchestrator.domain.flow_window import CallParked
from orchestrator.domain.job_types import JobType
from orchestrator.domain.models import Awaited, Claim
from orchestrator.domain.secrets import Secrets
from orchestrator.runtime import current_attempt
from orchestrator.runtime.clients import Clients
from orchestrator.runtime.context import JobContext
from orchestrator.runtime.loops import until_written
from orchestrator.runtime.metrics import Metrics
from orchestrator.runtime.outcomes import (
    Abandoned,
    Completed,
    HandedBack,
    Outcome,
    Parked,
    Superseded,
    Waiting,
    of_failure,
    terminal,
)
from orchestrator.runtime.output import Output, OutputWrites
from orchestrator.runtime.usage import Accounting
from orchestrator.storage.flow import FlowStore
from orchestrator.storage.graph import GraphStore
from orchestrator.storage.usage import UsageStore
from retry_config import JobRetryConfig, LiveConfig

if TYPE_CHECKING:
    from orchestrator.runtime.tracing import StepSpans, Tracing

logger = logging.getLogger("orchestrator.attempt")


@dataclass(frozen=True)
class Toolkit:
    """What every attempt of an application needs, shared by its workers and never changed by
    them: the job types and their retry config (in effect now: a reload replaces it, and each
    attempt runs under the version it started with), the classifiers, the shaper of terminal
    failures, the secrets, the checkpoint and approval stores, and the tracing (None: off).
    What belongs to one worker (its clients, its running attempts) is the worker's."""

    job_types: Mapping[str, JobType]
    config: LiveConfig
    classifiers: Sequence[Classifier]
    failures: Failures
    secrets: Secrets
    checkpoints: CheckpointStore
    gate: ApprovalGate
    rng: random.Random
    metrics: Metrics
    graph: GraphStore  # what jobs depend on (ctx.parents()), the children steps spawn
    child_rows: ChildRows  # a step's child specs as job rows (the application's submit)
    output: OutputWrites  # the jobs' live output (ctx.output), written in groups
    tracing: Tracing | None = None
    usage: UsageStore | None = None  # token accounting (None: calls are only counted)
    flow: FlowStore | None = None  # flow control's windows, which calls' usage reconciles


class Attempt:
    def __init__(self, claim: Claim, dispatch_id: int, *, kit: Toolkit, clients: Clients):
        self.claim = claim
        self.dispatch_id = dispatch_id
        self.kit = kit
        self.clients = clients
        self.lost: str | None = None  # why the attempt was abandoned, if it was
        self.interrupted: str | None = None  # why it was asked to stop (drain), if it was
        #: Its own outcome (or its wait for an approval) is being written, or was: from then
        #: on its lease may be gone by its own doing (orchestrator.runtime.heartbeat).
        self.releasing = False
        self._task: asyncio.Task[Any] | None = None
        self._task_running = False  # the task function is running: a stop cancels it
        self._flushing = False  # it commits the results it holds (_ending): an abandonment stops it
        self.job_type = kit.job_types[claim.job_type]
        self.config: JobRetryConfig = kit.config.current.for_type(claim.job_type)
        self.timeout_seconds = claim.timeout_seconds or self.config.job_timeout_seconds
        self.step_clock = StepDeadline(
            self.config.step_timeout(self.timeout_seconds), self._step_overran
        )
        #: With tracing, the step clock the task's steps use: a span per step, then the deadline.
        self.step_spans: StepSpans | None = (
            None if kit.tracing is None else kit.tracing.steps(self.step_clock)
        )
        #: Its live output (ctx.output), written before each commit of its ledger.
        clock = self.step_clock  # not self: the output keeps no reference to the attempt
        self.output = Output(
            kit.output, claim.fence, max_bytes=self.config.output_max_bytes,
            step=lambda: clock.step,
        )  # fmt: skip
        self.ledger = Ledger(kit.checkpoints, claim.fence, list(kit.classifiers), self.output.flush)
        limit = kit.config.current.limits.get(self.config.limit or "")
        #: Its limit learns its key's limits from the provider's replies.
        self.learns = claim.flow_key is not None and limit is not None and limit.learn
        #: Its calls are admitted in its flow key's window (its limit counts requests or units,
        #: or learns them).
        self.windowed = self.learns or (
            claim.flow_key is not None
            and limit is not None
            and (limit.requests is not None or limit.units is not None)
        )

    def abandon(self, reason: str) -> None:
        """It no longer holds its job: cancel it, and let it write nothing, not even the
        side-effect results it holds (its job's next attempt reconciles them, as after a crash):
        it ends at once, and frees its slot, even while the database is away."""
        self.lost = reason
        self._cancel()  # repeated at each heartbeat while it runs (see heartbeat.py)
        if self._flushing and self._task is not None:
            self._task.cancel()

    def interrupt(self, reason: str) -> None:
        """Stop it and hand its job back (drain): ``ctx.should_abort()`` and a cancellation."""
        self.interrupted = reason
        self._cancel()  # repeated by the drain while it runs (see drain.py)

    def _cancel(self) -> None:
        if self._task is not None and self._task_running:
            self._task.cancel()

    def _step_overran(self) -> None:
        if self.lost is None and self.interrupted is None:
            self._cancel()

    async def run(self) -> Outcome:
        """Run the task and return its outcome (not yet written). A cancellation that is not
        this attempt's own (the event loop closing) is re-raised."""
        self._task = asyncio.current_task()
        try:
            return await self._run()
        finally:
            self.step_clock.close()
            self.output.close()

    def hand_back(self, reason: str) -> HandedBack:
        return HandedBack(events.interrupted(self.claim, reason))

    async def _parents(self) -> list[Awaited]:
        return self._typed([p for _, p in await self.kit.graph.parents(self.claim.id)])

    def _typed(self, outcomes: list[Awaited]) -> list[Awaited]:
        """Each result typed by its job type's declared result, when this worker knows the
        type."""
        types = self.kit.job_types
        return [
            o.model_copy(update={"result": types[o.job_type].result.validate_python(o.result)})
            if o.result is not None and o.job_type in types
            else o
            for o in outcomes
        ]

    def _context(self) -> JobContext:
        """The task's view of this attempt. Made when the task starts and not kept here, so
        the attempt and its context form no reference cycle: both are freed as soon as the
        attempt is over, without waiting for the garbage collector."""
        claim, kit, clients = self.claim, self.kit, self.clients
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
            tenant_id=claim.tenant_id,
            config=self.config,
            http=clients.http(claim.job_type, self.config),
            secrets=kit.secrets,
            output=self.output,
            log=logging.LoggerAdapter(
                logging.getLogger(f"orchestrator.job.{claim.job_type}"),
                current_attempt.fields_of(claim),
            ),
            _should_abort=lambda: (
                self.interrupted is not None
                or self.lost is not None
                or self.step_clock.overran is not None
            ),
            _shared=clients.shared,
            _parents=self._parents,
            _children=Children(
                kit.graph,
                kit.child_rows,
                self._typed,
                tenant_id=claim.tenant_id,
                trace_id=claim.trace_id,
            ),
            _ledger=self.ledger,
            _gate=kit.gate,
            _metrics=kit.metrics,
            _step_clock=self.step_spans or self.step_clock,
            _tracing=kit.tracing,
            _accounting=None
            if kit.usage is None
            else Accounting(
                claim,
                kit.usage,
                kit.metrics,
                lambda tenant: kit.config.current.token_budgets.get(tenant),
                kit.flow,
                windowed=self.windowed,
                learns=self.learns,
            ),
        )

    async def _run(self) -> Outcome:
        claim = self.claim
        started = time.perf_counter()
        output: Any = None
        deadline: asyncio.Timeout | None = None
        try:
            try:
                payload = self.job_type.parse_payload(claim.payload)
            except ValidationError as exc:
                raise _StoredPayloadInvalid(str(exc)) from exc
            self._task_running = True
            try:
                async with asyncio.timeout(self.timeout_seconds) as deadline:
                    try:
                        output = await self.job_type.fn(self._context(), payload)
                    except BaseException as exc:
                        self._steps_over(exc)
                        raise
                    finally:
                        self.step_clock.cancel()
                    self._steps_over(None)
            finally:
                self._task_running = False
            result = self.job_type.result_json(output)
        except CallParked as parked:  # its next call's room is far off: it waits in line
            return await self._ending(Parked.of(parked))
        except AwaitingApproval as waiting:
            self.releasing = True  # the wait was written: the job is no longer RUNNING
            return Waiting(f"approval {waiting.approval_id}")  # asking was this attempt's outcome
        except AwaitingChildren as waiting:
            self.releasing = True  # the wait was written: the job is BLOCKED
            return Waiting(f"{waiting.waiting} children")
        except StaleLease as exc:  # a checkpoint or ledger write of the task was refused
            return Superseded("step", exc)
        except (DatabaseUnavailable, TransactionConflict) as exc:
            # The orchestrator's own database (away, or a write of a step kept rolling back in
            # conflicts), not the task's fault: no budget is spent; the job is handed back once
            # the database takes it.
            return await self._ending(self.hand_back(str(exc)))
        except asyncio.CancelledError:
            overran = self.step_clock.overran
            if self.lost is None and self.interrupted is None and overran is None:
                raise  # not this attempt's own: the event loop is closing
            self._uncancel()
            if self.lost is not None:
                return Abandoned(self.lost)
            if self.interrupted is not None:
                return await self._ending(self.hand_back(self.interrupted))
            if deadline is not None and deadline.expired():
                # Both limits came due in one turn of the loop (the step's is never earlier):
                # two cancellations, so the job's did not turn into a TimeoutError. The job
                # is out of time whatever its step did.
                return await self._timed_out()
            assert overran is not None
            return await self._failed(overran, output=None)
        except TimeoutError as exc:
            if deadline is None or not deadline.expired():
                if exc is self.step_clock.overran:
                    self._uncancel()  # the task swallowed our cancellation
                return await self._failed(exc, output=None)
            return await self._timed_out()
        except _StoredPayloadInvalid as exc:
            return await self._terminal(exc, Classified(ErrorClass.PERMANENT, "PAYLOAD_INVALID"))
        except Exception as exc:
            return await self._failed(exc, output=output)
        duration_ms = (time.perf_counter() - started) * 1_000
        return await self._ending(Completed(result, duration_ms))

    async def _timed_out(self) -> Outcome:
        timed_out = _JobTimedOut(self.timeout_seconds)
        return await self._terminal(timed_out, Classified(ErrorClass.PERMANENT, "JOB_TIMEOUT"))

    def _steps_over(self, error: BaseException | None) -> None:
        """The task has returned or raised: a step still open ends (its span, with tracing)."""
        if self.step_spans is not None:
            self.step_spans.end(self.step_clock.overran or error)

    def _uncancel(self) -> None:
        """Withdraw this attempt's own cancellations (the drain and the heartbeat repeat theirs,
        as one can be swallowed on Python 3.11: asyncio.wait_for, gh-86296)."""
        task = self._task
        while task is not None and task.cancelling():
            task.uncancel()

    async def _failed(self, exc: Exception, *, output: Any) -> Outcome:
        classified = classify(exc, self.kit.classifiers)
        rejected = (
            _rejected_output(exc, output)
            if classified.error_class is ErrorClass.INVALID_OUTPUT
            else None
        )
        outcome = of_failure(
            self.claim, Fault.of(exc, classified, output=rejected), classified,
            dispatch_id=self.dispatch_id, backoff=self.config.backoff, rng=self.kit.rng,
            failures=self.kit.failures,
        )  # fmt: skip
        return await self._ending(outcome)

    async def _terminal(self, exc: BaseException, classified: Classified) -> Outcome:
        fault = Fault.of(exc, classified)
        outcome = terminal(
            self.claim, fault, classified, dispatch_id=self.dispatch_id,
            failures=self.kit.failures,
        )  # fmt: skip
        return await self._ending(outcome)

    async def _ending(self, outcome: Outcome) -> Outcome:
        """Commit the side-effect results still held, before the outcome is written; a refusal
        means this attempt was superseded, and its outcome is not written. The commit is tried
        until the database takes it, unless the attempt is abandoned meanwhile (its heartbeats
        failed for most of the zombie threshold: the database is away)."""
        self._flushing = True
        try:
            await until_written(f"job {self.claim.id}'s side effects", self.ledger.flush)
        except StaleLease as exc:
            return Superseded(type(outcome).__name__.lower(), exc)
        except asyncio.CancelledError:
            if self.lost is None:
                raise  # not this attempt's own: the event loop is closing
            self._uncancel()
            return Abandoned(self.lost)
        finally:
            self._flushing = False
        return outcome


class StepDeadline:
    """The step timeout (an AbortController per step in the design this follows). A step
    overrunning it has the attempt cancelled, which then fails with :class:`StepTimedOut`
    (TRANSIENT_APP): the job retries from its last checkpoint."""

    def __init__(self, seconds: float, on_overrun: Callable[[], None]) -> None:
        self.seconds = seconds
        self.on_overrun = on_overrun
        self.overran: StepTimedOut | None = None
        self.step: int | None = None  # the step running now (None: outside any)
        self._timer: asyncio.TimerHandle | None = None

    def start(self, step: int) -> None:
        self.cancel()
        self.step = step
        self._timer = asyncio.get_running_loop().call_later(self.seconds, self._fire, step)

    def stop(self) -> None:
        self.cancel()
        self.step = None
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
