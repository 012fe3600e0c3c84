"""Who waits for job events (orc_event_listeners): an API server lists itself while a client
long-polls for an outcome or streams events, so that workers' event writes notify it
(migration 0019) only while somebody waits."""

from __future__ import annotations

from collections.abc import Collection
from uuid import UUID

from orchestrator.storage.runner import Queries


class ListenerStore:
    def __init__(self, queries: Queries) -> None:
        self.queries = queries

    async def listen(self, listener: str, *, seconds: float) -> None:
        """List ``listener`` for ``seconds`` from now (renewed by calling again)."""
        await self.queries.execute("listen_for_events", {"listener": listener, "seconds": seconds})

    async def stop(self, listener: str) -> None:
        """Unlist ``listener`` (and any whose claim has lapsed: a server that died)."""
        await self.queries.execute("stop_listening_for_events", {"listener": listener})

    async def latest(self, job_ids: Collection[UUID]) -> dict[UUID, int]:
        """The newest event id of each of these jobs that has events."""
        rows = await self.queries.rows("latest_event_ids", {"job_ids": list(job_ids)})
        return {row["job_id"]: row["last_event_id"] for row in rows}
