"""The schedules' rows (migration 0027): their definitions as the processes hold them, where
each stands (its last fired tick), and whether an operator paused it."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from datetime import datetime
from typing import Any
from uuid import UUID

from psycopg.types.json import Jsonb
from pydantic import BaseModel, ConfigDict

from orchestrator.domain.applications import (
    Application,
    Declaration,
    Declared,
    Kind,
    schedule_definitions,
)
from orchestrator.domain.errors import ScheduleNotFound
from orchestrator.domain.schedules import Schedule, ScheduleView
from orchestrator.storage.applications import ApplicationStore
from orchestrator.storage.database import Conn
from orchestrator.storage.runner import Queries


class ScheduleState(BaseModel):
    """Where a schedule stands, for its scheduler: ticks after ``fire_after`` are due."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    name: str
    fire_after: datetime
    paused: bool
    now: datetime


class ScheduleStore:
    def __init__(self, queries: Queries, applications: ApplicationStore) -> None:
        self.queries = queries
        self.applications = applications

    async def sync(
        self,
        application: Application,
        schedules: Iterable[Schedule],
        *,
        declares: str | None = None,
        whole: bool = True,
    ) -> Declared:
        """Declare these definitions as ``application``'s and write them where new or changed
        (a new one is due from now on). ``whole``: all the application's schedules, and those
        it withdrew that no other application declares go (once no live process of it declares
        otherwise than ``declares``, this process's fingerprint: else ``deferred``); otherwise
        (an operator's command, which may hold part of them) nothing goes."""
        rows = schedule_definitions(schedules)
        declaration = Declaration(
            application, {Kind.SCHEDULE: rows}, whole=whole, declares=declares
        )

        async def write(conn: Conn, declared: Declared) -> None:
            gone = declared.gone(Kind.SCHEDULE)
            if rows or gone:
                params = {
                    "schedules": Jsonb([{"name": name, **row} for name, row in rows.items()]),
                    "gone": gone,
                }
                await self.queries.execute("sync_schedules", params, conn)

        declared, _ = await self.applications.in_declaration(declaration, write)
        return declared

    async def states(self, names: Collection[str]) -> list[ScheduleState]:
        """Where each of these schedules stands, read in one statement."""
        rows = await self.queries.rows("schedules_to_fire", {"names": list(names)})
        return [ScheduleState.model_validate(row) for row in rows]

    async def fire(
        self, name: str, *, seen: datetime, tick: datetime, job_id: UUID, conn: Conn
    ) -> bool:
        """Move ``name`` past ``tick`` if it still stands at ``seen`` and is not paused (in
        ``conn``'s transaction, with the runs' submit): whether this process fires it."""
        params = {"name": name, "seen": seen, "tick": tick, "job_id": job_id}
        return await self.queries.row("fire_schedule", params, conn) is not None

    async def last_job(self, name: str, job_id: UUID, conn: Conn) -> None:
        """``name``'s last run is ``job_id`` (in the firing's transaction)."""
        await self.queries.execute("schedule_last_job", {"name": name, "job_id": job_id}, conn)

    async def list_schedules(self, *, tenants: Collection[str] | None = None) -> list[ScheduleView]:
        rows = await self.queries.rows("list_schedules", {"tenants": _list(tenants)})
        return [ScheduleView.of(row) for row in rows]

    async def pause(
        self, name: str, *, by: str, tenants: Collection[str] | None = None
    ) -> ScheduleView:
        return await self._set("pause_schedule", name, {"by": by}, tenants)

    async def resume(self, name: str, *, tenants: Collection[str] | None = None) -> ScheduleView:
        return await self._set("resume_schedule", name, {}, tenants)

    async def _set(
        self, query: Any, name: str, params: dict[str, Any], tenants: Collection[str] | None
    ) -> ScheduleView:
        """ScheduleNotFound for a schedule not stored, or not of ``tenants``."""
        row = await self.queries.row(query, {"name": name, "tenants": _list(tenants), **params})
        if row is None:
            raise ScheduleNotFound(name)
        return ScheduleView.of(row)


def _list(tenants: Collection[str] | None) -> list[str] | None:
    return None if tenants is None else list(tenants)
