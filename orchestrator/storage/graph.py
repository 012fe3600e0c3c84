"""The graphs jobs make (docs/workflows.md): what a job depends on, the children a running job
spawns and waits for. The edges are written by the submit's statement and settled by the
database as jobs end (functions/dependencies.sql)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any
from uuid import UUID

from orchestrator.domain.dependencies import MAX_PARENTS
from orchestrator.domain.errors import StaleLease
from orchestrator.domain.models import Awaited, Fence
from orchestrator.domain.states import Status
from orchestrator.storage.jobs import TASK_PREFIX, JobStore, submit_refused
from orchestrator.storage.runner import Queries
from orchestrator.storage.usage import UsageStore


class GraphStore:
    def __init__(self, queries: Queries, jobs: JobStore, usage: UsageStore) -> None:
        self.queries = queries
        self.jobs = jobs
        self.usage = usage

    async def parents(
        self, job_id: UUID, *, after: int = 0, limit: int = MAX_PARENTS,
        tenants: Collection[str] | None = None,
    ) -> list[tuple[int, Awaited]]:  # fmt: skip
        """The job's parents after the place ``after``, in the order its submit named them,
        each with its place; of ``tenants`` only (None: any)."""
        params = {"job_id": job_id, "after": after, "limit": limit, "tenants": _listed(tenants)}
        rows = await self.queries.rows("job_parents", params)
        return [(row["ord"], Awaited.model_validate(row)) for row in rows]

    async def children(
        self, job_id: UUID, *, after: UUID | None, limit: int,
        tenants: Collection[str] | None = None,
    ) -> list[Awaited]:  # fmt: skip
        """The children the job spawned after the child ``after``, in the order made."""
        params = {"job_id": job_id, "after": after, "limit": limit, "tenants": _listed(tenants)}
        rows = await self.queries.rows("job_children", params)
        return [Awaited.model_validate(row) for row in rows]

    async def outcomes(self, job_ids: Sequence[UUID]) -> list[Awaited]:
        """These jobs as a job that waited for them reads them, in this order."""
        rows = await self.queries.rows("awaited_outcomes", {"job_ids": list(job_ids)})
        return [Awaited.model_validate(row) for row in rows]

    async def spawn(
        self, fence: Fence, *, step: int, key: str, rows: list[dict[str, Any]],
        cancel_with_parent: bool,
    ) -> list[UUID]:  # fmt: skip
        """The children of a step's spawn under ``key``: those it made before (a step run
        again), or ``rows`` submitted now with their record and their token budgets, in one
        transaction, while the attempt holds its lease (StaleLease otherwise)."""
        async with self.queries.transaction() as conn:
            held = {"job_id": fence.job_id, "lease_token": fence.lease_token}
            if await self.queries.row("lock_spawner", held, conn) is None:
                raise StaleLease(fence.job_id, fence.lease_token)
            spawn = {"job_id": fence.job_id, "step": step, "key": key}
            made = await self.queries.rows("spawned_children", spawn, conn)
            if made:
                return [row["child_id"] for row in made]
            children = [r.job_id for r in await self.jobs.submit(rows, conn)]
            budgets = [(c, r["token_budget"]) for c, r in zip(children, rows, strict=True)]
            given = [(c, b) for c, b in budgets if b is not None]
            if given:
                await self.usage.set_budgets([c for c, _ in given], [b for _, b in given], conn)
            await self.queries.execute(
                "record_children",
                {**spawn, "children": children, "cancel_with_parent": cancel_with_parent},
                conn,
            )
            return children

    async def wait_for(self, fence: Fence, children: Sequence[UUID]) -> int:
        """The job stops (BLOCKED, its lease released) until ``children`` have ended; how many
        it waits for (0: they all have, it goes on). StaleLease when its lease is gone."""
        params = {"job_id": fence.job_id, "lease_token": fence.lease_token,
                  "children": list(children), "task_prefix": TASK_PREFIX}  # fmt: skip
        with submit_refused():
            row = await self.queries.row("wait_for_children", params)
        if row is None or row["waiting"] is None:
            raise await self.jobs.refusal(fence.job_id, Status.BLOCKED, fence.lease_token)
        return int(row["waiting"])


def _listed(tenants: Collection[str] | None) -> list[str] | None:
    return None if tenants is None else sorted(tenants)
