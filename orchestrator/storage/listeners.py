"""Who waits for job events (orc_event_listeners): an API server lists itself while a client
long-polls for an outcome, streams events or streams a job's output, so that workers' event and
output writes notify it (migration 0019; functions/output.sql) only while somebody waits."""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple
from uuid import UUID

from orchestrator.storage.runner import Queries


class Mark(NamedTuple):
    """How far a job has got: its newest event id, and the offset its next output chunk gets."""

    events: int
    output: int


class ListenerStore:
    def __init__(self, queries: Queries) -> None:
        self.queries = queries

    async def listen(self, listener: str, *, seconds: float) -> None:
        """List ``listener`` for ``seconds`` from now (renewed by calling again)."""
        await self.queries.execute("listen_for_events", {"listener": listener, "seconds": seconds})

    async def stop(self, listener: str) -> None:
        """Unlist ``listener`` (and any whose claim has lapsed: a server that died)."""
        await self.queries.execute("stop_listening_for_events", {"listener": listener})

    async def latest(self, job_ids: Collection[UUID]) -> dict[UUID, Mark]:
        """How far each of these jobs that exists has got (0: no event, no output)."""
        rows = await self.queries.rows("latest_marks", {"job_ids": list(job_ids)})
        return {row["job_id"]: Mark(row["last_event_id"], row["next_output"]) for row in rows}
