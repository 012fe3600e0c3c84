"""Typed views of what the database holds: jobs, their events, dead letters, errors."""

from __future__ import annotations

from datetime import datetime
from typing import Any
from uuid import UUID

from pydantic import BaseModel, ConfigDict

from orchestrator.classification import ErrorClass
from orchestrator.states import Status


class _Row(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class LastError(_Row):
    """``last_error`` of a job (seed 000's failure payload, plus the classification)."""

    ts: datetime
    message: str
    code: str
    classification: ErrorClass
    stack: str | None = None
    attempt: int
    max_attempts: int
    terminal: bool
    backoff_ms: float | None = None
    next_available_at: datetime | None = None
    output: Any = None  # the rejected output of an INVALID_OUTPUT failure


class Job(_Row):
    id: UUID
    job_type: str
    status: Status
    payload: Any
    result: Any = None
    queue: str
    priority: int
    run_at: datetime
    attempt: int
    max_attempts: int
    dispatch_attempt: int
    retry_count: int
    max_retries: int
    next_retry_at: datetime | None
    heartbeat_at: datetime | None
    lease_token: UUID | None
    locked_by: str | None
    procrastinate_job_id: int | None
    last_error: LastError | None
    job_key: str | None
    agent_id: str | None
    trace_id: str
    timeout_seconds: int | None
    replay_of: UUID | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class JobEvent(_Row):
    id: int
    job_id: UUID
    kind: str
    at: datetime
    payload: dict[str, Any]


class DeadLetter(_Row):
    id: UUID
    job_id: UUID
    job_type: str
    payload: Any
    error: LastError
    state: str
    requeued_job_id: UUID | None
    discard_reason: str | None
    discard_requested_by: str | None
    discarded_by: str | None
    created_at: datetime
    resolved_at: datetime | None


class Claim(_Row):
    """What one run of a job holds after claiming it: the lease fences all its writes."""

    id: UUID
    job_type: str
    payload: Any
    attempt: int
    max_attempts: int
    dispatch_attempt: int
    retry_count: int
    max_retries: int
    lease_token: UUID
    locked_by: str
    queue: str
    priority: int
    timeout_seconds: int | None
    trace_id: str
    agent_id: str | None
    started_at: datetime


class SubmitResult(_Row):
    job_id: UUID
    outcome: str  # created | replaced | deduplicated
