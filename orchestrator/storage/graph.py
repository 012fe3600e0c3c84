"""The graphs jobs make (docs/workflows.md): what a job depends on, as its task and the API
read it. The edges are written by the submit's statement and settled by the database as jobs
end (functions/dependencies.sql); this store only reads them."""

from __future__ import annotations

from uuid import UUID

from orchestrator.domain.models import Parent
from orchestrator.storage.database import Conn
from orchestrator.storage.runner import Queries


class GraphStore:
    def __init__(self, queries: Queries) -> None:
        self.queries = queries

    async def parents(self, job_id: UUID, conn: Conn | None = None) -> list[Parent]:
        """The job's parents, in the order its submit named them."""
        rows = await self.queries.rows("job_parents", {"job_id": job_id}, conn)
        return [Parent.model_validate(row) for row in rows]
