"""Application jobs: submit, read, cancel, and the one writer of terminal failures.

Every write is one state transition, conditional on the legal sources of its target
(orchestrator.domain.states); when it matches no row, :meth:`JobStore.refusal` says why (no
such job, an illegal transition, a superseded lease).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast
from uuid import UUID

import psycopg
from psycopg.types.json import Jsonb

from orchestrator.domain import events, states
from orchestrator.domain.errors import (
    InvalidPayload,
    InvalidTransition,
    JobNotFound,
    StaleLease,
    SubmitError,
)
from orchestrator.domain.failures import TerminalFailure
from orchestrator.domain.models import Claim, Job, JobEvent, SubmitResult
from orchestrator.domain.states import Status
from orchestrator.storage.database import Conn
from orchestrator.storage.rows import StepRecord
from orchestrator.storage.runner import Queries

TASK_PREFIX = "orc."  # Procrastinate task name of a job type: TASK_PREFIX + job_type
#: The SQLSTATE of a flow key its template cannot render from the job (orc_flow_key_v1).
FLOW_KEY_REFUSED = "ORCFK"
#: The SQLSTATE of a parent a submit may not depend on (orc_dependencies_check_v1): unknown,
#: another tenant's, or not before the job in its batch.
PARENT_REFUSED = "ORCDP"


@dataclass(frozen=True)
class Held:
    """A claim an attempt still holds: its dispatch, and how long ago it was made."""

    claim: Claim
    dispatch_id: int
    running_ms: float


@dataclass(frozen=True)
class JobFilters:
    """What a listing of jobs may be narrowed by; ``tenants``: only jobs of these tenants (an
    API principal's), None for any."""

    status: Status | None = None
    job_type: str | None = None
    tenant_id: str | None = None
    agent_id: str | None = None
    job_key: str | None = None
    created_after: datetime | None = None
    created_before: datetime | None = None
    tenants: frozenset[str] | None = None

    def params(self) -> dict[str, Any]:
        return {
            "status": self.status.value if self.status else None,
            "job_type": self.job_type,
            "tenant_id": self.tenant_id,
            "agent_id": self.agent_id,
            "job_key": self.job_key,
            "created_after": self.created_after,
            "created_before": self.created_before,
            "tenants": sorted(self.tenants) if self.tenants is not None else None,
        }


class JobStore:
    def __init__(self, queries: Queries) -> None:
        self.queries = queries

    # -- submit ----------------------------------------------------------------------------

    async def submit(
        self, specs: Sequence[dict[str, Any]], conn: Conn | None = None
    ) -> list[SubmitResult]:
        """Jobs and their first dispatches, in one statement (inside ``conn``'s transaction
        when given: they vanish if it rolls back). A spec under a flow limit whose payload
        lacks what its key's template names refuses the whole submit (InvalidPayload, naming
        it), as a parent it may not depend on does (SubmitError); inside ``conn``'s
        transaction, only the submit's own savepoint rolls back."""
        params = {
            "specs": Jsonb([{**spec, "ord": i} for i, spec in enumerate(specs)]),
            "initial_status": Status.PENDING.value,
            "waiting": sorted(s.value for s in states.CLAIMABLE),
            "task_prefix": TASK_PREFIX,
        }
        with submit_refused():
            if conn is not None and any(
                spec.get("flow_template") or spec.get("depends_on") for spec in specs
            ):
                async with conn.transaction():
                    rows = await self.queries.rows("submit_jobs", params, conn)
            else:
                rows = await self.queries.rows("submit_jobs", params, conn)
        rows.sort(key=lambda r: r["ord"])
        return [SubmitResult(job_id=r["job_id"], outcome=r["outcome"]) for r in rows]

    async def flow_key(self, row: dict[str, Any]) -> str | None:
        """The flow key a submit of ``row`` would store (None: no limit), or InvalidPayload as
        the submit would refuse it; nothing written."""
        if not row.get("flow_template"):
            return None
        with submit_refused():
            found = await self.queries.row(
                "render_flow_key", {**row, "payload": Jsonb(row.get("payload"))}
            )
        assert found is not None
        return cast(str, found["key"])

    async def dispatch(self, job_ids: Sequence[UUID], conn: Conn) -> None:
        """A new dispatch for each job, at its next_retry_at or run_at."""
        await self.queries.row(
            "dispatch_jobs", {"job_ids": list(job_ids), "task_prefix": TASK_PREFIX}, conn
        )

    # -- terminal failures -----------------------------------------------------------------

    async def fail(
        self, failures: Sequence[TerminalFailure], conn: Conn | None = None
    ) -> list[UUID | None]:
        """Write terminal failures (orchestrator.domain.failures) with their dead letters,
        events, degradations and dispatch ends; returns each one's dead-letter id, or None where
        the job was not failed (its lease was superseded, or it was no longer waiting)."""
        if conn is None:
            async with self.queries.transaction() as tx:
                return await self.fail(failures, tx)
        items = [
            {
                "ord": i,
                "job_id": str(f.job_id),
                "lease_token": str(f.lease_token) if f.lease_token else None,
                "dead_letter_id": str(f.dead_letter_id),
                "error": f.last_error,
                "failed": f.failed,
                "before": [{"kind": kind, "payload": payload} for kind, payload in f.before],
                "degraded": f.degraded.event if f.degraded else None,
                "dispatch_id": f.dispatch.id if f.dispatch else None,
                "dispatch_status": f.dispatch.status if f.dispatch else None,
            }
            for i, f in enumerate(failures)
        ]
        rows = await self.queries.rows(
            "fail_jobs",
            {
                "items": Jsonb(items),
                "target": Status.FAILED.value,
                "sources": states.sources_of(Status.FAILED),
            },
            conn,
        )
        rows.sort(key=lambda r: r["ord"])
        letters: list[UUID | None] = [r["dead_letter_id"] for r in rows]
        escalations = [
            row
            for failure, letter in zip(failures, letters, strict=True)
            if letter is not None and failure.degraded is not None
            for row in failure.degraded.submit
        ]
        if escalations:
            await self.submit(escalations, conn)
        return letters

    # -- operator actions ------------------------------------------------------------------

    async def cancel(self, job_id: UUID, *, reason: str, by: str) -> None:
        """CANCELLED; a waiting dispatch is cancelled, a running one aborted, and an open
        approval closed."""

        async def cancel(conn: Conn) -> bool:
            row = await self.queries.row(
                "cancel_job",
                {
                    "job_id": job_id,
                    "target": Status.CANCELLED.value,
                    "sources": states.sources_of(Status.CANCELLED),
                    "reason": reason,
                    "by": by,
                },
                conn,
            )
            if row is not None:
                await self.queries.execute(
                    "cancel_job_approvals", {"job_id": job_id, "by": by, "reason": reason}, conn
                )
            return row is not None

        if not await self.queries.in_transaction(cancel):
            raise await self.refusal(job_id, Status.CANCELLED, None)

    async def record_events(
        self, entries: Sequence[tuple[UUID, str, dict[str, Any]]], conn: Conn | None = None
    ) -> None:
        """Append events, in order: (job id, kind, payload) each."""
        rows = [{"job_id": str(job_id), "kind": kind, "payload": p} for job_id, kind, p in entries]
        await self.queries.execute("record_events", {"events": Jsonb(rows)}, conn)

    async def record_maintenance_failures(
        self, failures: Sequence[tuple[UUID, dict[str, Any]]], conn: Conn
    ) -> list[UUID]:
        """``job.maintenance_failed`` (job id, payload) for each, unless the job's latest event
        already says the same; returns the jobs it was recorded on."""
        rows = await self.queries.rows(
            "record_maintenance_failures",
            {"failures": Jsonb([{"job_id": str(j), "payload": p} for j, p in failures])},
            conn,
        )
        return [row["job_id"] for row in rows]

    async def held(self, job_id: UUID, *, attempt: int, lease_token: UUID) -> Held | None:
        """The claim an attempt holds (its job RUNNING under this attempt and lease), or None
        when it no longer holds it."""
        params = {"job_id": job_id, "attempt": attempt, "lease_token": lease_token,
                  "running": Status.RUNNING.value}  # fmt: skip
        row = await self.queries.row("held_lease", params)
        if row is None:
            return None
        return Held(
            Claim.model_validate(row), row["procrastinate_job_id"], float(row["running_ms"])
        )

    async def refusal(
        self, job_id: UUID, target: Status, lease_token: UUID | None
    ) -> JobNotFound | InvalidTransition | StaleLease:
        """Why a fenced write matched nothing: no such job, an illegal transition, or a lease
        that is no longer this attempt's."""
        row = await self.queries.row("job_state", {"job_id": job_id})
        if row is None:
            return JobNotFound(job_id)
        if not states.is_legal(Status(row["status"]), target):
            return InvalidTransition(job_id, row["status"], target.value)
        return StaleLease(job_id, lease_token)

    # -- reads -----------------------------------------------------------------------------

    async def get(self, job_id: UUID) -> Job:
        row = await self.queries.row("get_job", {"job_id": job_id})
        if row is None:
            raise JobNotFound(job_id)
        return Job.model_validate(row)

    async def history(self, job_id: UUID) -> list[JobEvent]:
        rows = await self.queries.rows("job_events", {"job_id": job_id})
        return [_event(row) for row in rows]

    async def page(self, filters: JobFilters, *, before: UUID | None, limit: int) -> list[Job]:
        """A page of jobs, newest first, older than ``before`` (the previous page's last id)."""
        params = {**filters.params(), "before": before, "limit": limit}
        return [Job.model_validate(row) for row in await self.queries.rows("page_jobs", params)]

    async def events_after(self, job_id: UUID, *, after: int, limit: int) -> list[JobEvent]:
        """A job's events after the event id ``after``, oldest first."""
        params = {"job_id": job_id, "after": after, "limit": limit}
        rows = await self.queries.rows("job_events_after", params)
        return [_event(row) for row in rows]

    async def steps(self, job_id: UUID) -> list[StepRecord]:
        """A job's checkpoints and side effects, in step order."""
        rows = await self.queries.rows("job_steps", {"job_id": job_id})
        return [cast(StepRecord, row) for row in rows]


def _event(row: dict[str, Any]) -> JobEvent:
    """An event as every reader gets it: its ``run_id`` no longer the attempt's lease token."""
    return JobEvent.model_validate({**row, "payload": events.shown(row["payload"])})


@contextmanager
def submit_refused() -> Iterator[None]:
    """The database's refusals of a submit as its errors: a flow key (orc_flow_key_v1: its
    message names the field, its detail the job type) as InvalidPayload; a parent
    (orc_dependencies_check_v1: its detail is the job's place in the submit) as SubmitError."""
    try:
        yield
    except psycopg.Error as exc:
        if exc.sqlstate == PARENT_REFUSED:
            raise SubmitError(
                f"job {exc.diag.message_detail} of the submit: {exc.diag.message_primary}"
            ) from None
        if exc.sqlstate != FLOW_KEY_REFUSED:
            raise
        raise InvalidPayload(
            exc.diag.message_detail or "?", exc.diag.message_primary or "?"
        ) from None
