"""The API's request and response bodies that the Python API does not already have: a submit
is the Python API's ``JobSpec`` and a job is its ``Job``; these wrap pages, actions and the
external workers' contract (docs/api.md)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal
from uuid import UUID

from fastapi import Query
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from orchestrator.app import JobSpec
from orchestrator.domain import json_values
from orchestrator.domain.dead_letters import BULK_MAX
from orchestrator.domain.flow import FlowKey
from orchestrator.domain.models import Awaited, DeadLetter, Job, JobEvent, QueueStats
from orchestrator.domain.output import OutputChunk
from orchestrator.domain.schedules import ScheduleView
from orchestrator.domain.storable import Text
from orchestrator.domain.usage import UsageTotal
from orchestrator.runtime.external import ExternalTask
from orchestrator.storage.rows import ApprovalRecord, StepRecord
from retry_config.names import MAX_TENANT, named_tenant

MAX_BATCH = 1_000


def _json_body(value: dict[str, Any]) -> dict[str, Any]:
    """``value``, or ValueError naming the part of it ``jsonb`` cannot hold exactly."""
    json_values.check(value, "body")
    return value


#: A query's ``tenant_id`` filter: a tenant, never empty or blank (retry_config.names), else
#: 422 REQUEST_INVALID naming it.
TenantFilter = Annotated[
    Annotated[Text, AfterValidator(named_tenant)] | None,
    Query(min_length=1, max_length=MAX_TENANT),
]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SubmitBatch(_In):
    jobs: list[JobSpec] = Field(min_length=1, max_length=MAX_BATCH)


class Submitted(BaseModel):
    job_id: UUID
    outcome: Literal["created", "replaced", "deduplicated"]


class SubmittedBatch(BaseModel):
    jobs: list[Submitted]


class JobPage(BaseModel):
    jobs: list[Job]
    #: Pass as ``cursor`` for the next (older) page; null: this was the last.
    next_cursor: UUID | None


class ParentPage(BaseModel):
    """A job's parents (its depends_on), in order (docs/workflows.md)."""

    jobs: list[Awaited]
    #: Pass as ``after`` for the next page; null: this was the last.
    next_cursor: int | None


class ChildPage(BaseModel):
    """The children a job spawned, in the order made (docs/workflows.md)."""

    jobs: list[Awaited]
    #: Pass as ``after`` for the next page; null: this was the last.
    next_cursor: UUID | None


class EventPage(BaseModel):
    events: list[JobEvent]
    #: Pass as ``after`` for what comes next (the last event's id, or the one given).
    next_cursor: int


class OutputPage(BaseModel):
    """A page of a job's output (docs/output.md), in offset order."""

    chunks: list[OutputChunk]
    #: Pass as ``offset`` for what comes next (the last chunk's offset + 1, or the one given).
    next_offset: int


class JobOutcome(BaseModel):
    """A job after a wait: ``finished`` is false when the wait ran out first."""

    finished: bool
    job: Job


class Steps(BaseModel):
    """Checkpoints and side effects of the ledger (pending, committed, failed), in step order."""

    steps: list[StepRecord]


class UsageTotals(BaseModel):
    """LLM calls and tokens recorded in [since, until), grouped by ``by``, largest first."""

    since: datetime | None
    until: datetime | None
    by: list[str]
    totals: list[UsageTotal]


class Reason(_In):
    reason: Text = Field("", max_length=2_000)


class RequiredReason(_In):
    reason: Text = Field(min_length=1, max_length=2_000)


class DeadLetters(BaseModel):
    dead_letters: list[DeadLetter]


class Requeued(BaseModel):
    job_id: UUID


class LetterSelection(_In):
    """The letters a bulk action takes: these ids, or (none given) every letter the action can
    take that matches the filters (none: all of them), newest first; at most BULK_MAX a call."""

    dead_letter_ids: list[UUID] | None = Field(default=None, min_length=1, max_length=BULK_MAX)
    job_type: Text | None = Field(default=None, min_length=1, max_length=200)
    tenant_id: Annotated[Text, AfterValidator(named_tenant)] | None = Field(
        default=None, min_length=1, max_length=MAX_TENANT
    )
    #: A part of the error's code, message or class (any case).
    error: Text | None = Field(default=None, min_length=1, max_length=200)

    @model_validator(mode="after")
    def _ids_or_filters(self) -> LetterSelection:
        if self.dead_letter_ids is not None and self.filtered:
            raise ValueError(
                "give dead_letter_ids or filters (job_type, tenant_id, error), not both"
            )
        return self

    @property
    def filtered(self) -> bool:
        return (self.job_type, self.tenant_id, self.error) != (None, None, None)


class DiscardSelection(LetterSelection):
    reason: Text = Field(min_length=1, max_length=2_000)


class Approvals(BaseModel):
    approvals: list[ApprovalRecord]


class Schedules(BaseModel):
    schedules: list[ScheduleView]


class FlowKeys(BaseModel):
    keys: list[FlowKey]


class FlowPause(_In):
    seconds: float = Field(gt=0, le=86_400 * 30, description="How long no job of the key starts.")
    reason: Text = Field("", max_length=500)


class Queues(BaseModel):
    queues: list[QueueStats]


class RetryConfigView(BaseModel):
    """The effective retry config: ``defaults`` for every type not named in ``job_types`` (not
    where the server read it: its file system is its own)."""

    defaults: dict[str, Any]
    job_types: dict[str, dict[str, Any]]
    token_budgets: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="The token budget of each tenant the caller may see ({tokens, period}).",
    )
    version: str = Field(
        description="The version (content hash) of the file this server runs: it reloads the"
        " file when it changes, and keeps this version when the new one is refused."
    )
    limits: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="The fleet-wide limits, by name (docs/flow-control.md)."
    )


# -- external workers -------------------------------------------------------------------------


class ClaimRequest(_In):
    job_types: list[Text] = Field(min_length=1, max_length=100)
    #: Who runs the jobs: named in the jobs' lease (``locked_by``) and events.
    worker: Text = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9._:@/-]+$")
    limit: int = Field(1, ge=1, le=100)
    #: Wait this long for a job to come due when none is (a long-poll; capped by the server).
    wait_seconds: float = Field(0, ge=0, le=3600)


class Task(BaseModel):
    """A claimed job: run it, heartbeat every ``heartbeat_interval`` seconds, then complete
    it, naming ``job_id``, ``attempt`` and ``lease_token``. ``max_attempts``: the most attempts
    the job can reach if every try fails, as in its ``job.running``."""

    job_id: UUID
    job_type: str
    attempt: int
    max_attempts: int
    lease_token: UUID
    payload: Any
    tenant_id: str | None
    trace_id: str
    run: int
    max_runs: int
    retry_count: int
    max_retries: int
    heartbeat_interval: float
    lease_expires_at: datetime
    deadline_at: datetime

    @classmethod
    def of(cls, task: ExternalTask) -> Task:
        c = task.claim
        return cls(
            job_id=c.id, job_type=c.job_type, attempt=c.attempt,
            max_attempts=c.most_attempts, lease_token=c.lease_token,
            payload=c.payload, tenant_id=c.tenant_id, trace_id=c.trace_id,
            run=c.dispatch_attempt, max_runs=c.max_attempts, retry_count=c.retry_count,
            max_retries=c.max_retries, heartbeat_interval=task.heartbeat_interval,
            lease_expires_at=task.lease_expires_at, deadline_at=task.deadline_at,
        )  # fmt: skip


class Tasks(BaseModel):
    tasks: list[Task]


class Lease(_In):
    job_id: UUID
    attempt: int = Field(ge=1, le=2**31 - 1)
    lease_token: UUID


class LeaseRenewed(BaseModel):
    lease_expires_at: datetime


#: The classes a failure may be reported as (runtime.external.REPORTABLE).
Reportable = Literal["TRANSIENT_APP", "TRANSIENT_INFRA", "PERMANENT", "INVALID_OUTPUT"]


class ErrorReport(_In):
    message: Text = Field(min_length=1, max_length=10_000)
    code: Text = Field("EXTERNAL_ERROR", min_length=1, max_length=100)
    classification: Reportable = "TRANSIENT_INFRA"
    stack: Text | None = Field(None, max_length=100_000)


class Completion(Lease):
    status: Literal["success", "failure", "retry_later"]
    #: ``success``: the job's result (any JSON).
    output: Any = None
    #: ``failure``: what went wrong, and its class (which decides retry or dead letter).
    error: ErrorReport | None = None
    #: ``retry_later``: when to run again (seconds; capped by the type's backoff cap).
    retry_after_seconds: float | None = Field(None, ge=0, le=2**31 - 1)
    message: Text = Field("retry later", max_length=2_000)


class Completed(BaseModel):
    #: What the report became: completed, retried, failed (dead-lettered).
    outcome: str


class CallAdmission(Lease):
    """An LLM call the attempt is about to send (docs/flow-control.md, "Every call admitted")."""

    units: int = Field(
        1, ge=0, le=2**31 - 1,
        description="The call's estimate in its limit's units (its input at about four"
        " characters a token, plus max_tokens).",
    )  # fmt: skip
    model: Text | None = Field(
        None, min_length=1, max_length=200,
        description="The model the call goes to, when it is not the one the job's key is for"
        " (a fallback model): the call is admitted against that model's key.",
    )  # fmt: skip
    call_id: Text | None = Field(
        None, min_length=1, max_length=200,
        description="The call's own id, one per call the attempt sends: the same call asked"
        " again (its answer lost on the way) is answered as it was, counted once in the window.",
    )  # fmt: skip


class CallAdmitted(BaseModel):
    """``go``: send the call now (its room came: the answer to a call whose room was a moment
    off comes then). ``park``: the attempt is over (the job waits in ``key``'s line,
    ``waiting_on`` requests, units, share or paused, no budget used): stop, report nothing."""

    decision: Literal["go", "park"]
    key: str | None = None
    waiting_on: str | None = None


class CallUsageReport(Lease):
    """An LLM call that returned, with its tokens as the provider reported them."""

    model: Text = Field(
        min_length=1, max_length=200,
        description="The model the call went to, as its admission named it (or the job's own).",
    )  # fmt: skip
    input_tokens: int = Field(0, ge=0, le=2**31 - 1)
    output_tokens: int = Field(0, ge=0, le=2**31 - 1)
    cache_read_tokens: int = Field(0, ge=0, le=2**31 - 1)
    cache_creation_tokens: int = Field(0, ge=0, le=2**31 - 1)
    call_id: Text | None = Field(
        None, min_length=1, max_length=200,
        description="The provider's message id: a report sent again under it is recorded once.",
    )  # fmt: skip
    sent_seconds_ago: float | None = Field(
        None, ge=0, le=86_400,
        description="How long before this report the call was sent, by the worker's own clock"
        " (a duration, never a time of day): its spend is dated from then on the database's"
        " clock, as the provider counts it.",
    )  # fmt: skip


class CallRecorded(BaseModel):
    #: False: a call of this ``call_id`` was recorded already (a report sent again).
    recorded: bool


#: The most chunks one output batch may carry.
MAX_OUTPUT_CHUNKS = 1_000


class TextPart(_In):
    """Text the attempt made (a delta, or several joined)."""

    kind: Literal["text"]
    body: Text = Field(min_length=1)


class ProgressPart(_In):
    """A progress record (a tool started, a step's summary): a JSON object."""

    kind: Literal["progress"]
    body: Annotated[dict[str, Any], AfterValidator(_json_body)]


class OutputBatch(Lease):
    """A batch of the attempt's live output (docs/output.md), appended in order."""

    batch: int = Field(
        ge=1, le=2**31 - 1,
        description="The batch's number in the attempt: 1, 2... in the order sent. A batch sent"
        " again under its number (its answer lost on the way) is written once.",
    )  # fmt: skip
    chunks: list[Annotated[TextPart | ProgressPart, Field(discriminator="kind")]] = Field(
        min_length=1, max_length=MAX_OUTPUT_CHUNKS
    )


class OutputWritten(BaseModel):
    #: The batch's chunks kept: 0 for a batch written already, and for those past the size cap.
    written: int
    #: The offset the job's next chunk gets.
    next_offset: int
    #: The job's output reached its size cap (``output_max_bytes``): nothing more is kept.
    cut: bool


class Replayed(BaseModel):
    outcome: str
    job: Job
