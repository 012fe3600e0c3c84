"""History: the jobs that finished per step and the queue depth, read from the rollups
(migration 0026), so a range of days costs the same at any number of jobs, and outlives the jobs
themselves; and the LLM calls' tokens over a time range (migration 0030). A principal limited to
tenants gets only its tenants' numbers."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Query
from pydantic import AwareDatetime

from orchestrator.domain.principals import Principal, Scope
from orchestrator.domain.rollups import Stats
from orchestrator.domain.storable import Text
from orchestrator.interfaces.api.auth import Allowed
from orchestrator.interfaces.api.jobs import Orc
from orchestrator.interfaces.api.models import TenantFilter, UsageTotals

router = APIRouter(prefix="/api/v1", tags=["fleet"])

Reader = Annotated[Principal, Depends(Allowed(Scope.READ))]


@router.get("/stats")
async def stats(
    orc: Orc,
    caller: Reader,
    since: Annotated[datetime | None, Query(alias="from")] = None,
    until: Annotated[datetime | None, Query(alias="to")] = None,
    step: Annotated[int | None, Query(ge=60, le=366 * 86400)] = None,
    by: Annotated[str, Query(max_length=100, pattern=r"^[a-z_]*(,[a-z_]+)*$")] = "",
) -> Stats:
    """Jobs finished per ``step`` seconds in [``from``, ``to``) (outcomes, retries by layer,
    durations with p50/p95 estimates) and the queue depth sampled at each step's start, split
    by ``by`` (a comma-separated list of ``job_type``, ``queue``, ``tenant``). Defaults: the
    last hour by minute. A range over a day is read from the hourly rollups: its step is whole
    hours. At most 1440 points; 422 STATS_QUERY_INVALID names what is out of bounds."""
    return await orc.stats(
        since=since, until=until, step=step, by=[d for d in by.split(",") if d],
        tenants=caller.tenants,
    )  # fmt: skip


@router.get("/usage")
async def usage(
    orc: Orc,
    caller: Reader,
    since: AwareDatetime | None = None,
    until: AwareDatetime | None = None,
    by: Annotated[str, Query(max_length=100, pattern=r"^[a-z_]*(,[a-z_]+)*$")] = "tenant,model",
    tenant_id: TenantFilter = None,
    agent_id: Annotated[Text | None, Query(min_length=1, max_length=200)] = None,
    model: Annotated[Text | None, Query(min_length=1, max_length=200)] = None,
    job_type: Annotated[Text | None, Query(min_length=1, max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> UsageTotals:
    """LLM calls and their tokens (input, output, cache read, cache write, and their sum)
    recorded in [``since``, ``until``) (either end open when not given), grouped by ``by`` (a
    comma-separated list of ``job``, ``tenant``, ``agent``, ``model``, ``job_type``; empty: one
    total), largest first, narrowed by the other parameters. A principal limited to tenants
    gets its tenants' usage only. 422 ARGUMENT_INVALID names a bad grouping or range."""
    groups = [g for g in by.split(",") if g]
    totals = await orc.llm_usage(
        by=groups, since=since, until=until, tenant_id=tenant_id, agent_id=agent_id,
        model=model, job_type=job_type, limit=limit, tenants=caller.tenants,
    )  # fmt: skip
    return UsageTotals(since=since, until=until, by=groups, totals=totals)
