"""What operators read: jobs, their history and steps, dead letters and approvals, each
argument checked before the query."""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime
from uuid import UUID

from orchestrator.domain.applications import Applications
from orchestrator.domain.dead_letters import states_shown
from orchestrator.domain.errors import InvalidArgument
from orchestrator.domain.models import Awaited, DeadLetter, Job, JobEvent
from orchestrator.domain.states import Status
from orchestrator.facade.arguments import status_of, storable, tenants_named, uuid_of
from orchestrator.facade.lifecycle import Lifecycle
from orchestrator.storage.jobs import JobFilters
from orchestrator.storage.rows import ApprovalRecord, StepRecord


class Reads:
    def __init__(self, lifecycle: Lifecycle, live_seconds: float) -> None:
        self._lifecycle = lifecycle
        self._live_seconds = live_seconds

    async def applications(self, *, tenants: Collection[str] | None) -> Applications:
        """Each application with its live processes and declarations, and the waiting jobs no
        live application serves; of ``tenants`` only (None: all) what names a tenant."""
        storable(tenants=tenants)
        tenants_named(tenants=tenants)
        store = self._lifecycle.stores.applications
        return Applications(
            applications=await store.views(seconds=self._live_seconds, tenants=tenants),
            unserved=await store.unserved(seconds=self._live_seconds, tenants=tenants),
        )

    async def job(self, job_id: UUID | str) -> Job:
        return await self._lifecycle.stores.jobs.get(uuid_of(job_id))

    async def events(self, job_id: UUID | str) -> list[JobEvent]:
        return await self._lifecycle.stores.jobs.history(uuid_of(job_id))

    async def parents(self, job_id: UUID | str) -> list[Awaited]:
        return [p for _, p in await self._lifecycle.stores.graph.parents(uuid_of(job_id))]

    async def children(
        self, job_id: UUID | str, *, after: UUID | None, limit: int
    ) -> list[Awaited]:
        graph = self._lifecycle.stores.graph
        return await graph.children(uuid_of(job_id), after=after, limit=limit)

    async def steps(self, job_id: UUID | str) -> list[StepRecord]:
        return await self._lifecycle.stores.jobs.steps(uuid_of(job_id))

    async def jobs(
        self,
        *,
        status: Status | str | None,
        job_type: str | None,
        tenant_id: str | None,
        job_key: str | None,
        agent_id: str | None,
        created_after: datetime | None,
        created_before: datetime | None,
        limit: int,
    ) -> list[Job]:
        """The newest jobs that match: the API's read and filters, without its cursor."""
        storable(job_type=job_type, tenant_id=tenant_id, job_key=job_key, agent_id=agent_id)
        tenants_named(tenant_id=tenant_id)
        if created_after and created_before and created_after >= created_before:
            raise InvalidArgument(
                f"created_after: {created_after.isoformat()} is not before created_before"
                f" ({created_before.isoformat()})"
            )
        filters = JobFilters(
            status=status_of(status) if status else None, job_type=job_type,
            tenant_id=tenant_id, agent_id=agent_id, job_key=job_key,
            created_after=created_after, created_before=created_before,
        )  # fmt: skip
        return await self._lifecycle.stores.jobs.page(filters, before=None, limit=limit)

    async def dead_letters(
        self,
        *,
        state: str | None,
        job_type: str | None = None,
        tenant_id: str | None,
        error: str | None = None,
        limit: int,
        tenants: Collection[str] | None,
    ) -> list[DeadLetter]:
        storable(state=state, job_type=job_type, tenant_id=tenant_id, error=error,
                 tenants=tenants)  # fmt: skip
        tenants_named(tenant_id=tenant_id, tenants=tenants)
        return await self._lifecycle.stores.dead_letters.list_letters(
            states=states_shown(state) if state is not None else None, job_type=job_type,
            tenant_id=tenant_id, error=error or None, limit=limit, tenants=tenants,
        )  # fmt: skip

    async def dead_letter(self, dead_letter_id: UUID | str) -> DeadLetter:
        return await self._lifecycle.stores.dead_letters.get(uuid_of(dead_letter_id, "dead letter"))

    async def dead_letter_of_job(self, job_id: UUID | str) -> DeadLetter | None:
        return await self._lifecycle.stores.dead_letters.of_job(uuid_of(job_id))

    async def approvals(
        self, *, status: str | None, limit: int, tenants: Collection[str] | None
    ) -> list[ApprovalRecord]:
        storable(status=status, tenants=tenants)
        tenants_named(tenants=tenants)
        return await self._lifecycle.stores.approvals.list_approvals(
            status=status, limit=limit, tenants=tenants
        )
