"""Token accounting's rows (migration 0030): each LLM call's usage, written by the attempt
that made it; a job's token budget, written with its submit; the reads of totals and of the
state a budget check needs."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from orchestrator.domain.usage import GROUPS, JobUsage, LlmCall, Tokens, UsageTotal
from orchestrator.storage.database import Conn
from orchestrator.storage.runner import Queries


@dataclass(frozen=True)
class CallUsage:
    """One LLM call's usage, as the attempt that made it records it."""

    job_id: UUID
    call_id: str  # unique within the job: the provider's message id, or one made for the call
    attempt: int
    tenant_id: str | None
    agent_id: str | None
    job_type: str
    model: str
    input_tokens: int
    output_tokens: int
    cache_read_tokens: int
    cache_creation_tokens: int


@dataclass(frozen=True)
class BudgetState:
    job_budget: int | None
    job_spent: int
    tenant_spent: int | None  # None: no tenant period asked for
    period_start: datetime


@dataclass(frozen=True)
class UsageFilters:
    since: datetime | None = None
    until: datetime | None = None
    tenant_id: str | None = None
    agent_id: str | None = None
    model: str | None = None
    job_type: str | None = None
    job_id: UUID | None = None
    #: Only usage of these tenants' jobs (an API principal's); None for any.
    tenants: frozenset[str] | None = None


class UsageStore:
    def __init__(self, queries: Queries) -> None:
        self.queries = queries

    async def record(self, usage: CallUsage) -> bool:
        """Write one call's usage; False if that call was recorded already."""
        row = await self.queries.row("record_llm_usage", vars(usage))
        return row is not None

    async def set_budgets(self, job_ids: Sequence[UUID], tokens: Sequence[int], conn: Conn) -> None:
        await self.queries.execute(
            "set_token_budgets", {"job_ids": list(job_ids), "tokens": list(tokens)}, conn
        )

    async def budget_state(
        self, job_id: UUID, tenant_id: str | None, period: str | None
    ) -> BudgetState:
        """The job's budget and spend, and (with ``period``) its tenant's spend this period."""
        row = await self.queries.row(
            "token_budget_state",
            {"job_id": job_id, "tenant_id": tenant_id, "period": period if tenant_id else None},
        )
        assert row is not None
        return BudgetState(**row)

    async def totals(
        self, by: Collection[str], filters: UsageFilters, *, limit: int
    ) -> list[UsageTotal]:
        params: dict[str, Any] = {f"by_{name}": name in by for name in GROUPS}
        params.update(
            since=filters.since, until=filters.until, tenant_id=filters.tenant_id,
            agent_id=filters.agent_id, model=filters.model, job_type=filters.job_type,
            job_id=filters.job_id, limit=limit,
            tenants=sorted(filters.tenants) if filters.tenants is not None else None,
        )  # fmt: skip
        rows = await self.queries.rows("llm_usage_totals", params)
        return [UsageTotal.model_validate(row) for row in rows]

    async def of_job(self, job_id: UUID) -> JobUsage:
        rows = await self.queries.rows("job_llm_usage", {"job_id": job_id})
        calls = [LlmCall.model_validate(r) for r in rows if r["call_id"] is not None]
        total = Tokens(
            input_tokens=sum(c.input_tokens for c in calls),
            output_tokens=sum(c.output_tokens for c in calls),
            cache_read_tokens=sum(c.cache_read_tokens for c in calls),
            cache_creation_tokens=sum(c.cache_creation_tokens for c in calls),
        )
        budget = rows[0]["token_budget"] if rows else None
        below = await self.queries.row("descendants_llm_usage", {"job_id": job_id})
        assert below is not None
        return JobUsage(
            job_id=job_id, token_budget=budget, total=total, calls=calls,
            descendants=below["jobs"], descendant_calls=below["calls"],
            descendants_total=Tokens.model_validate(below),
        )  # fmt: skip
