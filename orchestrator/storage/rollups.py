"""The rollups (migration 0026): written by the rollup service from the jobs that finished, read
by the stats API, the CLI and the dashboard, never from the jobs themselves."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

from orchestrator.domain.rollups import BOUNDS_MS, DIMENSIONS, HOUR, MINUTE, Window
from orchestrator.storage.runner import Queries, Row


@dataclass(frozen=True)
class RolledUp:
    """One statement's span of closed minutes ``[since, until)`` and the jobs that finished in
    it (``since == until``: no minute was closed yet)."""

    since: datetime
    until: datetime
    jobs: int

    @property
    def minutes(self) -> int:
        return int((self.until - self.since).total_seconds() // MINUTE)


class RollupStore:
    def __init__(self, queries: Queries) -> None:
        self.queries = queries

    async def roll_up(self, *, minutes: int, settle_seconds: float) -> RolledUp:
        """The next ``minutes`` closed minutes past the watermark, and the hours they touch, in
        one transaction; the watermark moved past them."""
        async with self.queries.transaction() as conn:
            row = await self.queries.row(
                "roll_up_minutes",
                {"minutes": minutes, "settle": settle_seconds, "bounds": list(BOUNDS_MS)},
                conn,
            )
            assert row is not None
            done = RolledUp(row["since"], row["until"], row["jobs"])
            if done.minutes:
                span = {"since": done.since, "until": done.until}
                await self.queries.execute("clear_hours", span, conn)
                await self.queries.execute("roll_up_hours", span, conn)
        return done

    async def sample_queue_depth(self) -> int:
        """This minute's waiting and running jobs per queue and tenant; the rows written."""
        return await self.queries.execute("sample_queue_depth")

    async def prune(self, *, minute_days: float, hour_days: float, limit: int) -> int:
        """At most ``limit`` rows of each kind past its retention; the rows deleted."""
        deleted = 0
        for period, days in ((MINUTE, minute_days), (HOUR, hour_days)):
            deleted += await self.queries.execute(
                "prune_rollups", {"period": period, "days": days, "limit": limit}
            )
        deleted += await self.queries.execute(
            "prune_queue_depth", {"days": minute_days, "limit": limit}
        )
        return deleted

    async def rolled_up_to(self) -> datetime | None:
        """The watermark: every job that finished before it is counted (None: none yet)."""
        row = await self.queries.row("rolled_up_to")
        assert row is not None
        value: datetime | None = row["rolled_up_to"]
        return value

    async def job_stats(self, window: Window, *, tenants: Collection[str] | None) -> list[Row]:
        return await self.queries.rows("job_stats", _params(window, tenants))

    async def queue_depth(self, window: Window, *, tenants: Collection[str] | None) -> list[Row]:
        return await self.queries.rows("queue_depth_stats", _params(window, tenants))


def _params(window: Window, tenants: Collection[str] | None) -> dict[str, object]:
    return {
        "since": window.since, "until": window.until, "step": window.step,
        "period": window.period, "tenants": sorted(tenants) if tenants is not None else None,
        **{f"by_{d}": d in window.by for d in DIMENSIONS},
    }  # fmt: skip
