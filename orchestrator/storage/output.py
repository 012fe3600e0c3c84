"""A job's live output (docs/output.md): an attempt's batches, written under its lease, and the
reads of what is stored. The markers are the database's to write (functions/output.sql)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

from psycopg.types.json import Jsonb

from orchestrator.domain.errors import StaleLease
from orchestrator.domain.models import Fence
from orchestrator.domain.output import OutputChunk
from orchestrator.storage.runner import Queries


@dataclass(frozen=True)
class Written:
    written: int  # the batch's chunks kept (those past the size cap are dropped)
    next_offset: int  # the offset the job's next chunk gets
    cut: bool  # the job's output reached its size cap: nothing more is kept


class OutputStore:
    def __init__(self, queries: Queries) -> None:
        self.queries = queries

    async def write(
        self, fence: Fence, batch: int, chunks: list[dict[str, Any]], *, max_bytes: int
    ) -> Written:
        """Append ``chunks`` ([{kind, step, body}], text or progress), the attempt's batch
        number ``batch`` (1, 2...: written again, it is not written twice), to the job's
        output, in one statement, while the attempt holds its lease (StaleLease otherwise:
        nothing is written); the job's output holds at most ``max_bytes`` of chunk bodies."""
        params = {"job_id": fence.job_id, "lease_token": fence.lease_token, "batch": batch,
                  "chunks": Jsonb(chunks), "max_bytes": max_bytes}  # fmt: skip
        row = await self.queries.row("write_output", params)
        if row is None:
            raise StaleLease(fence.job_id, fence.lease_token)
        return Written(row["written"], row["next_offset"], row["cut"])

    async def read(
        self, job_id: UUID, *, offset: int = 0, limit: int = 500, final: bool = False
    ) -> list[OutputChunk]:
        """The job's output from ``offset`` on, in order, up to ``limit`` chunks; ``final``:
        only what is final (no superseded chunk, no marker but the cut)."""
        name = "final_output_from" if final else "output_from"
        params = {"job_id": job_id, "from_offset": offset, "limit": limit}
        return [OutputChunk.model_validate(row) for row in await self.queries.rows(name, params)]
