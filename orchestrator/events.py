"""Payloads of the job history (``orc_job_events``) and of ``last_error``.

Kinds and their payloads (seed 000's vocabulary; ``run_id`` is the attempt's lease token and
``worker`` the seed's ``actor``; each event row also has ``job_id`` and ``at``):

    job.created          {job_type, queue, run_at, max_attempts, max_retries, job_key, trace_id}
    job.replaced         {job_key, mode}                     job_key submit replaced a waiting job
    job.key_revoked      {job_key, replaced_by}              ... or took the key from a running one
    job.running          {attempt, max_attempts, run, retry_count, max_retries, worker, run_id}
    job.completed        {attempt, run_id, worker, duration_ms}
    job.failed           {terminal, attempt, max_attempts, run, layer?, backoff_ms?, error, run_id}
    job.retry_scheduled  {layer, backoff_ms, retry_count, available_at}
    job.dead_lettered    {dead_letter_id}                    always just before a terminal failed
    job.degraded         {action, message, fallback?, content?, escalation_job_id?}   just after
                         it: what the failure degraded to (orchestrator.degradation)
    job.interrupted      {attempt, run_id, worker, reason}   handed back, no budget used
    job.cancelled        {reason, by}
    job.redispatched     {lost_procrastinate_job_id, lost_procrastinate_status}
    job.zombie_detected  {attempt, worker, last_heartbeat, threshold_seconds, reason}
    job.checkpointed     {step, effects_committed}
    job.waiting_approval {approval_id, step, question, expires_at, notice_job_id}
    job.approved | job.rejected | job.approval_expired   {approval_id, step, decided_by, reason,
                                                          on_reject}

``error`` is ``{message, code, classification}``; known secrets are redacted from errors
(orchestrator.secrets) before they are stored. The SQL adds ``retry_count``/``available_at``
and ``dead_letter_id``, which only the database knows at the moment of the write.
"""

from __future__ import annotations

import traceback
from datetime import UTC, datetime
from typing import Any

from pydantic_core import to_jsonable_python

from orchestrator.classification import Classified
from orchestrator.models import Claim
from orchestrator.policy import Layer
from orchestrator.secrets import redact, redact_json

MAX_MESSAGE = 2_000
MAX_STACK = 8_000


def error_summary(exc: BaseException, classified: Classified) -> dict[str, Any]:
    return {
        "message": redact(message_of(exc)),
        "code": classified.code,
        "classification": classified.error_class.value,
    }


def last_error(
    exc: BaseException,
    classified: Classified,
    claim: Claim,
    *,
    terminal: bool,
    backoff_ms: float | None = None,
    next_available_at: datetime | None = None,
    output: Any = None,
) -> dict[str, Any]:
    return {
        **error_summary(exc, classified),
        "ts": datetime.now(UTC).isoformat(),
        "stack": redact(stack_of(exc)),
        "attempt": claim.attempt,
        "max_attempts": claim.max_attempts,
        "run": claim.dispatch_attempt,
        "retry_count": claim.retry_count,
        "max_retries": claim.max_retries,
        "terminal": terminal,
        "backoff_ms": backoff_ms,
        "next_available_at": next_available_at.isoformat() if next_available_at else None,
        "output": (
            redact_json(to_jsonable_python(output, fallback=repr)) if output is not None else None
        ),
    }


def failed(
    exc: BaseException,
    classified: Classified,
    claim: Claim,
    *,
    terminal: bool,
    layer: Layer | None = None,
    backoff_ms: float | None = None,
) -> dict[str, Any]:
    event: dict[str, Any] = {
        "terminal": terminal,
        "attempt": claim.attempt,
        "max_attempts": claim.max_attempts,
        "run": claim.dispatch_attempt,
        "run_id": str(claim.lease_token),
        "error": error_summary(exc, classified),
    }
    if layer is not None:
        event["layer"] = layer.value
    if backoff_ms is not None:
        event["backoff_ms"] = round(backoff_ms, 3)
    return event


def retry_scheduled(layer: Layer, backoff_ms: float) -> dict[str, Any]:
    return {"layer": layer.value, "backoff_ms": round(backoff_ms, 3)}


def completed(claim: Claim, duration_ms: float) -> dict[str, Any]:
    return {
        "attempt": claim.attempt,
        "run_id": str(claim.lease_token),
        "worker": claim.locked_by,
        "duration_ms": round(duration_ms, 3),
    }


def interrupted(claim: Claim, reason: str) -> dict[str, Any]:
    return {
        "attempt": claim.attempt,
        "run_id": str(claim.lease_token),
        "worker": claim.locked_by,
        "reason": reason,
    }


def message_of(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 1] + "…"


def stack_of(exc: BaseException) -> str:
    text = "".join(traceback.format_exception(exc))
    return text if len(text) <= MAX_STACK else "…" + text[-(MAX_STACK - 1) :]
