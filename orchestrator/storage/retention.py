"""What retention deletes (orc_jobs and everything of theirs; the bookkeeping rows that age
out), one bounded statement per batch. The rule of which finished jobs may go is the
``prune_finished_jobs`` query's ``candidates``; the policy of how long each is kept is
:class:`orchestrator.domain.retention.Retention`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, LiteralString
from uuid import UUID

from orchestrator.domain.retention import Retention
from orchestrator.domain.states import Status
from orchestrator.storage.database import Conn
from orchestrator.storage.runner import Queries

#: The rows that go with each job, by kind: the prune query's count columns.
JOB_KINDS = (
    "events", "checkpoints", "side_effects", "approvals", "dead_letters", "dispatches",
    "dispatch_events", "llm_usage", "output_chunks",
)  # fmt: skip
#: Bookkeeping that ages out: each query, and the kinds it deletes (its count columns).
BOOKKEEPING: dict[LiteralString, tuple[str, ...]] = {
    "prune_maintenance_dispatches": ("maintenance_dispatches",),
    "prune_expired": ("sessions", "event_listeners"),
    "prune_revoked_tokens": ("revoked_tokens",),
}
#: Every kind of bookkeeping, in that order.
BOOKKEEPING_KINDS = tuple(kind for kinds in BOOKKEEPING.values() for kind in kinds)


@dataclass(frozen=True)
class PrunedJob:
    """One job taken by a batch: what it was, the rows of each kind that went with it, and the
    whole of it as JSON when archiving."""

    id: UUID
    job_type: str
    status: Status
    rows: dict[str, int]
    archived: dict[str, Any] | None


class RetentionStore:
    def __init__(self, queries: Queries) -> None:
        self.queries = queries

    async def prune_jobs(
        self, retention: Retention, *, limit: int, archive: bool, dry_run: bool, conn: Conn
    ) -> list[PrunedJob]:
        """Delete (unless ``dry_run``) at most ``limit`` finished jobs past ``retention`` with
        all their rows, in one statement inside ``conn``'s transaction."""
        params = {**retention.params(), "limit": limit, "archive": archive, "dry_run": dry_run}
        rows = await self.queries.rows("prune_finished_jobs", params, conn)
        return [
            PrunedJob(
                id=r["id"], job_type=r["job_type"], status=Status(r["status"]),
                rows={kind: r[kind] for kind in JOB_KINDS}, archived=r["archived"],
            )
            for r in rows
        ]  # fmt: skip

    async def prune_bookkeeping(
        self, query: LiteralString, *, older_than: float, limit: int, dry_run: bool
    ) -> dict[str, int]:
        """Delete (unless ``dry_run``) at most ``limit`` rows of each kind ``query`` deletes
        that aged out; how many of each (would have) gone."""
        params = {"older_than": older_than, "limit": limit, "dry_run": dry_run}
        row = await self.queries.row(query, params)
        return {kind: int(row[kind]) if row else 0 for kind in BOOKKEEPING[query]}
