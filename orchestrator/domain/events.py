"""Where event payloads and ``last_error`` are shaped: here, for the kinds a worker or a service
writes; in SQL (functions/history.sql), for those a statement writes from the rows it changes.

Each kind has one writer, named below and in docs/architecture.md ("Event payloads"), whichever
path writes it, so the same kind always has the same keys (docs/contracts.md has the table; a test
holds real events to it, and tests/test_event_writers.py holds every statement that writes one to
its writer). The counters an event reports are named apart, so that no rule misreads them:
``attempt`` counts every claim of the job (never reset); ``max_attempts`` is the most attempts it
can reach from here if every try fails (the worker contract's: a failure is terminal exactly when
``attempt >= max_attempts``), told only by SQL (orc_max_attempts_v1, claim.sql); ``run`` and
``max_runs`` are the current dispatch's infrastructure runs and their budget; ``retry_count`` and
``max_retries`` the application retries and theirs. ``run_id`` names the attempt (stored as its
lease token, read out as a one-way digest of it: :func:`shown`), ``worker`` the process that held
it (each event row also has ``job_id``, ``kind`` and ``at``):

    job.created          {job_type, queue, run_at, max_runs, max_retries, job_key, trace_id,
                          tenant_id}                      SQL: orc_created_event_v1
    job.replaced         {job_key, mode, revision, tenant_id}  SQL: orc_replaced_event_v1
    job.key_revoked      {job_key, replaced_by}           SQL: orc_key_revoked_event_v1
    job.running          {attempt, max_attempts, run, max_runs, retry_count, max_retries, worker,
                          run_id}                         SQL: orc_running_event_v1
    job.completed        {attempt, run, run_id, worker, duration_ms}  SQL: orc_completed_event_v1
    job.failed           {terminal, attempt, max_attempts, run, max_runs, retry_count,
                          max_retries, run_id, worker, layer, backoff_ms, error, dead_letter_id}
                                                          here: failed
    job.retry_scheduled  {attempt, max_attempts, run, max_runs, retry_count, max_retries, run_id,
                          worker, layer, backoff_ms, available_at}  here: retry_scheduled
    job.dead_lettered    {dead_letter_id}  always just before a terminal failed; SQL:
                                                          orc_fail_jobs_v1 (outcomes.sql)
    job.degraded         {action, message, dead_letter_id, fallback? content?
                          escalation_job_id?}  just after it; here: degraded
    job.interrupted      {attempt, run, run_id, worker, reason}  handed back, no budget used;
                                                          here: interrupted
    job.cancelled        {reason, by}                     SQL: orc_cancelled_event_v1
    job.rescheduled      {run_at, priority, max_runs}  a producer moved a waiting job; SQL:
                                                          orc_rescheduled_event_v1
    job.redispatched     {lost_procrastinate_job_id, lost_procrastinate_status}  here
    job.zombie_detected  {attempt, worker, last_heartbeat, threshold_seconds, reason}  here
    job.checkpointed     {step, final, effects_committed}  SQL: orc_checkpointed_event_v1
    job.model_fallback   {from, to, reason, code, retry_after, step}  an LLM call moved to the
                         next model of the type's fallback_models; here: model_fallback
    job.waiting_approval {approval_id, step, question, expires_at, notice_job_id}  here
    job.approved | job.rejected | job.approval_expired   {approval_id, step, decided_by, reason,
                                                          on_reject}  here: approval_decided
    job.maintenance_failed  {service, error, code}       here
    job.waiting_for_capacity  {key, waiting_on, status}  SQL: orc_waiting_for_capacity_event_v1
    job.blocked             {parents, waiting_on}        SQL: orc_blocked_event_v1
    job.unblocked           {ended: [{job_id, status}]}  SQL: orc_unblocked_event_v1
    job.children_spawned    {children, step, key}        SQL: orc_children_spawned_event_v1
    job.waiting_for_children  {awaiting, unended}        SQL: orc_waiting_for_children_event_v1

``error`` is ``{message, code, classification}``. On a retry ``layer`` and ``backoff_ms`` say how
and ``dead_letter_id`` is null; on a terminal failure it is the reverse. Known secrets are
redacted from every message and stack (orchestrator.domain.secrets) before anything is stored.
The statement that stores an event shaped here adds only what ties it to the rows that statement
writes: ``dead_letter_id`` (stamped by the one failure writer on a terminal failure's three
events), an approval's ``expires_at``, a retry's ``available_at`` (and ``last_error``'s
``next_available_at``): the database's clock plus ``backoff_ms``, so that no worker's clock
decides when a job runs again; and ``max_attempts`` of job.failed, job.retry_scheduled and
``last_error``, from the job's row and the retry's layer (orc_max_attempts_after_v1). A failure
no attempt held (``orc_fail_unheld_v1``, all SQL, in
functions/outcomes.sql: Graphile Worker's permanently_fail_jobs, a job whose flow key cannot be
rendered at its claim) still writes its own ``job.failed`` and ``last_error``, with no attempt
(``run_id``, ``worker`` null), with the keys these functions give; tests/test_graphile_compat.py
holds them equal.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal
from uuid import UUID, uuid5

from pydantic_core import to_jsonable_python

from orchestrator.domain.classification import Classified, ErrorClass
from orchestrator.domain.models import Claim, JobState
from orchestrator.domain.policy import Layer
from orchestrator.domain.secrets import redact, redact_json

MAX_MESSAGE = 2_000
MAX_STACK = 8_000
#: An event's ``run_id`` as read: the UUIDv5 of the attempt's lease token in this namespace.
RUN_ID_NAMESPACE = UUID("6f0b7d1e-3c1a-5b8e-9a43-2d5c0e7f4b19")


@dataclass(frozen=True)
class Fault:
    """What went wrong, as it is stored: from an exception, or stated by the orchestrator itself
    (a zombie, a rejected approval), which has no stack."""

    message: str
    code: str
    classification: ErrorClass
    stack: str | None = None
    output: Any = None  # the rejected output of an INVALID_OUTPUT failure

    @classmethod
    def of(cls, exc: BaseException, classified: Classified, *, output: Any = None) -> Fault:
        return cls(
            message=redact(message_of(exc)),
            code=classified.code,
            classification=classified.error_class,
            stack=redact(stack_of(exc)),
            output=output,
        )

    def summary(self) -> dict[str, Any]:
        """The ``error`` of a ``job.failed`` event, and of a failed ledger entry."""
        return {
            "message": self.message,
            "code": self.code,
            "classification": self.classification.value,
        }


def error_summary(exc: BaseException, classified: Classified) -> dict[str, Any]:
    return Fault.of(exc, classified).summary()


def counters(job: JobState) -> dict[str, Any]:
    """Where a job stands at a failure, as every failure event and ``last_error`` report it
    (their ``max_attempts`` is the statement's that writes them)."""
    return {
        "attempt": job.attempt,
        "run": job.dispatch_attempt,
        "max_runs": job.max_attempts,
        "retry_count": job.retry_count,
        "max_retries": job.max_retries,
    }


def holder(job: JobState) -> dict[str, Any]:
    """Which attempt: its lease token and its worker (null for a job no attempt held)."""
    return {
        "run_id": str(job.lease_token) if job.lease_token else None,
        "worker": job.locked_by,
    }


def shown(payload: dict[str, Any]) -> dict[str, Any]:
    """An event's payload as it is read out of the database: ``run_id`` names the attempt by a
    one-way digest of its lease token (stable, distinct per attempt), never by the token itself,
    which is a capability (docs/api.md, "Lease tokens"): whoever holds it can report for the
    attempt."""
    token = payload.get("run_id")
    if not token:
        return payload
    return {**payload, "run_id": str(uuid5(RUN_ID_NAMESPACE, str(token)))}


def last_error(
    job: JobState,
    fault: Fault,
    *,
    terminal: bool,
    layer: Layer | None = None,
    backoff_ms: float | None = None,
) -> dict[str, Any]:
    """``last_error`` (the worker contract's failure payload, plus the classification); a
    retried failure names the ``layer`` that retries it (the statement that writes the retry
    sets its ``next_available_at``)."""
    return {
        **fault.summary(),
        "ts": datetime.now(UTC).isoformat(),
        "stack": fault.stack,
        **counters(job),
        "terminal": terminal,
        "backoff_ms": backoff_ms,
        "next_available_at": None,
        "output": (
            redact_json(to_jsonable_python(fault.output, fallback=repr))
            if fault.output is not None
            else None
        ),
    }


def failed(
    job: JobState,
    fault: Fault,
    *,
    terminal: bool,
    layer: Layer | None = None,
    backoff_ms: float | None = None,
) -> dict[str, Any]:
    """``job.failed``: a failure, retried (``layer`` and ``backoff_ms`` say how) or terminal
    (the SQL that writes it adds its ``dead_letter_id``)."""
    return {
        "terminal": terminal,
        **counters(job),
        **holder(job),
        "layer": layer.value if layer is not None else None,
        "backoff_ms": round(backoff_ms, 3) if backoff_ms is not None else None,
        "error": fault.summary(),
        "dead_letter_id": None,
    }


def retry_scheduled(job: JobState, layer: Layer, backoff_ms: float) -> dict[str, Any]:
    """``job.retry_scheduled``: the counters after the retry (an application retry uses one of
    ``max_retries``); the statement that writes it adds ``available_at``, when the job is due
    again."""
    return {
        **counters(job),
        "retry_count": job.retry_count + layer.retries_used,
        **holder(job),
        "layer": layer.value,
        "backoff_ms": round(backoff_ms, 3),
        "available_at": None,
    }


def interrupted(claim: Claim, reason: str) -> dict[str, Any]:
    return {
        "attempt": claim.attempt,
        "run": claim.dispatch_attempt,
        **holder(claim),
        "reason": reason,
    }


def zombie_detected(
    job: JobState, *, last_heartbeat: datetime, threshold: float, reason: str
) -> dict[str, Any]:
    return {
        "attempt": job.attempt,
        "worker": job.locked_by,
        "last_heartbeat": last_heartbeat.isoformat(),
        "threshold_seconds": threshold,
        "reason": reason,
    }


def redispatched(lost_dispatch_id: int | None, lost_status: str | None) -> dict[str, Any]:
    return {"lost_procrastinate_job_id": lost_dispatch_id, "lost_procrastinate_status": lost_status}


def maintenance_failed(service: str, error: str, code: str) -> dict[str, Any]:
    """A maintenance service could not handle this job; it went on with the others, and tries
    this one again at its next run."""
    return {"service": service, "error": error, "code": code}


def approval_decided(
    approval_id: UUID, *, step: int, by: str, reason: str, on_reject: str
) -> dict[str, Any]:
    return {
        "approval_id": str(approval_id),
        "step": step,
        "decided_by": by,
        "reason": reason,
        "on_reject": on_reject,
    }


def degraded(
    message: str,
    action: Literal["fallback", "notify_human", "none"],
    *,
    fallback: str | None = None,
    content: Any = None,
    escalation_job_id: str | None = None,
) -> dict[str, Any]:
    """``job.degraded``: what followed a terminal failure (the SQL that writes it adds the
    ``dead_letter_id`` it follows). ``fallback`` and ``content`` only for a fallback,
    ``escalation_job_id`` only for a human notification (null: nobody to notify)."""
    event: dict[str, Any] = {"message": message, "action": action}
    if action == "fallback":
        event |= {"fallback": fallback, "content": content}
    elif action == "notify_human":
        event["escalation_job_id"] = escalation_job_id
    return event


def model_fallback(
    from_model: str, to_model: str, failure: Classified | None, *, step: int | None,
    paused_for: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """``job.model_fallback``: an LLM call of the attempt moved from ``from_model`` to
    ``to_model`` after ``failure`` (``reason``: ``overloaded`` or ``rate_limited``, with the
    server's hint in seconds if it gave one), or, without one, before it was made
    (``key_paused``: the job's flow key paused ``retry_after`` seconds more); ``step``: the
    agent's step, null outside steps."""
    if failure is None:
        return {"from": from_model, "to": to_model, "reason": "key_paused", "code": None,
                "retry_after": paused_for, "step": step}  # fmt: skip
    return {
        "from": from_model,
        "to": to_model,
        "reason": failure.throttle,
        "code": failure.code,
        "retry_after": failure.retry_after,
        "step": step,
    }


def waiting_approval(
    approval_id: UUID, *, step: int, question: str, notice_job_id: UUID | None
) -> dict[str, Any]:
    """``job.waiting_approval`` (the SQL adds ``expires_at``, from the database's clock)."""
    return {
        "approval_id": str(approval_id),
        "step": step,
        "question": question,
        "notice_job_id": str(notice_job_id) if notice_job_id else None,
    }


def message_of(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 1] + "…"


def stack_of(exc: BaseException) -> str:
    text = "".join(traceback.format_exception(exc))
    return text if len(text) <= MAX_STACK else "…" + text[-(MAX_STACK - 1) :]
