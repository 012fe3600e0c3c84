"""What happens once a job has FAILED for good (seed 004's ``determineDegradation``).

    the job type has a fallback (send_notification, approval_notify: "log the content")
        -> the fallback runs: its content is logged and recorded            job.degraded
    any other type
        -> a human notification (an ``escalation_job_type`` job, to ``escalation_target``) is
           submitted in the same transaction that marks the job FAILED       job.degraded
    the escalation type itself, without a fallback
        -> nothing more (a failed escalation never escalates again)

:func:`determine` is the policy (pure); :class:`Degrader` turns its answer into the event and
the submit rows that the FAILED write carries (orchestrator.store), so a job is never FAILED
without its degradation, nor the other way round.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from orchestrator.classification import ErrorClass
from orchestrator.errors import SubmitError
from orchestrator.secrets import redact_json

logger = logging.getLogger("orchestrator.degradation")

#: A job type's fallback: given the failed job's stored payload, the content it keeps.
Fallback = Callable[[Any], Any]


@dataclass(frozen=True)
class Degradation:
    fallback: str | None  # the fallback action taken, if the type has one
    notify_human: bool
    message: str


def determine(
    job_type: str, error_class: ErrorClass, *, fallback: str | None, escalation_type: str
) -> Degradation:
    if fallback is not None:
        return Degradation(
            fallback, False, "Notification delivery failed after all retries. Content logged."
        )
    if job_type == escalation_type:
        return Degradation(None, False, "Human notification failed; it is not escalated again.")
    if job_type == "execute_tool" and error_class is ErrorClass.TRANSIENT_APP:
        message = "Tool execution failed after all retries. Manual intervention required."
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


class Degrader:
    def __init__(
        self,
        *,
        fallback_of: Callable[[str], Fallback | None],
        escalation_type: str,
        escalation_target: dict[str, Any] | None,
        submit_row: Callable[[str, Any], dict[str, Any]],
    ) -> None:
        self.fallback_of = fallback_of
        self.escalation_type = escalation_type
        self.escalation_target = escalation_target
        self.submit_row = submit_row  # (job type, payload) -> a validated submit row

    def __call__(
        self,
        *,
        job_id: UUID,
        job_type: str,
        payload: Any,
        error_class: ErrorClass,
        error: dict[str, Any],
    ) -> Degraded:
        fallback = self.fallback_of(job_type)
        degradation = determine(
            job_type,
            error_class,
            fallback=getattr(fallback, "__name__", "fallback") if fallback else None,
            escalation_type=self.escalation_type,
        )
        event: dict[str, Any] = {"message": degradation.message}
        if fallback is not None:
            content = redact_json(_content(fallback, payload))
            logger.warning(
                "job %s (%s) failed for good; %s: %s",
                job_id, job_type, degradation.fallback, content,
            )  # fmt: skip
            return Degraded({**event, "action": "fallback", "fallback": degradation.fallback,
                             "content": content})  # fmt: skip
        if not degradation.notify_human:
            return Degraded({**event, "action": "none"})
        row = self._escalation(job_id, job_type, degradation.message, error)
        if row is None:
            logger.error(
                "job %s (%s) failed; no escalation target, nobody notified: %s: %s",
                job_id, job_type, error.get("code"), error.get("message"),
            )  # fmt: skip
            return Degraded({**event, "action": "notify_human", "escalation_job_id": None})
        return Degraded(
            {**event, "action": "notify_human", "escalation_job_id": row["id"]}, submit=[row]
        )

    def check(self) -> None:
        """Refuse to start a worker whose escalation could never be submitted."""
        if self.escalation_target is not None:
            self.submit_row(
                self.escalation_type,
                {**self.escalation_target, "text": "check", "about_job_id": None},
            )

    def _escalation(
        self, job_id: UUID, job_type: str, message: str, error: dict[str, Any]
    ) -> dict[str, Any] | None:
        if self.escalation_target is None:
            return None
        text = f"{message}\njob {job_id} ({job_type}): {error.get('code')}: {error.get('message')}"
        try:
            return self.submit_row(
                self.escalation_type,
                {**self.escalation_target, "text": text, "about_job_id": str(job_id)},
            )
        except SubmitError:  # checked when the worker starts; never let it block the FAILED
            logger.exception("cannot build the human notification for job %s", job_id)
            return None


def _content(fallback: Fallback, payload: Any) -> Any:
    try:
        return fallback(payload)
    except Exception as exc:  # the fallback is best effort: keep the payload itself
        logger.exception("fallback failed; recording the payload instead")
        return {"payload": payload, "fallback_error": repr(exc)}
