"""What the dashboard's overview and the fleet summary read besides the fleet's counts and the
rollups: who runs jobs now, the registry's processes, the flow keys holding jobs back, the dead
letters and approvals waiting for a person, and the last hour's activity by the minute."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

from orchestrator.domain.dead_letters import OPEN
from orchestrator.domain.summary import HeldKey, Process
from orchestrator.storage.runner import Queries


@dataclass(frozen=True)
class Holder:
    """Who holds running jobs (a lease's ``locked_by``), how many, and its newest heartbeat."""

    locked_by: str
    running: int
    last_heartbeat: datetime | None


class DashboardStore:
    def __init__(self, queries: Queries) -> None:
        self.queries = queries

    async def holders(self, *, tenants: Collection[str] | None) -> list[Holder]:
        rows = await self.queries.rows("job_holders", {"tenants": _list(tenants)})
        return [Holder(r["locked_by"], r["running"], r["last_heartbeat"]) for r in rows]

    async def processes(self, *, seconds: float) -> list[Process]:
        """Every process of the registry, live or stalled (silent ``seconds`` or more)."""
        rows = await self.queries.rows("registry_processes", {"seconds": seconds})
        return [Process.model_validate(r) for r in rows]

    async def held_keys(self, *, tenants: Collection[str] | None) -> list[HeldKey]:
        rows = await self.queries.rows("held_flow_keys", {"tenants": _list(tenants)})
        return [HeldKey.model_validate(r) for r in rows]

    async def letters_to_review(self, *, tenants: Collection[str] | None) -> dict[str, int]:
        rows = await self.queries.rows("letters_to_review", {"tenants": _list(tenants)})
        found = {r["state"]: r["n"] for r in rows}
        return {state: found.get(state, 0) for state in OPEN}

    async def approvals_waiting(self, *, tenants: Collection[str] | None) -> int:
        row = await self.queries.row("approvals_waiting", {"tenants": _list(tenants)})
        assert row is not None
        return int(row["n"])

    async def activity(
        self, *, since: datetime, tenants: Collection[str] | None
    ) -> dict[str, dict[datetime, int]]:
        """Retries scheduled and failures per minute from ``since``, by the minute they
        happened: {"retried": {minute: n}, "failed": {minute: n}}."""
        rows = await self.queries.rows("activity", {"since": since, "tenants": _list(tenants)})
        return {name: {r["at"]: r[name] for r in rows if r[name]} for name in ("retried", "failed")}


def _list(tenants: Collection[str] | None) -> list[str] | None:
    return sorted(tenants) if tenants is not None else None
