"""The checkpoint and ledger statements an attempt makes, fenced by its lease.

Each method is one round trip; a write whose lease was superseded matches nothing and raises
:class:`~orchestrator.domain.errors.StaleLease` (the job has been handed to another attempt).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

from psycopg.types.json import Jsonb

from orchestrator.domain.errors import StaleLease
from orchestrator.domain.models import Fence
from orchestrator.domain.states import Status
from orchestrator.storage.runner import Queries


@dataclass(frozen=True)
class Checkpoint:
    step: int
    state: Any
    final: bool


@dataclass(frozen=True)
class LedgerEntry:
    invocation_id: str
    status: str | None  # None: the effect was just recorded pending
    result: Any


def _fenced(fence: Fence) -> dict[str, Any]:
    return {
        "job_id": fence.job_id,
        "lease_token": fence.lease_token,
        "running": Status.RUNNING.value,
    }


class CheckpointStore:
    def __init__(self, queries: Queries) -> None:
        self.queries = queries

    async def last_checkpoint(self, job_id: UUID) -> Checkpoint | None:
        row = await self.queries.row("last_checkpoint", {"job_id": job_id})
        return Checkpoint(**row) if row else None

    async def begin_effect(
        self, fence: Fence, *, step: int, key: str, name: str, args: Any
    ) -> LedgerEntry:
        """The effect's entry, under the invocation id the database gives it (a replay's are
        its chain's first job's)."""
        row = await self.queries.row(
            "begin_effect",
            {
                **_fenced(fence),
                "key": key,
                "step": step,
                "name": name,
                "args": Jsonb(args),
                "attempt": fence.attempt,
            },
        )
        if row is None or row["invocation_id"] is None:
            raise StaleLease(fence.job_id, fence.lease_token)
        return LedgerEntry(**row)

    async def retry_effect(self, fence: Fence, invocation_id: str) -> None:
        params = {**_fenced(fence), "invocation_id": invocation_id, "attempt": fence.attempt}
        if not await self.queries.rows("retry_effect", params):
            raise StaleLease(fence.job_id, fence.lease_token)

    async def fail_effect(self, fence: Fence, invocation_id: str, error: dict[str, Any]) -> None:
        params = {**_fenced(fence), "invocation_id": invocation_id, "error": Jsonb(error)}
        if not await self.queries.rows("fail_effect", params):
            raise StaleLease(fence.job_id, fence.lease_token)

    async def commit_effects(self, fence: Fence, effects: list[dict[str, Any]]) -> None:
        if not effects:
            return
        params = {**_fenced(fence), "effects": Jsonb(effects), "attempt": fence.attempt}
        if len(await self.queries.rows("commit_effects", params)) != len(effects):
            raise StaleLease(fence.job_id, fence.lease_token)

    async def write_checkpoint(
        self, fence: Fence, *, step: int, state: Any, final: bool, effects: list[dict[str, Any]]
    ) -> None:
        row = await self.queries.row(
            "write_checkpoint",
            {
                **_fenced(fence),
                "step": step,
                "state": Jsonb(state),
                "final": final,
                "effects": Jsonb(effects),
                "attempt": fence.attempt,
            },
        )
        if row is None or not row["saved"]:
            raise StaleLease(fence.job_id, fence.lease_token)

    async def record_event(self, fence: Fence, kind: str, payload: dict[str, Any]) -> None:
        """An event about the attempt's own work (shaped in orchestrator.domain.events)."""
        params = {**_fenced(fence), "kind": kind, "payload": Jsonb(payload)}
        if not await self.queries.rows("record_attempt_event", params):
            raise StaleLease(fence.job_id, fence.lease_token)

    async def prune(self, *, older_than_seconds: float, limit: int) -> int:
        """Delete up to ``limit`` checkpoint rows and ``limit`` ledger rows of jobs finished
        more than ``older_than_seconds`` ago, but the ledger of a job whose dead letter awaits
        review; returns the larger of the two counts."""
        row = await self.queries.row(
            "prune_steps", {"older_than": older_than_seconds, "limit": limit}
        )
        return int(row["n"]) if row else 0
