"""The fleet as the database holds it, for its metrics (orchestrator.services.fleet): a few
grouped counts, read in one snapshot so that they agree with each other."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from orchestrator.domain.models import QueueStats
from orchestrator.storage.runner import Queries, Row


@dataclass(frozen=True)
class FleetRows:
    jobs: list[Row]  # status, job_type, tenant ("" for none), n: the unfinished jobs
    queues: list[Row]  # queue, depth, oldest_age (seconds): jobs due and waiting
    dead_letters: list[Row]  # state, tenant, n
    approvals: int  # waiting for a decision
    zombies: int  # RUNNING with a heartbeat older than the threshold
    #: tenant ("" for none), model, input, output, cache_read, cache_creation: the tokens of the
    #: LLM calls recorded in the last ``llm_window`` seconds
    llm_tokens: list[Row]
    #: key, paused (bool), running, waiting, rate_factor: the flow keys (docs/flow-control.md)
    flow: list[Row] = field(default_factory=list)
    #: Seconds the rollups' watermark, and the point retention caught up to, are behind now.
    rollup_lag: float = 0.0
    retention_lag: float = 0.0
    #: application, kind, name, other: declarations refused between two live applications
    conflicts: list[Row] = field(default_factory=list)
    #: job_type, pending, retry: waiting jobs of a type no live application serves
    unserved: list[Row] = field(default_factory=list)


@dataclass(frozen=True)
class Unfinished:
    jobs: list[Row]  # status, job_type, tenant ("" for none), n: the unfinished jobs
    zombies: int


class FleetStore:
    def __init__(self, queries: Queries) -> None:
        self.queries = queries

    async def read(
        self, *, zombie_threshold: float, llm_window: float = 3600, live_seconds: float = 30
    ) -> FleetRows:
        async with self.queries.transaction() as conn:
            await self.queries.execute("fleet_snapshot", None, conn)
            jobs = await self.queries.rows("fleet_jobs", None, conn)
            queues = await self.queries.rows("fleet_queues", None, conn)
            dead_letters = await self.queries.rows("fleet_dead_letters", None, conn)
            llm_tokens = await self.queries.rows("fleet_llm_tokens", {"window": llm_window}, conn)
            counts = await self.queries.row(
                "fleet_counts",
                {"threshold": zombie_threshold},
                conn,
            )
            flow = await self.queries.rows("fleet_flow", None, conn)
            lags = await self.queries.row("fleet_lags", None, conn)
            live = {"seconds": live_seconds}
            conflicts = await self.queries.rows("live_application_conflicts", live, conn)
            unserved = await self.queries.rows("unserved_jobs", live | {"tenants": None}, conn)
        assert counts is not None and lags is not None
        return FleetRows(
            jobs=jobs,
            queues=queues,
            dead_letters=dead_letters,
            approvals=counts["approvals"],
            zombies=counts["zombies"],
            flow=flow,
            llm_tokens=llm_tokens,
            rollup_lag=float(lags["rollup_lag"]),
            retention_lag=float(lags["retention_lag"]),
            conflicts=conflicts,
            unserved=unserved,
        )

    async def unfinished(
        self, *, zombie_threshold: float, tenants: Collection[str] | None = None
    ) -> Unfinished:
        """The unfinished jobs counted, and the zombies (the dashboard's overview): partial
        indexes only, never the finished jobs. ``tenants``: the zombies of these tenants'
        jobs only (the jobs are counted per tenant: the caller keeps its own)."""
        jobs = await self.queries.rows("fleet_jobs")
        params = {
            "threshold": zombie_threshold,
            "tenants": sorted(tenants) if tenants is not None else None,
        }
        counts = await self.queries.row("fleet_zombies", params)
        assert counts is not None
        return Unfinished(jobs=jobs, zombies=counts["zombies"])

    async def queue_stats(self, *, tenants: Collection[str] | None = None) -> list[QueueStats]:
        """Each queue's unfinished jobs; ``tenants``: only jobs of these tenants."""
        params = {"tenants": sorted(tenants) if tenants is not None else None}
        return [
            QueueStats.model_validate(row) for row in await self.queries.rows("queue_stats", params)
        ]
