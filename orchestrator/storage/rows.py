"""Rows that reads hand out as plain dicts (the public API returns them as such), typed; the
HTTP API validates and documents them as they are (pydantic reads typing_extensions'
TypedDict on Python 3.11)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal
from uuid import UUID

from typing_extensions import TypedDict


class StepRecord(TypedDict):
    """One checkpoint, or one side effect of the ledger, of a job (``Orchestrator.job_steps``)."""

    kind: Literal["checkpoint", "side_effect"]
    step: int
    invocation_id: str | None
    name: str | None
    status: str | None  # a side effect's: pending | committed | failed
    detail: Any  # a checkpoint's state; a side effect's {args, result, error, reconciled}
    attempt: int
    at: datetime


class ApprovalRecord(TypedDict):
    """An approval gate, with its job's type and status (``Orchestrator.approvals``)."""

    id: UUID
    job_id: UUID
    step: int
    key: str
    question: str
    details: Any
    on_reject: Literal["fail", "resume"]
    status: str  # pending | approved | rejected | expired | cancelled
    requested_at: datetime
    expires_at: datetime
    decided_at: datetime | None
    decided_by: str | None
    reason: str | None
    job_type: str
    job_status: str
    tenant_id: str | None  # the job's
