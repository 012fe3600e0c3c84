"""The checkpoint and ledger statements an attempt makes, fenced by its lease.

Each method is one round trip; a write whose lease was superseded matches nothing and raises
:class:`~orchestrator.errors.StaleLease` (the job has been handed to another attempt).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, LiteralString
from uuid import UUID

from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from orchestrator import states
from orchestrator.errors import StaleLease
from orchestrator.states import Status
from orchestrator.store import JobStore


@dataclass(frozen=True)
class Fence:
    """Which attempt is writing: the job and the lease it holds."""

    job_id: UUID
    lease_token: UUID
    attempt: int

    def params(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "lease_token": self.lease_token,
            "running": Status.RUNNING.value,
        }


@dataclass(frozen=True)
class Checkpoint:
    step: int
    state: Any
    final: bool


@dataclass(frozen=True)
class LedgerEntry:
    status: str | None  # None: the effect was just recorded pending
    result: Any


#: (job id, approval id, question, target or None) -> the submit row of the approval's notice,
#: or None when nobody is to be told (orchestrator.approvals.ApprovalNotices).
Notice = Callable[..., dict[str, Any] | None]


class CheckpointStore:
    def __init__(self, pool: AsyncConnectionPool, notice: Notice | None = None) -> None:
        self.pool = pool
        self.jobs = JobStore(pool)
        self.notice = notice

    async def _rows(self, name: LiteralString, params: dict[str, Any]) -> list[dict[str, Any]]:
        return await self.jobs.rows(name, params)

    async def last_checkpoint(self, job_id: UUID) -> Checkpoint | None:
        rows = await self._rows("last_checkpoint", {"job_id": job_id})
        return Checkpoint(**rows[0]) if rows else None

    async def begin_effect(
        self, fence: Fence, *, invocation_id: str, step: int, name: str, args: Any
    ) -> LedgerEntry:
        [row] = await self._rows(
            "begin_effect",
            {
                **fence.params(),
                "invocation_id": invocation_id,
                "step": step,
                "name": name,
                "args": Jsonb(args),
                "attempt": fence.attempt,
            },
        )
        if not row["leased"]:
            raise StaleLease(fence.job_id, fence.lease_token)
        return LedgerEntry(status=row["status"], result=row["result"])

    async def retry_effect(self, fence: Fence, invocation_id: str) -> None:
        params = {**fence.params(), "invocation_id": invocation_id, "attempt": fence.attempt}
        if not await self._rows("retry_effect", params):
            raise StaleLease(fence.job_id, fence.lease_token)

    async def fail_effect(self, fence: Fence, invocation_id: str, error: dict[str, Any]) -> None:
        params = {**fence.params(), "invocation_id": invocation_id, "error": Jsonb(error)}
        if not await self._rows("fail_effect", params):
            raise StaleLease(fence.job_id, fence.lease_token)

    async def commit_effects(self, fence: Fence, effects: list[dict[str, Any]]) -> None:
        if not effects:
            return
        params = {**fence.params(), "effects": Jsonb(effects), "attempt": fence.attempt}
        if len(await self._rows("commit_effects", params)) != len(effects):
            raise StaleLease(fence.job_id, fence.lease_token)

    async def write_checkpoint(
        self, fence: Fence, *, step: int, state: Any, final: bool, effects: list[dict[str, Any]]
    ) -> None:
        [row] = await self._rows(
            "write_checkpoint",
            {
                **fence.params(),
                "step": step,
                "state": Jsonb(state),
                "final": final,
                "effects": Jsonb(effects),
                "attempt": fence.attempt,
            },
        )
        if not row["saved"]:
            raise StaleLease(fence.job_id, fence.lease_token)

    async def step_approval(self, job_id: UUID, step: int, key: str) -> dict[str, Any] | None:
        rows = await self._rows("step_approval", {"job_id": job_id, "step": step, "key": key})
        return rows[0] if rows else None

    async def request_approval(
        self,
        fence: Fence,
        *,
        approval_id: UUID,
        step: int,
        key: str,
        question: str,
        details: Any,
        on_reject: str,
        expires_in: float,
        notify: dict[str, Any] | None = None,
    ) -> UUID | None:
        """WAITING_APPROVAL, and the approval's notice submitted in the same transaction;
        returns the notice's job id."""
        notice = None
        if self.notice is not None:
            notice = self.notice(
                job_id=fence.job_id, approval_id=approval_id, question=question, target=notify
            )
        async with self.pool.connection() as conn, conn.transaction():
            rows = await self.jobs.rows(
                "request_approval",
                {
                    "job_id": fence.job_id,
                    "lease_token": fence.lease_token,
                    "target": Status.WAITING_APPROVAL.value,
                    "sources": states.sources_of(Status.WAITING_APPROVAL),
                    "approval_id": approval_id,
                    "step": step,
                    "key": key,
                    "question": question,
                    "details": Jsonb(details),
                    "on_reject": on_reject,
                    "expires_in": expires_in,
                    "notice_job_id": notice["id"] if notice else None,
                },
                conn,
            )
            if rows and notice:
                await self.jobs.submit([notice], connection=conn)
        if not rows:
            raise await self.jobs.refusal(fence.job_id, Status.WAITING_APPROVAL, fence.lease_token)
        return UUID(notice["id"]) if notice else None
