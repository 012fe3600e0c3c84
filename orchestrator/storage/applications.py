"""Several applications on one database (migration 0056; docs/applications.md): each
application's declarations of the shared tables, made in the same transaction as the rows they
stand for, and what the operator reads of the applications.

A store that writes shared rows (flow limits, schedules, and ``migrate``'s job types) declares
first and writes after, with the names withdrawn: :func:`declare` on the transaction's
connection, or :meth:`ApplicationStore.in_declaration` for a whole transaction.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from typing import TYPE_CHECKING, Any, TypeVar

from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from orchestrator.domain.applications import (
    GRAPHILE_SCHEMA,
    Application,
    ApplicationConflictView,
    ApplicationLimit,
    ApplicationProcess,
    ApplicationView,
    Declaration,
    Declared,
    Kind,
    UnservedJobs,
)
from orchestrator.domain.errors import ApplicationLive
from orchestrator.domain.principals import tenant_entries
from orchestrator.settings import Settings
from orchestrator.storage.queries import QUERIES

if TYPE_CHECKING:  # both import migrate, which declares through this module
    from orchestrator.storage.database import Conn
    from orchestrator.storage.runner import Queries

T = TypeVar("T")


def application_of(settings: Settings) -> Application:
    """The application a process of these settings belongs to."""
    return Application(settings.application, settings.stalled_worker_seconds)


async def declare(conn: Conn, declaration: Declaration) -> Declared:
    """``declaration`` made on ``conn`` (inside the caller's transaction); when refused, the
    refusal was recorded on ``conn`` and nothing declared."""
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(
        QUERIES["declare"],
        {
            "application": declaration.application.name,
            "kinds": [kind.value for kind in declaration.kinds],
            "definitions": Jsonb({kind.value: dict(d) for kind, d in declaration.kinds.items()}),
            "whole": declaration.whole,
            "version": declaration.declares,
            "live_seconds": declaration.application.live_seconds,
        },
    )
    withdrawn: dict[Kind, list[str]] = {}
    deferred = []
    conflicts = []
    for row in await cur.fetchall():
        if row["other"] is not None:
            conflicts.append((row["kind"], row["name"], row["other"], row["difference"]))
        elif row["deferred"]:
            deferred.append(f"{row['kind']} {row['name']}")
        else:
            withdrawn.setdefault(Kind(row["kind"]), []).append(row["name"])
    return Declared(declaration.application.name, withdrawn, deferred, conflicts)


class ApplicationStore:
    def __init__(self, queries: Queries) -> None:
        self.queries = queries

    async def in_declaration(
        self, declaration: Declaration, write: Callable[[Conn, Declared], Awaitable[T]]
    ) -> tuple[Declared, T]:
        """Declare, then ``write(conn, declared)`` the shared rows, in one transaction; refused
        (ApplicationConflict, the refusal committed for the operator), nothing is written."""

        async def work(conn: Conn) -> tuple[Declared, T | None]:
            declared = await declare(conn, declaration)
            if declared.conflicts:
                return declared, None
            return declared, await write(conn, declared)

        declared, written = await self.queries.in_transaction(work)
        declared.check()
        return declared, written  # type: ignore[return-value]  # None only with a conflict

    async def views(
        self, *, seconds: float, tenants: Collection[str] | None = None
    ) -> list[ApplicationView]:
        """Every application that declares something or has a live process (a process silent
        ``seconds`` is not live); its schedules only those of ``tenants`` (None: all)."""
        definitions = await self.queries.rows("application_definitions")
        processes = await self.queries.rows("application_processes", {"seconds": seconds})
        conflicts = await self.queries.rows("application_conflicts")
        names = sorted(
            {r["application"] for r in definitions} | {r["application"] for r in processes}
        )
        views = []
        for name in names:
            own = [r for r in definitions if r["application"] == name]
            of = {kind: [r for r in own if r["kind"] == kind] for kind in Kind}
            running = [ApplicationProcess.model_validate(r) for r in processes
                       if r["application"] == name]  # fmt: skip
            views.append(
                ApplicationView(
                    name=name,
                    live=bool(running),
                    processes=running,
                    config_versions=sorted({p.config_version for p in running}),
                    job_types=[r["name"] for r in of[Kind.JOB_TYPE]],
                    limits=[_limit(r, tenants) for r in of[Kind.LIMIT]],
                    limited_types={
                        r["name"]: r["definition"]["limit"] for r in of[Kind.LIMIT_OF_TYPE]
                    },
                    schedules=[
                        r["name"]
                        for r in of[Kind.SCHEDULE]
                        if tenants is None or r["definition"].get("tenant_id") in tenants
                    ],
                    conflicts=[
                        ApplicationConflictView.model_validate(r)
                        for r in conflicts
                        if r["application"] == name
                    ],
                )
            )
        return views

    async def foreign_queues(self, application: Application) -> set[str]:
        """The queues of the job types other applications declare."""
        rows = await self.queries.rows("foreign_queues", {"application": application.name})
        return {row["queue"] for row in rows}

    async def forget(self, application: Application) -> Declared:
        """Withdraw everything ``application`` declares, with the shared rows no other
        application declares (its limits, its types' limits, its job types, its schedules,
        Graphile Worker's API), and its refusals: an application gone for good. Refused
        (ApplicationLive) while a process of it lives; nothing declared: nothing to forget."""
        live = [p for p in await self.queries.rows(
            "application_processes", {"seconds": application.live_seconds}
        ) if p["application"] == application.name]  # fmt: skip
        if live:
            raise ApplicationLive(
                f"application {application.name!r} has {len(live)} live process(es) "
                f"({', '.join(p['worker'] for p in live)}): stop them first, or they declare "
                "it again"
            )
        everything = Declaration(application, {kind: {} for kind in Kind})

        async def write(conn: Conn, declared: Declared) -> None:
            await self.queries.rows("sync_flow_limits", {
                "limits": Jsonb([]), "types": Jsonb([]),
                "gone_limits": declared.gone(Kind.LIMIT),
                "gone_types": declared.gone(Kind.LIMIT_OF_TYPE),
            }, conn)  # fmt: skip
            await self.queries.execute(
                "sync_schedules", {"schedules": Jsonb([]), "gone": declared.gone(Kind.SCHEDULE)},
                conn,
            )  # fmt: skip
            await self.queries.execute(
                "sync_job_types", {"types": Jsonb([]), "gone": declared.gone(Kind.JOB_TYPE)}, conn
            )
            if declared.gone(Kind.GRAPHILE):
                await self.queries.execute("graphile_drop", None, conn)
                await self.queries.execute("graphile_forget", {"component": GRAPHILE_SCHEMA}, conn)
            await self.queries.execute(
                "forget_application_conflicts", {"application": application.name}, conn
            )

        declared, _ = await self.in_declaration(everything, write)
        return declared

    async def unserved(
        self, *, seconds: float, tenants: Collection[str] | None = None
    ) -> list[UnservedJobs]:
        """Waiting jobs of the types no application with a live process declares, by type."""
        params = {"seconds": seconds, "tenants": sorted(tenants) if tenants is not None else None}
        return [
            UnservedJobs.model_validate(row)
            for row in await self.queries.rows("unserved_jobs", params)
        ]


def _limit(row: dict[str, Any], tenants: Collection[str] | None) -> ApplicationLimit:
    definition = row["definition"]
    weights = tenant_entries(definition.get("weights") or {}, tenants)
    return ApplicationLimit(name=row["name"], definition=definition | {"weights": weights})
