"""Jobs: submit (one, many, idempotent), read (one, a page, its events, its steps, its LLM
usage), cancel, wait for an outcome (a long-poll), stream its events, and read or stream its
live output (Server-Sent Events).

A principal limited to tenants sees only their jobs: any other job, guessed id or not, is "not
found", exactly as a job that does not exist.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from typing import Annotated
from uuid import UUID

from fastapi import APIRouter, Depends, Header, Query, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import BeforeValidator, ValidationError

from orchestrator.app import JobSpec, Orchestrator
from orchestrator.domain.dependencies import MAX_PARENTS
from orchestrator.domain.errors import DatabaseUnavailable, JobNotFound, SubmitError
from orchestrator.domain.models import Job
from orchestrator.domain.principals import Principal, Scope, Unauthorized
from orchestrator.domain.states import Status
from orchestrator.domain.usage import JobUsage
from orchestrator.interfaces.api.auth import RECHECK_SECONDS, Allowed, still_authenticated
from orchestrator.interfaces.api.feeds import OutputFeeds
from orchestrator.interfaces.api.models import (
    ChildPage,
    EventPage,
    JobOutcome,
    JobPage,
    OutputPage,
    ParentPage,
    Reason,
    Steps,
    SubmitBatch,
    Submitted,
    SubmittedBatch,
    TenantFilter,
)
from orchestrator.interfaces.watch import EventWatch, Recheck
from orchestrator.storage.jobs import JobFilters

router = APIRouter(prefix="/api/v1", tags=["jobs"])

Reader = Annotated[Principal, Depends(Allowed(Scope.READ))]
Submitter = Annotated[Principal, Depends(Allowed(Scope.SUBMIT))]
Operator = Annotated[Principal, Depends(Allowed(Scope.OPERATE))]


def orchestrator(request: Request) -> Orchestrator:
    orc: Orchestrator = request.app.state.orc
    return orc


def event_watch(request: Request) -> EventWatch:
    watch: EventWatch = request.app.state.watch
    return watch


def output_feeds(request: Request) -> OutputFeeds:
    feeds: OutputFeeds = request.app.state.feeds
    return feeds


Orc = Annotated[Orchestrator, Depends(orchestrator)]
Watch = Annotated[EventWatch, Depends(event_watch)]
Feeds = Annotated[OutputFeeds, Depends(output_feeds)]


async def visible_job(orc: Orchestrator, caller: Principal, job_id: UUID) -> Job:
    """The job, if the caller may see it; JobNotFound otherwise (as if it did not exist)."""
    job = await orc.get_job(job_id)
    if not caller.sees(job.tenant_id):
        raise JobNotFound(job_id)
    return job


@router.post("/jobs", status_code=status.HTTP_201_CREATED)
async def submit(
    spec: JobSpec,
    orc: Orc,
    caller: Submitter,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> Submitted:
    """Submit one job. With ``Idempotency-Key``, submitting again with the same key returns the
    job the first submit made (its job key, deduplicated, in the caller's tenant)."""
    spec = _owned(spec, caller)
    if idempotency_key is not None:
        if spec.job_key is not None:
            raise SubmitError("give job_key or an Idempotency-Key header, not both")
        key = f"idempotency/{spec.tenant_id or '-'}/{idempotency_key}"
        spec = _owned(spec, caller, job_key=key, job_key_mode="unsafe_dedupe")
    (result,) = await orc.submit_specs([spec])
    return Submitted.model_validate(result.model_dump())


@router.post("/jobs/batch", status_code=status.HTTP_201_CREATED)
async def submit_batch(batch: SubmitBatch, orc: Orc, caller: Submitter) -> SubmittedBatch:
    """Submit many jobs in one transaction: all are stored, or (one invalid) none."""
    specs = [_owned(spec, caller) for spec in batch.jobs]
    results = await orc.submit_specs(specs)
    return SubmittedBatch(jobs=[Submitted.model_validate(r.model_dump()) for r in results])


def _owned(spec: JobSpec, caller: Principal, **update: object) -> JobSpec:
    """The spec in the caller's tenant (Forbidden for another's), with ``update`` applied and
    checked again."""
    tenant = caller.tenant_for_submit(spec.tenant_id)
    try:
        return JobSpec.model_validate({**spec.model_dump(), "tenant_id": tenant, **update})
    except ValidationError as exc:  # the request's own fields (an Idempotency-Key too long)
        raise RequestValidationError(exc.errors(include_url=False)) from None


@router.get("/jobs")
async def list_jobs(
    orc: Orc,
    caller: Reader,
    status_: Annotated[
        Status | None,
        BeforeValidator(lambda value: value.upper() if isinstance(value, str) else value),
        Query(alias="status", description="in any case (failed or FAILED)"),
    ] = None,
    job_type: Annotated[str | None, Query(max_length=200)] = None,
    tenant_id: TenantFilter = None,
    agent_id: Annotated[str | None, Query(max_length=200)] = None,
    job_key: Annotated[str | None, Query(max_length=512)] = None,
    created_after: datetime | None = None,
    created_before: datetime | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: UUID | None = None,
) -> JobPage:
    """Jobs newest first, a page at a time: pass ``next_cursor`` back as ``cursor``."""
    filters = JobFilters(
        status=status_, job_type=job_type, tenant_id=tenant_id, agent_id=agent_id,
        job_key=job_key, created_after=created_after, created_before=created_before,
        tenants=caller.tenants,
    )  # fmt: skip
    jobs = await orc.stores.jobs.page(filters, before=cursor, limit=limit + 1)
    more = len(jobs) > limit  # one past the page says whether another follows
    return JobPage(jobs=jobs[:limit], next_cursor=jobs[limit - 1].id if more else None)


@router.get("/jobs/{job_id}")
async def get_job(job_id: UUID, orc: Orc, caller: Reader) -> Job:
    return await visible_job(orc, caller, job_id)


@router.get("/jobs/{job_id}/events")
async def job_events(
    job_id: UUID,
    orc: Orc,
    caller: Reader,
    after: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> EventPage:
    """The job's events after the event id ``after``, oldest first."""
    await visible_job(orc, caller, job_id)
    events = await orc.stores.jobs.events_after(job_id, after=after, limit=limit)
    return EventPage(events=events, next_cursor=events[-1].id if events else after)


@router.get("/jobs/{job_id}/parents")
async def job_parents(
    job_id: UUID,
    orc: Orc,
    caller: Reader,
    after: Annotated[int, Query(ge=0, le=MAX_PARENTS)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> ParentPage:
    """The jobs it depends on (docs/workflows.md), in its depends_on's order, each with how it
    ended and its result or failure; a page after the place ``after``."""
    await visible_job(orc, caller, job_id)
    found = await orc.stores.graph.parents(
        job_id, after=after, limit=limit + 1, tenants=caller.tenants
    )
    more = len(found) > limit
    return ParentPage(
        jobs=[p for _, p in found[:limit]], next_cursor=found[limit - 1][0] if more else None
    )


@router.get("/jobs/{job_id}/children")
async def job_children(
    job_id: UUID,
    orc: Orc,
    caller: Reader,
    after: UUID | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> ChildPage:
    """The children it spawned (docs/workflows.md), in the order made, each with its status
    and its result or failure; a page after the child ``after``."""
    await visible_job(orc, caller, job_id)
    found = await orc.stores.graph.children(
        job_id, after=after, limit=limit + 1, tenants=caller.tenants
    )
    more = len(found) > limit
    return ChildPage(jobs=found[:limit], next_cursor=found[limit - 1].job_id if more else None)


@router.get("/jobs/{job_id}/steps")
async def job_steps(job_id: UUID, orc: Orc, caller: Reader) -> Steps:
    """Its checkpoints and its side-effect ledger, in step order."""
    await visible_job(orc, caller, job_id)
    return Steps(steps=await orc.job_steps(job_id))


@router.get("/jobs/{job_id}/usage")
async def job_usage(job_id: UUID, orc: Orc, caller: Reader) -> JobUsage:
    """Its LLM calls with their tokens (input, output, cache read, cache write), their total,
    and its token budget (null: none)."""
    await visible_job(orc, caller, job_id)
    return await orc.job_usage(job_id)


@router.post("/jobs/{job_id}/cancel")
async def cancel(job_id: UUID, body: Reason, orc: Orc, caller: Operator) -> Job:
    """Cancel an unfinished job (409 WF_STATE_TRANSITION_INVALID for a finished one)."""
    await visible_job(orc, caller, job_id)
    await orc.cancel(job_id, reason=body.reason, by=caller.actor)
    return await orc.get_job(job_id)


@router.get("/jobs/{job_id}/wait")
async def wait(
    job_id: UUID,
    orc: Orc,
    watch: Watch,
    caller: Reader,
    request: Request,
    seconds: Annotated[float, Query(alias="timeout", ge=0, le=3600)] = 30.0,
) -> JobOutcome:
    """Wait until the job has finished (COMPLETED, FAILED or CANCELLED), or ``timeout``
    seconds (capped by ORCHESTRATOR_API_WAIT_MAX_SECONDS): woken by the database the moment
    it finishes. 401 once the caller's token is revoked meanwhile."""
    seconds = min(seconds, request.app.state.settings.api_wait_max_seconds)
    await visible_job(orc, caller, job_id)
    recheck = Recheck(functools.partial(still_authenticated, request), RECHECK_SECONDS)
    async with watch.watching(job_id) as waiter:
        deadline = time.monotonic() + seconds
        while True:
            job = await orc.get_job(job_id)
            left = deadline - time.monotonic()
            if job.finished_at is not None or left <= 0:
                return JobOutcome(finished=job.finished_at is not None, job=job)
            await waiter.wait_checked(left, recheck=recheck)


@router.get(
    "/jobs/{job_id}/stream",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def stream(
    job_id: UUID,
    orc: Orc,
    watch: Watch,
    caller: Reader,
    request: Request,
    after: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
    last_event_id: Annotated[str | None, Header(max_length=30)] = None,
) -> StreamingResponse:
    """The job's events as Server-Sent Events (``id`` the event id, ``event`` its kind,
    ``data`` the event as JSON), from ``after`` (or ``Last-Event-ID`` on a reconnection),
    live, until the job has finished and its last event was sent, or the caller's token is
    revoked."""
    await visible_job(orc, caller, job_id)
    cursor = int(last_event_id) if last_event_id and last_event_id.isdigit() else after
    check = functools.partial(still_authenticated, request)
    return StreamingResponse(
        _events(orc, watch, job_id, cursor, check),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


async def _events(
    orc: Orchestrator,
    watch: EventWatch,
    job_id: UUID,
    cursor: int,
    check: Callable[[], Awaitable[None]],
) -> AsyncIterator[str]:
    """Its events from ``cursor`` on, and a keep-alive comment whenever none came for
    ORCHESTRATOR_API_STREAM_PING_SECONDS (proxies close silent connections). ``check``ed
    every RECHECK_SECONDS (before the read that follows a wake-up once that is due): the stream
    ends, sending nothing more, once the caller's token is revoked (a reconnection gets 401),
    or the database is lost (a reconnection gets 503 while it is away)."""
    ping = orc.settings.api_stream_ping_seconds
    recheck = Recheck(check, RECHECK_SECONDS)
    try:
        async with watch.watching(job_id) as waiter:
            while True:
                job = await orc.get_job(job_id)
                while events := await orc.stores.jobs.events_after(job_id, after=cursor, limit=500):
                    for event in events:
                        data = json.dumps(event.model_dump(mode="json"), separators=(",", ":"))
                        yield f"id: {event.id}\nevent: {event.kind}\ndata: {data}\n\n"
                        cursor = event.id
                if job.finished_at is not None:
                    return
                try:
                    woken = await waiter.wait_checked(ping, recheck=recheck)
                except Unauthorized:
                    return
                if not woken:
                    yield ": ping\n\n"
    except DatabaseUnavailable:  # the stream ends (no traceback); the client reconnects
        return


@router.get(
    "/jobs/{job_id}/output",
    response_model=OutputPage,
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def output(
    job_id: UUID,
    orc: Orc,
    feeds: Feeds,
    caller: Reader,
    request: Request,
    offset: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
    final: bool = False,
    limit: Annotated[int, Query(ge=1, le=1000)] = 500,
    accept: Annotated[str | None, Header(max_length=1000)] = None,
    last_event_id: Annotated[str | None, Header(max_length=30)] = None,
) -> OutputPage | StreamingResponse:
    """The job's live output (docs/output.md): its chunks from ``offset`` on, in order, each
    with its offset, attempt, step and kind. As JSON, a page of what is stored (``final``: only
    the final output, what no ``superseded`` marker covers). With ``Accept: text/event-stream``,
    as Server-Sent Events (``id`` the chunk's offset, ``event`` its kind, ``data`` the chunk as
    JSON), from ``offset`` (or after ``Last-Event-ID`` on a reconnection), live, until the job
    has finished and its last chunk was sent (then an ``end`` event, ``data`` the job's
    ``{"status"}``), or the caller's token is revoked (a stream that ends without ``end`` was
    cut: resume it)."""
    await visible_job(orc, caller, job_id)
    if accept is None or "text/event-stream" not in accept:
        chunks = await orc.stores.output.read(job_id, offset=offset, limit=limit, final=final)
        return OutputPage(chunks=chunks, next_offset=chunks[-1].offset + 1 if chunks else offset)
    if final:
        raise RequestValidationError([{
            "type": "value_error", "loc": ("query", "final"), "input": final,
            "msg": "final=true is a plain read (application/json): a stream sends every chunk, "
                   "its markers included",
        }])  # fmt: skip
    check = functools.partial(still_authenticated, request)
    offset = resumed_at(offset, last_event_id)
    return StreamingResponse(
        feeds.stream(job_id, offset, check),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


def resumed_at(offset: int, last_event_id: str | None) -> int:
    """Where an output stream starts: after the chunk ``Last-Event-ID`` names (a reconnection),
    else at ``offset``."""
    return int(last_event_id) + 1 if last_event_id and last_event_id.isdigit() else offset
