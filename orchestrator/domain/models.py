"""Typed views of what the database holds: jobs, their events, dead letters, errors."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field, model_validator

from orchestrator.domain.classification import ErrorClass
from orchestrator.domain.flow import waiting_reason
from orchestrator.domain.states import Status


class _Row(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class LastError(_Row):
    """``last_error`` of a job: the failure payload of docs/contracts.md ("Failures"), the same
    keys whichever path wrote it (an attempt, the zombie sweep, an approval's rejection or
    expiry). Rows written by older versions may lack ``max_attempts``, ``run``,
    ``retry_count``, ``max_retries``."""

    ts: datetime
    message: str
    code: str
    classification: ErrorClass
    stack: str | None = None
    attempt: int
    #: The most attempts the job could reach if every try failed: terminal iff ``attempt >=
    #: max_attempts`` (written by the failure's statement: orc_max_attempts_after_v1).
    max_attempts: int | None = None
    run: int | None = None
    #: The current dispatch's run budget.
    max_runs: int | None = None
    retry_count: int | None = None
    max_retries: int | None = None
    terminal: bool
    backoff_ms: float | None = None
    next_available_at: datetime | None = None
    output: Any = None  # the rejected output of an INVALID_OUTPUT failure

    @model_validator(mode="before")
    @classmethod
    def _older_shape(cls, data: Any) -> Any:
        """Rows written before the counters were named apart (and by that release's workers)
        called the run budget ``max_attempts`` and had no ``max_runs``: it is their
        ``max_runs``, and their cap of attempts is unknown."""
        if isinstance(data, dict) and "max_attempts" in data and "max_runs" not in data:
            return {**data, "max_runs": data["max_attempts"], "max_attempts": None}
        return data


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
    #: The running attempt's lease (its fence): a capability, so never serialized (the API, the
    #: dashboard, the command line and the logs do not show it; only a claim hands it out).
    lease_token: UUID | None = Field(None, exclude=True)
    locked_by: str | None
    procrastinate_job_id: int | None
    last_error: LastError | None
    job_key: str | None
    #: Later submits with this job's key (Graphile Worker's ``revision``), 0 for none.
    revision: int = 0
    agent_id: str | None
    trace_id: str
    tenant_id: str | None
    #: The W3C trace context its attempts continue: its submit's span (docs/operations.md).
    traceparent: str | None = None
    timeout_seconds: int | None
    replay_of: UUID | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    #: Its key, when its type runs under a limit, and its cost in the limit's units
    #: (docs/flow-control.md).
    flow_key: str | None = None
    flow_cost: int | None = None
    #: Why it has not started while it waits for capacity on its key (``waiting for capacity
    #: on <key> (...)``), or, BLOCKED, for other jobs (``waiting for N jobs to end``); null
    #: when it waits for neither.
    waiting_for: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _waiting_for(cls, data: Any) -> Any:
        """A row read with its waiter (``flow_blocked_on``, ``flow_paused_until``) says why
        it waits, in the one sentence orchestrator.domain.flow shapes."""
        if isinstance(data, dict) and data.get("flow_blocked_on") and data.get("flow_key"):
            reason = waiting_reason(
                data["flow_key"], data["flow_blocked_on"], data.get("flow_paused_until")
            )
            return {**data, "waiting_for": reason}
        if isinstance(data, dict) and data.get("status") == Status.BLOCKED:
            waits = data.get("waits_for_jobs")
            count = "jobs" if waits is None else f"{waits} job{'s' if waits != 1 else ''}"
            return {**data, "waiting_for": f"waiting for {count} to end"}
        return data


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
    #: The job's tenant, copied when the letter was written.
    tenant_id: str | None
    state: str
    requeued_job_id: UUID | None
    discard_reason: str | None
    discard_requested_by: str | None
    discarded_by: str | None
    created_at: datetime
    resolved_at: datetime | None


class QueueStats(_Row):
    """One queue's unfinished jobs: by status, how many are due and waiting to start, and how
    long the oldest of those has been due (seconds; null when none is)."""

    queue: str
    pending: int
    running: int
    retry: int
    waiting_approval: int
    due: int
    oldest_due_age: float | None


class JobState(_Row):
    """A job as it stands when something happens to it: its counters and who holds it. Every
    failure payload reports these (``orchestrator.domain.events``), whichever path wrote it."""

    id: UUID
    job_type: str
    tenant_id: str | None
    payload: Any
    attempt: int
    max_attempts: int
    dispatch_attempt: int
    retry_count: int
    max_retries: int
    lease_token: UUID | None
    locked_by: str | None


class Claim(JobState):
    """What one run of a job holds after claiming it: the lease fences all its writes."""

    lease_token: UUID
    locked_by: str
    queue: str
    priority: int
    timeout_seconds: int | None
    trace_id: str
    agent_id: str | None
    started_at: datetime
    #: When the job was first due: its submit, or the time it was submitted for.
    run_at: datetime
    traceparent: str | None = None  # where its attempt's span hangs (orchestrator.runtime.tracing)
    #: Its flow control key, if its type runs under a limit: a 429 it meets pauses this key.
    flow_key: str | None = None
    #: The worker contract's ``max_attempts`` at this claim (``max_attempts`` above is the runs
    #: per dispatch): the most attempts the job can reach if every try fails, as the claim's SQL
    #: tells it (orc_max_attempts_v1, also in its job.running).
    most_attempts: int
    #: Jobs waited for it when it was claimed (docs/workflows.md): its end may release them,
    #: so its worker fetches again once its outcome is written, not while it is.
    has_dependants: bool = False

    @property
    def fence(self) -> Fence:
        return Fence(self.id, self.lease_token, self.attempt)


@dataclass(frozen=True)
class Fence:
    """Which attempt is writing: the job and the lease it holds (every write it makes names
    them, so a superseded attempt's writes match nothing)."""

    job_id: UUID
    lease_token: UUID
    attempt: int


class Awaited(_Row):
    """A job another waits for (docs/workflows.md): a parent (``ctx.parents()``) or a child
    (``step.wait_for``), as the waiting job reads it and the API shows it: how it ended so far
    (``ended``: COMPLETED, FAILED or CANCELLED; None while it has not), its result once
    COMPLETED, its failure once FAILED, and the policy it is awaited under."""

    job_id: UUID
    job_type: str
    status: Status
    on_failure: str | None = None  # a parent's policy (a child: none)
    ended: Status | None = None
    result: Any = None
    last_error: LastError | None = None


class SubmitResult(_Row):
    job_id: UUID
    outcome: str  # created | replaced | deduplicated
