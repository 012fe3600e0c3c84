"""One attempt of one job, run inside one Procrastinate job: claim, run the task, record.

    claim (PENDING/RETRY -> RUNNING, with the fetch; dispatching.py)   none: stale dispatch, no-op
    run the task under the job timeout
    success                     -> COMPLETED, written with Procrastinate's finish (dispatching.py)
    TRANSIENT_APP, budget left  -> RETRY + a new dispatch at next_retry_at; return normally
    TRANSIENT_INFRA, runs left  -> RETRY (no app budget used); raise InfraRetry so Procrastinate
                                   re-runs this dispatch after exp(min(10, run)) s
    anything else, or exhausted -> FAILED + dead letter (infra exhaustion re-raises, so the
                                   Procrastinate job ends failed too)
    cancelled (drain, abort)    -> handed back to PENDING, no budget used; cancellation re-raised

A write refused because the attempt lost its lease (the job was cancelled, swept, or replaced)
is logged and recorded as ``job.stale_write_rejected``: a stale attempt never changes the job.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from uuid import UUID

import procrastinate
from pydantic import ValidationError

from orchestrator import events
from orchestrator.classification import Classified, Classifier, ErrorClass, classify
from orchestrator.context import JobContext
from orchestrator.dispatching import DispatchManager
from orchestrator.errors import InvalidOutput, InvalidTransition, StaleLease
from orchestrator.models import Claim
from orchestrator.policy import Budget, Fail, Layer, decide
from orchestrator.registry import JobType
from orchestrator.retry_strategy import InfraRetry
from retry_config import RetryConfig

if TYPE_CHECKING:
    from orchestrator.store import JobStore

logger = logging.getLogger("orchestrator.attempt")
#: This process, as it appears in ``locked_by`` (``/w<procrastinate worker id>`` is added).
HOST = f"{socket.gethostname()}/{os.getpid()}"


class AttemptRunner:
    def __init__(
        self,
        *,
        store: JobStore,
        job_types: Mapping[str, JobType],
        config: Callable[[], RetryConfig],
        classifiers: Sequence[Classifier],
        dispatches: DispatchManager,
        rng: random.Random | None = None,
    ) -> None:
        self.store = store
        self.dispatches = dispatches
        self.job_types = job_types
        self.config = config
        self.classifiers = classifiers
        self.rng = rng or random.Random()
        #: Called with the job id whenever an attempt gave its job a dispatch that may already
        #: be due (the worker then fetches again once this dispatch has finished).
        self.on_redispatch: Callable[[UUID], None] = lambda job_id: None

    async def run(
        self, pctx: procrastinate.JobContext, job_id: str, claimed: dict[str, Any] | None
    ) -> None:
        pjob = pctx.job
        assert pjob.id is not None
        if claimed is None:
            logger.info("dispatch %s of job %s is stale or a duplicate; skipped", pjob.id, job_id)
            return
        claim = Claim.model_validate(claimed)
        worker = claim.locked_by
        job_type = self.job_types[claim.job_type]
        config = self.config().for_type(claim.job_type)
        log = logging.LoggerAdapter(
            logging.getLogger(f"orchestrator.job.{claim.job_type}"),
            {"job_id": str(claim.id), "attempt": claim.attempt, "trace_id": claim.trace_id},
        )
        ctx = JobContext(
            job_id=claim.id,
            job_type=claim.job_type,
            attempt=claim.attempt,
            run=claim.dispatch_attempt,
            retry_count=claim.retry_count,
            max_retries=claim.max_retries,
            lease_token=claim.lease_token,
            worker=worker,
            trace_id=claim.trace_id,
            agent_id=claim.agent_id,
            config=config,
            log=log,
            _should_abort=pctx.should_abort,
        )
        timeout_seconds = claim.timeout_seconds or config.job_timeout_seconds
        started = time.perf_counter()
        output: Any = None
        deadline: asyncio.Timeout | None = None
        try:
            try:
                payload = job_type.parse_payload(claim.payload)
            except ValidationError as exc:
                raise _StoredPayloadInvalid(str(exc)) from exc
            async with asyncio.timeout(timeout_seconds) as deadline:
                output = await job_type.fn(ctx, payload)
            result = job_type.result_json(output)
        except asyncio.CancelledError:
            await asyncio.shield(self._hand_back(claim, "cancelled"))
            raise
        except TimeoutError as exc:
            if deadline is None or not deadline.expired():
                await self._failed(claim, exc, pjob, config, output=None)
                return
            await self._record_terminal(
                claim,
                _JobTimedOut(timeout_seconds),
                Classified(ErrorClass.PERMANENT, "JOB_TIMEOUT"),
            )
        except _StoredPayloadInvalid as exc:
            await self._record_terminal(
                claim, exc, Classified(ErrorClass.PERMANENT, "PAYLOAD_INVALID")
            )
        except Exception as exc:
            await self._failed(claim, exc, pjob, config, output=output)
        else:
            event = events.completed(claim, (time.perf_counter() - started) * 1_000)
            pjob_id = pjob.id

            async def complete(delete_dispatch: bool) -> bool:
                return await self._write(
                    claim,
                    "completed",
                    self.store.complete(
                        claim, result, event,
                        procrastinate_job_id=pjob_id, delete_dispatch=delete_dispatch,
                    ),
                )  # fmt: skip

            self.dispatches.leave_completion(pjob_id, complete)

    async def _failed(
        self,
        claim: Claim,
        exc: Exception,
        pjob: procrastinate.jobs.Job,
        config: Any,
        *,
        output: Any,
    ) -> None:
        classified = classify(exc, self.classifiers)
        budget = Budget(
            retry_count=claim.retry_count,
            max_retries=claim.max_retries,
            run=claim.dispatch_attempt,
            max_attempts=claim.max_attempts,
        )
        decision = decide(classified, budget, config.backoff, self.rng)
        if isinstance(decision, Fail):
            rejected = (
                _rejected_output(exc, output)
                if classified.error_class is ErrorClass.INVALID_OUTPUT
                else None
            )
            written = await self._record_terminal(claim, exc, classified, output=rejected)
            if written and classified.error_class is ErrorClass.TRANSIENT_INFRA:
                raise exc  # the dispatch's last run: Procrastinate records it failed as well
            return
        retry_at = datetime.now(UTC) + timedelta(milliseconds=decision.delay_ms)
        written = await self._write(
            claim,
            f"retry ({decision.layer})",
            self.store.schedule_retry(
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
            self.on_redispatch(claim.id)

    async def _record_terminal(
        self, claim: Claim, exc: BaseException, classified: Classified, *, output: Any = None
    ) -> bool:
        return await self._write(
            claim,
            "failed",
            self.store.fail(
                claim,
                events.last_error(exc, classified, claim, terminal=True, output=output),
                events.failed(exc, classified, claim, terminal=True),
            ),
        )

    async def _hand_back(self, claim: Claim, reason: str) -> None:
        written = await self._write(
            claim, "interrupted", self.store.hand_back(claim, events.interrupted(claim, reason))
        )
        if written:
            self.on_redispatch(claim.id)

    async def _write(self, claim: Claim, outcome: str, write: Any) -> bool:
        """Await one fenced write; a refusal means this attempt was superseded."""
        try:
            await write
        except (StaleLease, InvalidTransition) as exc:
            logger.warning("attempt %s of job %s: %s", claim.attempt, claim.id, exc)
            await self.store.record_events([events.stale_write_rejected(claim, outcome)])
            return False
        return True


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
