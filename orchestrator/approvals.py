"""Deciding approval gates: approve, reject, and expiry (seed 004's ``expire_approvals``).

A step that asks for approval leaves its job WAITING_APPROVAL (checkpoints.steps). A decision,
in one transaction with the approval and its job locked:

    approved                         -> PENDING + a new dispatch (no budget used), job.approved
    rejected, on_reject="resume"     -> the same, job.rejected: the step sees the rejection
    rejected, on_reject="fail"       -> job.rejected, then FAILED with a dead letter
    expired (by the periodic task)   -> as rejected, with job.approval_expired

Every decision records who decided and why. A person hears of a waiting approval through its
notice (:class:`ApprovalNotices`): an ``approval_notify`` job submitted in the transaction that
makes the job WAITING_APPROVAL, so an approval never waits unannounced because of a crash.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal
from uuid import UUID

from psycopg.types.json import Jsonb

from orchestrator.database import Conn
from orchestrator.errors import ApprovalError, InvalidTransition, PermanentError, SubmitError
from orchestrator.states import Status
from orchestrator.store import JobStore, dispatch_params

DecisionKind = Literal["approved", "rejected", "expired"]
EVENT = {"approved": "job.approved", "rejected": "job.rejected", "expired": "job.approval_expired"}
EXPIRED_BY = "expire_approvals"

logger = logging.getLogger("orchestrator.approvals")


class ApprovalNotices:
    """Builds the notice of a waiting approval: a ``job_type`` job to the step's own target, or
    else to the configured one; None (and a warning) when there is neither."""

    def __init__(
        self,
        *,
        job_type: str,
        target: dict[str, Any] | None,
        submit_row: Callable[[str, Any], dict[str, Any]],
    ) -> None:
        self.job_type = job_type
        self.target = target
        self.submit_row = submit_row  # (job type, payload) -> a validated submit row

    def __call__(
        self,
        *,
        job_id: UUID,
        approval_id: UUID,
        question: str,
        target: dict[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        target = target if target is not None else self.target
        if target is None:
            logger.warning(
                "job %s waits for approval %s; no approval target, nobody notified",
                job_id, approval_id,
            )  # fmt: skip
            return None
        payload = {"target": target, "approval_id": str(approval_id), "question": question,
                   "job_id": str(job_id)}  # fmt: skip
        try:
            return self.submit_row(self.job_type, payload)
        except SubmitError as exc:
            raise PermanentError(
                f"the approval's notice cannot be submitted: {exc}", code="APPROVAL_NOTICE_INVALID"
            ) from None

    def check(self) -> None:
        """Refuse to start a worker whose approval notices could never be submitted."""
        if self.target is not None:
            nil = "00000000-0000-0000-0000-000000000000"
            self.submit_row(
                self.job_type,
                {"target": self.target, "approval_id": nil, "question": "check", "job_id": nil},
            )


async def decide(
    store: JobStore, approval_id: UUID, decision: DecisionKind, *, by: str, reason: str
) -> None:
    if not by.strip():
        raise ApprovalError("a decision needs the name of who decides")
    async with store.pool.connection() as conn, conn.transaction():
        await _decide(store, conn, approval_id, decision, by=by, reason=reason)


async def expire_due(store: JobStore, *, limit: int) -> int:
    """Expire, in one transaction, up to ``limit`` approvals past due; returns how many."""
    async with store.pool.connection() as conn, conn.transaction():
        rows = await store.rows(
            "expired_approvals", {"waiting": Status.WAITING_APPROVAL.value, "limit": limit}, conn
        )
        for row in rows:
            await _decide(
                store, conn, row["id"], "expired", by=EXPIRED_BY,
                reason="no decision before the approval expired",
            )  # fmt: skip
    return len(rows)


async def _decide(
    store: JobStore,
    conn: Conn,
    approval_id: UUID,
    decision: DecisionKind,
    *,
    by: str,
    reason: str,
) -> None:
    approval = await store.one("lock_approval", {"approval_id": approval_id}, conn)
    if approval is None:
        raise ApprovalError(f"no approval with id {approval_id}")
    if approval["status"] != "pending":
        raise ApprovalError(f"approval {approval_id} is already {approval['status']}")
    resumes = decision == "approved" or approval["on_reject"] == "resume"
    target = Status.PENDING if resumes else Status.FAILED
    if approval["job_status"] != Status.WAITING_APPROVAL.value:
        raise InvalidTransition(approval["job_id"], approval["job_status"], target.value)
    await store.execute(
        "decide_approval",
        {"approval_id": approval_id, "decision": decision, "decided_by": by, "reason": reason},
        conn,
    )
    job_id: UUID = approval["job_id"]
    event = {
        "approval_id": str(approval_id),
        "step": approval["step"],
        "decided_by": by,
        "reason": reason,
        "on_reject": approval["on_reject"],
    }
    if resumes:
        await store.execute(
            "resume_after_approval",
            {
                "job_id": job_id,
                "target": Status.PENDING.value,
                "sources": [Status.WAITING_APPROVAL.value],
                "kind": EVENT[decision],
                "event": Jsonb(event),
            },
            conn,
        )
        await store.one("dispatch_jobs", dispatch_params([job_id]), conn)
        return
    await store.record_events(
        [{"job_id": str(job_id), "kind": EVENT[decision], "payload": event}], conn
    )
    message = (
        f"approval {decision} by {by}: {reason}"
        if decision == "rejected"
        else f"approval expired: {reason}"
    )
    await store.fail_job(job_id, None, _error(approval, decision, message), {
        "terminal": True, "attempt": approval["job_attempt"],
        "max_attempts": approval["job_max_attempts"],
        "error": {"message": message, "code": _code(decision), "classification": "PERMANENT"},
    }, conn)  # fmt: skip


def _code(decision: DecisionKind) -> str:
    return "APPROVAL_EXPIRED" if decision == "expired" else "APPROVAL_REJECTED"


def _error(approval: dict[str, Any], decision: DecisionKind, message: str) -> dict[str, Any]:
    return {
        "ts": datetime.now(UTC).isoformat(),
        "message": message,
        "code": _code(decision),
        "classification": "PERMANENT",
        "attempt": approval["job_attempt"],
        "max_attempts": approval["job_max_attempts"],
        "retry_count": approval["job_retry_count"],
        "max_retries": approval["job_max_retries"],
        "terminal": True,
    }
