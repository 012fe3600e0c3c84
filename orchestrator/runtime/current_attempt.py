"""Which attempt the running code belongs to, for its log records and its spans.

A worker sets it for the whole of an attempt (the task, everything it awaits, the tasks and
threads it starts with ``asyncio.create_task`` or ``asyncio.to_thread``, the outcome's write):
a context variable, so attempts running side by side in one event loop each see their own.
Code that logs (the task's own loggers included) need not pass anything: the log handlers'
:class:`orchestrator.runtime.logs.AttemptFields` adds these fields to every record, and the
spans of orchestrator.runtime.tracing carry them as attributes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from orchestrator.domain.models import Claim

_fields: ContextVar[Mapping[str, Any] | None] = ContextVar("orchestrator_attempt", default=None)


def fields_of(claim: Claim) -> dict[str, Any]:
    """The fields that say which attempt this is (every log record of it carries them)."""
    return {
        "job_id": str(claim.id),
        "job_type": claim.job_type,
        "attempt": claim.attempt,
        "tenant": claim.tenant_id,
        "trace_id": claim.trace_id,
        "worker": claim.locked_by,
    }


def fields() -> Mapping[str, Any] | None:
    """The running attempt's fields; None outside any attempt."""
    return _fields.get()


@contextmanager
def running(claim: Claim) -> Iterator[None]:
    """The code inside the block runs for this attempt."""
    token = _fields.set(fields_of(claim))
    try:
        yield
    finally:
        _fields.reset(token)
