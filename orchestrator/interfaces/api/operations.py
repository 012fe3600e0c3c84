"""What operators act on: dead letters (requeue, the two-person discard), approvals (approve,
reject), and what they read: the effective retry config and the queues.

Every action records the authenticated principal as who acted; the two-person rule compares
principals, so one token cannot both request and confirm a discard.
"""

from __future__ import annotations

from typing import Annotated, Literal
from uuid import UUID

from fastapi import APIRouter, Depends, Query

from orchestrator.domain.applications import Applications
from orchestrator.domain.dead_letters import BulkReview
from orchestrator.domain.errors import ApprovalNotFound, DeadLetterNotFound
from orchestrator.domain.models import DeadLetter
from orchestrator.domain.principals import Principal, Scope
from orchestrator.interfaces.api.auth import Allowed
from orchestrator.interfaces.api.jobs import Orc
from orchestrator.interfaces.api.models import (
    Approvals,
    DeadLetters,
    DiscardSelection,
    LetterSelection,
    Queues,
    Reason,
    Requeued,
    RequiredReason,
    RetryConfigView,
    TenantFilter,
)
from orchestrator.storage.rows import ApprovalRecord
from retry_config import FlowLimit, JobRetryConfig

router = APIRouter(prefix="/api/v1")

Reader = Annotated[Principal, Depends(Allowed(Scope.READ))]
Operator = Annotated[Principal, Depends(Allowed(Scope.OPERATE))]
LetterState = Literal["open", "all", "recorded", "requeued", "discard_requested", "discarded"]
ApprovalStatus = Literal["pending", "approved", "rejected", "expired", "cancelled", "all"]


async def _letter(orc: Orc, caller: Principal, dead_letter_id: UUID) -> DeadLetter:
    letter = await orc.dead_letter(dead_letter_id)
    if not caller.sees(letter.tenant_id):
        raise DeadLetterNotFound(dead_letter_id)
    return letter


@router.get("/dead-letters", tags=["dead letters"])
async def list_dead_letters(
    orc: Orc,
    caller: Reader,
    state: LetterState = "open",
    job_type: Annotated[str | None, Query(max_length=200)] = None,
    tenant_id: TenantFilter = None,
    error: Annotated[str | None, Query(min_length=1, max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> DeadLetters:
    """Newest first; ``open`` (the default): those awaiting review (recorded, or a discard
    requested); ``error``: a part of the error's code, message or class (any case)."""
    letters = await orc.dead_letters(
        state=state, job_type=job_type, tenant_id=tenant_id, error=error, limit=limit,
        tenants=caller.tenants,
    )  # fmt: skip
    return DeadLetters(dead_letters=letters)


@router.post("/dead-letters/requeue", tags=["dead letters"])
async def requeue_many(body: LetterSelection, orc: Orc, caller: Operator) -> BulkReview:
    """Requeue the letters given, or every open one matching the filters: at most 500 a call
    (``more``: call again), each in its own transaction, each letter's outcome said."""
    return await orc.review_dead_letters(
        "requeue",
        body.dead_letter_ids,
        job_type=body.job_type,
        tenant_id=body.tenant_id,
        error=body.error,
        tenants=caller.tenants,
    )


@router.post("/dead-letters/discard-request", tags=["dead letters"])
async def request_discards(body: DiscardSelection, orc: Orc, caller: Operator) -> BulkReview:
    """The first review of each letter's discard (of the recorded ones), with one reason."""
    return await orc.review_dead_letters(
        "discard-request", body.dead_letter_ids, job_type=body.job_type,
        tenant_id=body.tenant_id, error=body.error, by=caller.actor,
        reason=body.reason, tenants=caller.tenants,
    )  # fmt: skip


@router.post("/dead-letters/discard-confirm", tags=["dead letters"])
async def confirm_discards(body: LetterSelection, orc: Orc, caller: Operator) -> BulkReview:
    """The second review of each letter's discard (of those requested): refused, per letter,
    where this principal's person requested it."""
    return await orc.review_dead_letters(
        "discard-confirm", body.dead_letter_ids, job_type=body.job_type,
        tenant_id=body.tenant_id, error=body.error, by=caller.actor,
        tenants=caller.tenants,
    )  # fmt: skip


@router.get("/dead-letters/{dead_letter_id}", tags=["dead letters"])
async def get_dead_letter(dead_letter_id: UUID, orc: Orc, caller: Reader) -> DeadLetter:
    return await _letter(orc, caller, dead_letter_id)


@router.post("/dead-letters/{dead_letter_id}/requeue", tags=["dead letters"])
async def requeue(dead_letter_id: UUID, orc: Orc, caller: Operator) -> Requeued:
    """A new job with the dead one's payload and tenant; the letter is marked requeued."""
    await _letter(orc, caller, dead_letter_id)
    return Requeued(job_id=await orc.requeue_dead_letter(dead_letter_id))


@router.post("/dead-letters/{dead_letter_id}/discard-request", tags=["dead letters"])
async def request_discard(
    dead_letter_id: UUID, body: RequiredReason, orc: Orc, caller: Operator
) -> DeadLetter:
    """The first of two reviewers asks to discard the letter, with a reason."""
    await _letter(orc, caller, dead_letter_id)
    await orc.request_discard(dead_letter_id, by=caller.actor, reason=body.reason)
    return await orc.dead_letter(dead_letter_id)


@router.post("/dead-letters/{dead_letter_id}/discard-confirm", tags=["dead letters"])
async def confirm_discard(dead_letter_id: UUID, orc: Orc, caller: Operator) -> DeadLetter:
    """A second reviewer, another principal than the first, confirms the discard."""
    await _letter(orc, caller, dead_letter_id)
    await orc.confirm_discard(dead_letter_id, by=caller.actor)
    return await orc.dead_letter(dead_letter_id)


async def _approval(orc: Orc, caller: Principal, approval_id: UUID) -> ApprovalRecord:
    approval = await orc.stores.approvals.get(approval_id)
    if not caller.sees(approval["tenant_id"]):
        raise ApprovalNotFound(approval_id)
    return approval


@router.get("/approvals", tags=["approvals"])
async def list_approvals(
    orc: Orc,
    caller: Reader,
    status: ApprovalStatus = "pending",
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> Approvals:
    records = await orc.approvals(
        status=None if status == "all" else status, limit=limit, tenants=caller.tenants
    )
    return Approvals(approvals=records)


@router.get("/approvals/{approval_id}", tags=["approvals"])
async def get_approval(approval_id: UUID, orc: Orc, caller: Reader) -> ApprovalRecord:
    return await _approval(orc, caller, approval_id)


@router.post("/approvals/{approval_id}/approve", tags=["approvals"])
async def approve(approval_id: UUID, body: Reason, orc: Orc, caller: Operator) -> ApprovalRecord:
    """The step's job resumes from its last checkpoint (no budget used)."""
    await _approval(orc, caller, approval_id)
    await orc.approve(approval_id, by=caller.actor, reason=body.reason)
    return await _approval(orc, caller, approval_id)


@router.post("/approvals/{approval_id}/reject", tags=["approvals"])
async def reject(
    approval_id: UUID, body: RequiredReason, orc: Orc, caller: Operator
) -> ApprovalRecord:
    """The job fails (dead-lettered), or resumes down the task's rejection path."""
    await _approval(orc, caller, approval_id)
    await orc.reject(approval_id, by=caller.actor, reason=body.reason)
    return await _approval(orc, caller, approval_id)


def shown_type(config: JobRetryConfig, caller: Principal) -> JobRetryConfig:
    """A job type's config as ``caller`` may read it: its schedule (a tenant, an expression,
    a payload) left out unless the schedule is of the caller's tenants, as the schedules'
    listing leaves it out (one without a tenant: shown to a token of every tenant only)."""
    if config.schedule is None or caller.sees(config.schedule.tenant_id):
        return config
    return config.model_copy(update={"schedule": None})


def shown_limit(limit: FlowLimit, caller: Principal) -> FlowLimit:
    """A limit as ``caller`` may read it: of its weights, those of the caller's tenants only
    (a tenant's name is its own; a token of every tenant reads them all)."""
    return limit.model_copy(update={"weights": caller.own_entries(limit.weights)})


@router.get("/config", tags=["fleet"])
async def retry_config(orc: Orc, caller: Reader) -> RetryConfigView:
    """The effective retry config of every job type (read-only), as this server runs it now;
    what names a tenant (a schedule, a weight, a token budget) only for the caller's tenants."""
    config = orc.retry_config
    return RetryConfigView(
        version=config.version,
        defaults=config.defaults.model_dump(mode="json"),
        job_types={
            name: shown_type(config.for_type(name), caller).model_dump(mode="json")
            for name in sorted({*orc.job_types, *config.job_types})
        },
        limits={
            name: shown_limit(limit, caller).model_dump(mode="json")
            for name, limit in config.limits.items()
        },
        token_budgets={  # a tenant's name is its own: only the caller's tenants'
            tenant: budget.model_dump(mode="json")
            for tenant, budget in sorted(caller.own_entries(config.token_budgets).items())
        },
    )


@router.get("/applications", tags=["fleet"])
async def applications(orc: Orc, caller: Reader) -> Applications:
    """Each application sharing the database (docs/applications.md): its live processes and
    their config versions, its job types, limits and schedules, its declarations refused; and
    the waiting jobs that no live application serves. What names a tenant (a schedule, a
    limit's weight, a job) only for the caller's tenants."""
    return await orc.applications(tenants=caller.tenants)


@router.get("/queues", tags=["fleet"])
async def queues(orc: Orc, caller: Reader) -> Queues:
    """Per queue: unfinished jobs by status, how many are due and waiting, the oldest's age."""
    return Queues(queues=await orc.stores.fleet.queue_stats(tenants=caller.tenants))
