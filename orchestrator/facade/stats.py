"""What the fleet did and spent: the finished jobs and queue depth, read from the rollups
(docs/operations.md, "Rollups"), and the LLM calls' tokens (docs/configuration.md, "Token
accounting and budgets")."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import UTC, datetime
from uuid import UUID

from orchestrator.domain.errors import InvalidArgument
from orchestrator.domain.rollups import Stats, stats, window
from orchestrator.domain.usage import JobUsage, UsageTotal, groups_of
from orchestrator.facade.arguments import storable, tenants_named, uuid_of
from orchestrator.facade.lifecycle import Lifecycle
from orchestrator.storage.usage import UsageFilters


class Statistics:
    def __init__(self, lifecycle: Lifecycle) -> None:
        self._lifecycle = lifecycle

    async def stats(
        self,
        *,
        since: datetime | None,
        until: datetime | None,
        step: int | None,
        by: Sequence[str],
        tenants: Collection[str] | None,
    ) -> Stats:
        storable(tenants=tenants)
        tenants_named(tenants=tenants)
        asked = window(since=since, until=until, step=step, by=by, now=datetime.now(UTC))
        store = self._lifecycle.stores.rollups
        return stats(
            asked,
            await store.job_stats(asked, tenants=tenants),
            await store.queue_depth(asked, tenants=tenants),
            await store.rolled_up_to(),
        )

    async def llm_usage(
        self,
        *,
        by: str | Sequence[str],
        since: datetime | None,
        until: datetime | None,
        tenant_id: str | None,
        agent_id: str | None,
        model: str | None,
        job_type: str | None,
        job_id: UUID | str | None,
        tenants: Collection[str] | None,
        limit: int,
    ) -> list[UsageTotal]:
        groups = groups_of(by)
        storable(
            tenant_id=tenant_id, agent_id=agent_id, model=model, job_type=job_type,
            tenants=tenants,
        )  # fmt: skip
        tenants_named(tenant_id=tenant_id, tenants=tenants)
        if since is not None and until is not None and until <= since:
            raise InvalidArgument(f"until ({until.isoformat()}) is not after since")
        if not 1 <= limit <= 100_000:
            raise InvalidArgument(f"limit: {limit} is not between 1 and 100000")
        filters = UsageFilters(
            since=since, until=until, tenant_id=tenant_id, agent_id=agent_id, model=model,
            job_type=job_type, job_id=uuid_of(job_id) if job_id is not None else None,
            tenants=frozenset(tenants) if tenants is not None else None,
        )  # fmt: skip
        return await self._lifecycle.stores.usage.totals(groups, filters, limit=limit)

    async def job_usage(self, job_id: UUID | str) -> JobUsage:
        stores = self._lifecycle.stores
        job = await stores.jobs.get(uuid_of(job_id))  # JobNotFound for no such job
        return await stores.usage.of_job(job.id)
