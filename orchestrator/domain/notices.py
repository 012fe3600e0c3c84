"""The one place human notices are built: escalations of failed jobs and approval requests.

A notice is a job of a notification type (``send_notification``, ``approval_notify``) submitted in
the same transaction as the fact it announces (the job FAILED, the job WAITING_APPROVAL), so a
person is never told of something that did not happen, nor left untold because of a crash.
This module only builds the submit row; the store writes it with the fact.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any
from uuid import UUID

from orchestrator.domain.errors import ConfigError, PermanentError, SubmitError

logger = logging.getLogger("orchestrator.notices")

#: (job type, payload) -> a validated submit row (raises SubmitError when it does not fit).
SubmitRow = Callable[[str, Any], dict[str, Any]]

_NIL = "00000000-0000-0000-0000-000000000000"


class Notifier:
    def __init__(
        self,
        *,
        submit_row: SubmitRow,
        escalation_type: str,
        escalation_target: dict[str, Any] | None,
        approval_type: str,
        approval_target: dict[str, Any] | None,
    ) -> None:
        """Targets are payload fragments of the notification types (a channel and its address);
        an approval notice without a target of its own goes to the escalation target."""
        self.submit_row = submit_row
        self.escalation_type = escalation_type
        self.escalation_target = escalation_target
        self.approval_type = approval_type
        self.approval_target = approval_target if approval_target is not None else escalation_target
        self._approval_setting = "APPROVAL" if approval_target is not None else "ESCALATION"

    def escalation(
        self, job_id: UUID, job_type: str, message: str, error: dict[str, Any]
    ) -> dict[str, Any] | None:
        """A person is told that ``job_id`` failed for good; None when nobody is to be told."""
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

    def approval(
        self,
        *,
        job_id: UUID,
        approval_id: UUID,
        question: str,
        target: dict[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        """The notice of a waiting approval, to the step's own target or else the configured
        one; None (and a warning) when there is neither."""
        target = target if target is not None else self.approval_target
        if target is None:
            logger.warning(
                "job %s waits for approval %s; no approval target, nobody notified",
                job_id, approval_id,
            )  # fmt: skip
            return None
        payload = {"target": target, "approval_id": str(approval_id), "question": question,
                   "job_id": str(job_id)}  # fmt: skip
        try:
            return self.submit_row(self.approval_type, payload)
        except SubmitError as exc:
            raise PermanentError(
                f"the approval's notice cannot be submitted: {exc}", code="APPROVAL_NOTICE_INVALID"
            ) from None

    def check(self) -> None:
        """Refuse to start a worker whose notices could never be submitted (ConfigError naming
        the setting at fault)."""
        if self.escalation_target is not None:
            try:
                self.submit_row(
                    self.escalation_type,
                    {**self.escalation_target, "text": "check", "about_job_id": None},
                )
            except SubmitError as exc:
                raise ConfigError(
                    f"ORCHESTRATOR_ESCALATION_TARGET cannot be submitted as a "
                    f"{self.escalation_type!r} job: {exc}"
                ) from None
        if self.approval_target is not None:
            try:
                self.submit_row(
                    self.approval_type,
                    {"target": self.approval_target, "approval_id": _NIL, "question": "check",
                     "job_id": _NIL},
                )  # fmt: skip
            except SubmitError as exc:
                raise ConfigError(
                    f"ORCHESTRATOR_{self._approval_setting}_TARGET cannot be submitted as an "
                    f"approval notice ({self.approval_type!r} job): {exc}"
                ) from None
