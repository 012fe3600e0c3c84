"""What the dashboard's overview reads besides the fleet's counts and the rollups: who runs jobs
now, and the workers the registry knows alive."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

from orchestrator.storage.runner import Queries


@dataclass(frozen=True)
class Holder:
    """Who holds running jobs (a lease's ``locked_by``), how many, and its newest heartbeat."""

    locked_by: str
    running: int
    last_heartbeat: datetime | None


@dataclass(frozen=True)
class RegisteredWorker:
    id: int
    last_heartbeat: datetime


class DashboardStore:
    def __init__(self, queries: Queries) -> None:
        self.queries = queries

    async def holders(self, *, tenants: Collection[str] | None) -> list[Holder]:
        rows = await self.queries.rows("job_holders", {"tenants": _list(tenants)})
        return [Holder(r["locked_by"], r["running"], r["last_heartbeat"]) for r in rows]

    async def registered_workers(self, *, seconds: float) -> list[RegisteredWorker]:
        """Workers (and API servers) whose registry heartbeat is younger than ``seconds``."""
        rows = await self.queries.rows("registered_workers", {"seconds": seconds})
        return [RegisteredWorker(r["id"], r["last_heartbeat"]) for r in rows]


def _list(tenants: Collection[str] | None) -> list[str] | None:
    return sorted(tenants) if tenants is not None else None
