"""Approval gates: a step asks (its job waits), a human or the expiry decides."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Any, Literal, cast
from uuid import UUID

from psycopg.types.json import Jsonb
from pydantic import BaseModel, ConfigDict

from orchestrator.domain import events, states
from orchestrator.domain.errors import ApprovalNotFound
from orchestrator.domain.models import Fence, JobState
from orchestrator.domain.states import Status
from orchestrator.storage.database import Conn
from orchestrator.storage.jobs import JobStore
from orchestrator.storage.rows import ApprovalRecord
from orchestrator.storage.runner import Queries

DecisionKind = Literal["approved", "rejected", "expired"]


class StepApproval(BaseModel):
    """What a step asked before, under its key: the decision, once there is one."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: UUID
    status: str
    decided_by: str | None
    reason: str | None


class LockedApproval(BaseModel):
    """An approval and its job, both locked for a decision."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: UUID
    step: int
    status: str
    on_reject: Literal["fail", "resume"]
    expires_at: datetime
    job: JobState
    job_status: Status


class ApprovalStore:
    def __init__(self, queries: Queries, jobs: JobStore) -> None:
        self.queries = queries
        self.jobs = jobs

    async def for_step(self, job_id: UUID, step: int, key: str) -> StepApproval | None:
        row = await self.queries.row("step_approval", {"job_id": job_id, "step": step, "key": key})
        return StepApproval.model_validate(row) if row else None

    async def request(
        self,
        fence: Fence,
        *,
        approval_id: UUID,
        step: int,
        key: str,
        question: str,
        details: Any,
        on_reject: str,
        expires_in: float,
        notice: dict[str, Any] | None,
    ) -> None:
        """WAITING_APPROVAL (lease released), the approval and its event, and its notice
        submitted, in one transaction; refused (StaleLease...) if the lease was superseded."""
        async with self.queries.transaction() as conn:
            row = await self.queries.row(
                "request_approval",
                {
                    "job_id": fence.job_id,
                    "lease_token": fence.lease_token,
                    "target": Status.WAITING_APPROVAL.value,
                    "sources": states.sources_of(Status.WAITING_APPROVAL),
                    "approval_id": approval_id,
                    "step": step,
                    "key": key,
                    "question": question,
                    "details": Jsonb(details),
                    "on_reject": on_reject,
                    "expires_in": expires_in,
                    "event": Jsonb(
                        events.waiting_approval(
                            approval_id,
                            step=step,
                            question=question,
                            notice_job_id=notice["id"] if notice else None,
                        )
                    ),
                },
                conn,
            )
            if row is not None and notice is not None:
                await self.jobs.submit([notice], conn)
        if row is None:
            raise await self.jobs.refusal(fence.job_id, Status.WAITING_APPROVAL, fence.lease_token)

    async def lock(self, approval_id: UUID, conn: Conn) -> LockedApproval | None:
        row = await self.queries.row("lock_approval", {"approval_id": approval_id}, conn)
        if row is None:
            return None
        job = JobState.model_validate({**row, "id": row["job_id"]})
        return LockedApproval.model_validate({**row, "job": job})

    async def decide(
        self, approval_id: UUID, decision: DecisionKind, *, by: str, reason: str, conn: Conn
    ) -> None:
        await self.queries.execute(
            "decide_approval",
            {"approval_id": approval_id, "decision": decision, "decided_by": by, "reason": reason},
            conn,
        )

    async def resume(self, job_id: UUID, kind: str, event: dict[str, Any], conn: Conn) -> None:
        """WAITING_APPROVAL -> PENDING (no budget used) with its event, and a new dispatch."""
        await self.queries.row(
            "resume_after_approval",
            {
                "job_id": job_id,
                "target": Status.PENDING.value,
                "sources": [Status.WAITING_APPROVAL.value],
                "kind": kind,
                "event": Jsonb(event),
            },
            conn,
        )
        await self.jobs.dispatch([job_id], conn)

    async def expired(
        self, limit: int, conn: Conn, passed_over: Sequence[UUID] = ()
    ) -> list[tuple[UUID, UUID]]:
        """Up to ``limit`` approvals past due whose job still waits, but those ``passed_over``,
        locked (SKIP LOCKED): (approval id, job id) each."""
        rows = await self.queries.rows(
            "expired_approvals",
            {
                "waiting": Status.WAITING_APPROVAL.value,
                "limit": limit,
                "passed_over": list(passed_over),
            },
            conn,
        )
        return [(row["id"], row["job_id"]) for row in rows]

    async def get(self, approval_id: UUID) -> ApprovalRecord:
        row = await self.queries.row("get_approval", {"approval_id": approval_id})
        if row is None:
            raise ApprovalNotFound(approval_id)
        return cast(ApprovalRecord, row)

    async def list_approvals(
        self, *, status: str | None, limit: int, tenants: Collection[str] | None = None
    ) -> list[ApprovalRecord]:
        """Newest first; ``tenants``: only approvals of these tenants' jobs."""
        params = {"status": status, "limit": limit,
                  "tenants": sorted(tenants) if tenants is not None else None}  # fmt: skip
        rows = await self.queries.rows("list_approvals", params)
        return [cast(ApprovalRecord, row) for row in rows]
