"""A terminal failure, shaped once for every path that fails a job for good.

An attempt's permanent error or spent budget, its job timeout, a swept zombie whose budget is
spent, a rejected or expired approval: each builds its :class:`TerminalFailure` here and hands it
to ``JobStore.fail``, which writes every such failure with one SQL function
(``orc_fail_jobs_v1``). The dead-letter flow of docs/contracts.md, in one transaction:

    the dead letter is recorded                         job.dead_lettered {dead_letter_id}
    the job is FAILED, last_error set, lease released   job.failed {terminal: true, ...}
    its degradation (orchestrator.domain.degradation)   job.degraded, and an escalation job
                                                        (not for a rejected approval: the
                                                        person who rejected it knows)
    the dispatch that ran it, if any, is finished

So ``job.failed`` and ``last_error`` have the same keys whichever path wrote them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal
from uuid import UUID

from orchestrator.domain import events
from orchestrator.domain.degradation import Degraded, Degrader
from orchestrator.domain.events import Fault
from orchestrator.domain.ids import uuid7
from orchestrator.domain.models import JobState

DispatchStatus = Literal["succeeded", "failed", "aborted"]


@dataclass(frozen=True)
class DispatchEnd:
    """How the Procrastinate job (dispatch) that ran an attempt ends, written with its outcome.
    It is finished only if it is still ``doing`` (a sweep may have settled it already)."""

    id: int
    status: DispatchStatus


@dataclass(frozen=True)
class TerminalFailure:
    job_id: UUID
    #: The failing attempt's lease; None fails a job no attempt holds (waiting for an approval).
    lease_token: UUID | None
    dead_letter_id: UUID
    last_error: dict[str, Any]
    failed: dict[str, Any]
    #: Events that explain the failure and precede the dead letter (kind, payload).
    before: tuple[tuple[str, dict[str, Any]], ...]
    #: None: the failure is a person's own decision (a rejected approval), nobody to tell.
    degraded: Degraded | None
    dispatch: DispatchEnd | None


class Failures:
    def __init__(self, degrader: Degrader) -> None:
        self.degrader = degrader

    def terminal(
        self,
        job: JobState,
        fault: Fault,
        *,
        before: tuple[tuple[str, dict[str, Any]], ...] = (),
        dispatch: DispatchEnd | None = None,
        degrade: bool = True,
    ) -> TerminalFailure:
        """``degrade=False`` for a failure a person decided (an approval rejected): it is
        dead-lettered, and nobody is told of what they did themselves."""
        error = events.last_error(job, fault, terminal=True)
        degraded = None
        if degrade:
            degraded = self.degrader(
                job_id=job.id, job_type=job.job_type, payload=job.payload,
                error_class=fault.classification, error=error,
            )  # fmt: skip
        return TerminalFailure(
            job_id=job.id,
            lease_token=job.lease_token,
            dead_letter_id=uuid7(),
            last_error=error,
            failed=events.failed(job, fault, terminal=True),
            before=before,
            degraded=degraded,
            dispatch=dispatch,
        )
