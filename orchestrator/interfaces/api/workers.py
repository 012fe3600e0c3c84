"""External workers' endpoints (task-claim, heartbeat, task-complete: the lease contract of
docs/contracts.md, over HTTP; call-admit, call-usage: an attempt's LLM calls under flow
control; task-output: its live output), and the internal replay endpoints of the dead-letter
spec.

A report (heartbeat, completion of any status, a call's admission or usage, an output batch) is
taken only from the attempt that holds the job's lease: its ``attempt`` and ``lease_token``
must be the job's. Any other (an unknown job, one never claimed, one finished or taken over, a
wrong attempt or token) gets the same 409 ``WF_LEASE_STALE`` and changes nothing: never a 404,
so a report without the lease learns nothing about the job. The routes declare exactly that (no
404 but the replay endpoint's).
"""

from __future__ import annotations

import functools
from typing import Annotated, Any
from uuid import UUID

from fastapi import APIRouter, Depends, HTTPException, Request

from orchestrator.domain.classification import ErrorClass
from orchestrator.domain.errors import InvalidTransition, SubmitError
from orchestrator.domain.principals import Forbidden, Principal, Scope
from orchestrator.domain.usage import Tokens
from orchestrator.interfaces.api import problems
from orchestrator.interfaces.api.auth import RECHECK_SECONDS, Allowed, still_authenticated
from orchestrator.interfaces.api.jobs import Orc, visible_job
from orchestrator.interfaces.api.models import (
    CallAdmission,
    CallAdmitted,
    CallRecorded,
    CallUsageReport,
    ClaimRequest,
    Completed,
    Completion,
    Lease,
    LeaseRenewed,
    OutputBatch,
    OutputWritten,
    Replayed,
    Task,
    Tasks,
)
from orchestrator.runtime.external import (
    ExternalRuns,
    FailedReport,
    ReplayMode,
    Report,
    RetryLaterReport,
    Succeeded,
)
from orchestrator.runtime.external_calls import Go
from orchestrator.runtime.outcomes import Parked

#: The answers of these endpoints besides their own: every error but 404 (they look nothing up
#: by name, except the replay endpoint, which declares its own).
ERRORS = {status: answer for status, answer in problems.ERRORS.items() if status != 404}
STALE: dict[int | str, dict[str, Any]] = {
    409: {
        **problems.ERRORS[409],
        "description": "WF_LEASE_STALE: this attempt does not hold the job's lease (an unknown "
        "job, one never claimed, finished or taken over, a wrong attempt or token); nothing "
        "changed: stop, and report nothing (or DATABASE_CONFLICT: try again)",
    }
}
router = APIRouter(prefix="/api/v1/internal", tags=["external workers"], responses=ERRORS)


async def fleet_worker(caller: Annotated[Principal, Depends(Allowed(Scope.WORKER))]) -> Principal:
    """An external worker runs whichever job comes due, of any tenant: its token may not be
    limited to tenants."""
    if caller.tenants is not None:
        raise Forbidden(f"token {caller.name!r} is limited to tenants: a worker token may not be")
    return caller


Worker = Annotated[Principal, Depends(fleet_worker)]
Admin = Annotated[Principal, Depends(Allowed(Scope.ADMIN))]


def external_runs(request: Request) -> ExternalRuns:
    runs: ExternalRuns = request.app.state.external
    return runs


Runs = Annotated[ExternalRuns, Depends(external_runs)]


@router.post("/task-claim")
async def claim(body: ClaimRequest, runs: Runs, caller: Worker, request: Request) -> Tasks:
    """Claim up to ``limit`` due jobs of these external types; with ``wait_seconds``, wait for
    one to come due (a long-poll; 401 once the caller's token is revoked meanwhile). No job:
    ``{"tasks": []}``."""
    wait = min(body.wait_seconds, request.app.state.settings.api_wait_max_seconds)
    tasks = await runs.claim(
        body.job_types, worker=body.worker, limit=body.limit, wait=wait,
        check=functools.partial(still_authenticated, request), check_every=RECHECK_SECONDS,
    )  # fmt: skip
    return Tasks(tasks=[Task.of(task) for task in tasks])


@router.post("/heartbeat", responses=STALE)
async def heartbeat(body: Lease, runs: Runs, caller: Worker) -> LeaseRenewed:
    """Extend the lease of the attempt that holds it (409 WF_LEASE_STALE for any other)."""
    expires = await runs.heartbeat(body.job_id, attempt=body.attempt, lease_token=body.lease_token)
    return LeaseRenewed(lease_expires_at=expires)


@router.post("/task-complete", responses=STALE)
async def complete(body: Completion, runs: Runs, caller: Worker) -> Completed:
    """What the attempt came to: ``success`` with its output, ``failure`` with a classified
    error (retried while the budget lasts, else dead-lettered), or ``retry_later``; 409
    WF_LEASE_STALE unless this attempt holds the job's lease."""
    outcome = await runs.complete(
        body.job_id, attempt=body.attempt, lease_token=body.lease_token, report=_report(body)
    )
    return Completed(outcome=outcome)


@router.post("/call-admit", responses=STALE)
async def admit_call(body: CallAdmission, runs: Runs, caller: Worker) -> CallAdmitted:
    """Before each LLM call the attempt sends: admit it in its job's flow key's window
    (docs/flow-control.md, "Every call admitted"). ``go``: send it (a call whose room comes
    within a quarter of a second is answered once that room has come); ``park``: the attempt is
    over, the job waits in its key's line: stop. A ``call_id`` asked again (an answer lost on the
    way) is answered ``go`` again if it was admitted, counted once. 409 WF_LEASE_STALE unless
    this attempt holds the job's lease."""
    verdict = await runs.calls.admit(
        body.job_id, attempt=body.attempt, lease_token=body.lease_token, units=body.units,
        model=body.model, call_id=body.call_id,
    )  # fmt: skip
    match verdict:
        case Go():
            return CallAdmitted(decision="go")
        case Parked(key=key, blocked=blocked):
            return CallAdmitted(decision="park", key=key, waiting_on=blocked)


@router.post("/call-usage", responses=STALE)
async def record_call(body: CallUsageReport, runs: Runs, caller: Worker) -> CallRecorded:
    """After each LLM call that returned: its tokens, as the provider reported them, recorded
    for the job and reconciling its admission's estimate in the key's window. 409
    WF_LEASE_STALE unless this attempt holds the job's lease."""
    tokens = Tokens(
        input_tokens=body.input_tokens, output_tokens=body.output_tokens,
        cache_read_tokens=body.cache_read_tokens, cache_creation_tokens=body.cache_creation_tokens,
    )  # fmt: skip
    recorded = await runs.calls.record(
        body.job_id, attempt=body.attempt, lease_token=body.lease_token, model=body.model,
        tokens=tokens, call_id=body.call_id, sent_seconds_ago=body.sent_seconds_ago,
    )  # fmt: skip
    return CallRecorded(recorded=recorded)


@router.post("/task-output", responses=STALE)
async def write_output(body: OutputBatch, runs: Runs, caller: Worker) -> OutputWritten:
    """Append a batch of the attempt's live output (docs/output.md): its text and progress
    chunks, in order, at the job's next offsets, marked with the attempt, outside any step.
    Batches are numbered 1, 2... in the attempt; one sent again under its number is written
    once (``written`` 0). Held to the job type's ``output_max_bytes``: past it, ``cut``. 409
    WF_LEASE_STALE, nothing written, unless this attempt holds the job's lease."""
    written = await runs.write_output(
        body.job_id, attempt=body.attempt, lease_token=body.lease_token, batch=body.batch,
        chunks=[chunk.model_dump() for chunk in body.chunks],
    )  # fmt: skip
    return OutputWritten(written=written.written, next_offset=written.next_offset, cut=written.cut)


def _report(body: Completion) -> Report:
    match body.status:
        case "success":
            return Succeeded(body.output)
        case "failure":
            if body.error is None:
                raise SubmitError("error: a failure needs {message, code, classification}")
            return FailedReport(
                body.error.message, body.error.code, ErrorClass(body.error.classification),
                body.error.stack,
            )  # fmt: skip
        case "retry_later":
            if body.retry_after_seconds is None:
                raise SubmitError("retry_after_seconds: retry_later needs a delay")
            return RetryLaterReport(body.retry_after_seconds, body.message)


@router.post("/jobs/{job_id}/run", tags=["replay"], responses={404: problems.ERRORS[404]})
async def run(
    job_id: UUID,
    orc: Orc,
    runs: Runs,
    caller: Admin,
    request: Request,
    force_fail: bool = False,
    transient_fail: bool = False,
) -> Replayed:
    """The dead-letter spec's replay trigger (off unless ORCHESTRATOR_API_REPLAY_ENDPOINTS):
    run this waiting job now and succeed; ``force_fail``: fail it permanently (the
    dead-letter path at once); ``transient_fail``: fail it transiently (a retry while the
    budget lasts, then the dead-letter path)."""
    if not request.app.state.settings.api_replay_endpoints:
        raise HTTPException(404, "Not Found")
    if force_fail and transient_fail:
        raise SubmitError("force_fail and transient_fail: choose one")
    mode: ReplayMode = (
        "force_fail" if force_fail else "transient_fail" if transient_fail else "succeed"
    )
    job = await visible_job(orc, caller, job_id)
    outcome = await runs.replay(job_id, mode)
    if outcome is None:
        raise InvalidTransition(
            job_id, job.status.value, "RUNNING",
            message=f"WF_STATE_TRANSITION_INVALID: job {job_id} is {job.status.value}: only a "
            "waiting job (PENDING, RETRY) can be run now",
        )  # fmt: skip
    return Replayed(outcome=outcome, job=await orc.get_job(job_id))
