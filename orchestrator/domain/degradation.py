"""What happens once a job has FAILED for good (the degradation path of docs/contracts.md).

    the job type has a fallback (a function that keeps what the job was to deliver)
        -> the fallback runs: its content is logged and recorded            job.degraded
    any other type
        -> a human notification (an escalation job, built by the Notifier) is submitted in the
           same transaction that marks the job FAILED                        job.degraded
    the escalation type itself, without a fallback
        -> nothing more (a failed escalation never escalates again)

:func:`determine` is the policy (pure); a job type may word its own message for when its
transient failures exhausted the budget (``exhausted_message``). :class:`Degrader` turns the
answer into the event and the submit rows that the FAILED write carries, so a job is never
FAILED without its degradation, nor the other way round.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from orchestrator.domain import events
from orchestrator.domain.classification import ErrorClass
from orchestrator.domain.notices import Notifier
from orchestrator.domain.secrets import redact_json

logger = logging.getLogger("orchestrator.degradation")

#: A job type's fallback: given the failed job's stored payload, the content it keeps.
Fallback = Callable[[Any], Any]


@dataclass(frozen=True)
class Degradation:
    fallback: str | None  # the fallback action taken, if the type has one
    notify_human: bool
    message: str


def determine(
    job_type: str,
    error_class: ErrorClass,
    *,
    fallback: str | None,
    escalation_type: str,
    exhausted_message: str | None = None,
) -> Degradation:
    exhausted = exhausted_message is not None and error_class is ErrorClass.TRANSIENT_APP
    if fallback is not None:
        message = (
            exhausted_message
            if exhausted and exhausted_message is not None
            else f"Job failed ({error_class.value}); its fallback ({fallback}) kept the content."
        )
        return Degradation(fallback, False, message)
    if job_type == escalation_type:
        return Degradation(None, False, "Human notification failed; it is not escalated again.")
    if exhausted and exhausted_message is not None:
        message = exhausted_message
    elif error_class in (ErrorClass.TRANSIENT_APP, ErrorClass.TRANSIENT_INFRA):
        message = (
            "Job failed after exhausting all retries. "
            f"Last error class: {error_class.value}. Manual review required."
        )
    else:
        message = f"Job failed permanently ({error_class.value}). Manual review required."
    return Degradation(None, True, message)


@dataclass(frozen=True)
class Degraded:
    """What a FAILED write carries: the ``job.degraded`` event and the jobs to submit with it."""

    event: dict[str, Any]
    submit: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class TypeDegradation:
    """What a job type says about its own degradation."""

    fallback: Fallback | None = None
    exhausted_message: str | None = None


class Degrader:
    def __init__(self, *, of_type: Callable[[str], TypeDegradation], notifier: Notifier) -> None:
        self.of_type = of_type
        self.notifier = notifier

    def __call__(
        self,
        *,
        job_id: UUID,
        job_type: str,
        payload: Any,
        error_class: ErrorClass,
        error: dict[str, Any],
    ) -> Degraded:
        own = self.of_type(job_type)
        fallback = own.fallback
        degradation = determine(
            job_type,
            error_class,
            fallback=getattr(fallback, "__name__", "fallback") if fallback else None,
            escalation_type=self.notifier.escalation_type,
            exhausted_message=own.exhausted_message,
        )
        message = degradation.message
        if fallback is not None:
            content = redact_json(_content(fallback, payload))
            logger.warning(
                "job %s (%s) failed for good; %s: %s",
                job_id, job_type, degradation.fallback, content,
            )  # fmt: skip
            return Degraded(
                events.degraded(message, "fallback", fallback=degradation.fallback, content=content)
            )
        if not degradation.notify_human:
            return Degraded(events.degraded(message, "none"))
        row = self.notifier.escalation(job_id, job_type, message, error)
        if row is None:
            logger.error(
                "job %s (%s) failed; no escalation target, nobody notified: %s: %s",
                job_id, job_type, error.get("code"), error.get("message"),
            )  # fmt: skip
            return Degraded(events.degraded(message, "notify_human"))
        return Degraded(
            events.degraded(message, "notify_human", escalation_job_id=row["id"]), submit=[row]
        )


def _content(fallback: Fallback, payload: Any) -> Any:
    try:
        return fallback(payload)
    except Exception as exc:  # the fallback is best effort: keep the payload itself
        logger.exception("fallback failed; recording the payload instead")
        return {"payload": payload, "fallback_error": repr(exc)}
