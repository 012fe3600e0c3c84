"""Approval gates, as a step meets them: ask once (the job waits, a person is told), then read
the decision when the job runs again."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any, Literal

from orchestrator.domain.models import Fence
from orchestrator.domain.notices import Notifier
from orchestrator.storage.approvals import ApprovalStore, StepApproval


class AwaitingApproval(BaseException):
    """Raised by ``Step.approval`` once the job waits: the attempt ends without an outcome.

    A BaseException, so that a task's ``except Exception`` cannot swallow it by accident.
    """

    def __init__(self, approval_id: uuid.UUID) -> None:
        self.approval_id = approval_id
        super().__init__(f"waiting for approval {approval_id}")


class ApprovalGate:
    def __init__(self, store: ApprovalStore, notifier: Notifier) -> None:
        self.store = store
        self.notifier = notifier

    async def asked(self, fence: Fence, step: int, key: str) -> StepApproval | None:
        """What this step asked before under ``key``, if it did."""
        return await self.store.for_step(fence.job_id, step, key)

    async def ask(
        self,
        fence: Fence,
        *,
        step: int,
        key: str,
        question: str,
        details: Any,
        on_reject: Literal["fail", "resume"],
        expires_in: timedelta,
        notify: dict[str, Any] | None,
    ) -> AwaitingApproval:
        """The job waits (WAITING_APPROVAL) and its notice goes out, in one transaction; returns
        the exception that ends the attempt."""
        approval_id = uuid.uuid4()
        notice = self.notifier.approval(
            job_id=fence.job_id, approval_id=approval_id, question=question, target=notify
        )
        await self.store.request(
            fence, approval_id=approval_id, step=step, key=key, question=question,
            details=details, on_reject=on_reject, expires_in=expires_in.total_seconds(),
            notice=notice,
        )  # fmt: skip
        return AwaitingApproval(approval_id)
