"""A job's live output (docs/output.md): an attempt's batches, written under its lease, and the
reads of what is stored. The markers are the database's to write (functions/output.sql)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from psycopg.types.json import Jsonb

from orchestrator.domain.errors import StaleLease
from orchestrator.domain.models import Fence
from orchestrator.domain.output import OutputChunk
from orchestrator.domain.states import Status
from orchestrator.storage.runner import Queries


@dataclass(frozen=True)
class Batch:
    """An attempt's batch of output: ``chunks`` ([{kind, step, body}], text or progress), its
    number ``number`` in the attempt (1, 2...: written again, it is not written twice), for a
    job whose output holds at most ``max_bytes`` of chunk bodies."""

    fence: Fence
    number: int
    chunks: list[dict[str, Any]]
    max_bytes: int


@dataclass(frozen=True)
class Followed:
    """A job's output read after an offset, and the status it had ended in when it was read
    (None: it had not)."""

    ended: Status | None
    chunks: list[OutputChunk]


@dataclass(frozen=True)
class Written:
    written: int  # the batch's chunks kept (those past the size cap are dropped)
    next_offset: int  # the offset the job's next chunk gets
    cut: bool  # the job's output reached its size cap: nothing more is kept


class OutputStore:
    def __init__(self, queries: Queries) -> None:
        self.queries = queries

    async def write(self, batch: Batch) -> Written:
        """Append ``batch`` to its job's output while its attempt holds its lease (StaleLease
        otherwise: nothing is written)."""
        [written] = await self.write_many([batch])
        if written is None:
            raise StaleLease(batch.fence.job_id, batch.fence.lease_token)
        return written

    async def write_many(self, batches: Sequence[Batch]) -> list[Written | None]:
        """Append each batch to its job's output, in one statement, each while its attempt
        holds its lease: what each wrote, in their order (None: a stale attempt's, which wrote
        nothing)."""
        items = [
            {"ord": i, "job_id": str(b.fence.job_id), "lease_token": str(b.fence.lease_token),
             "batch": b.number, "chunks": b.chunks, "max_bytes": b.max_bytes}
            for i, b in enumerate(batches)
        ]  # fmt: skip
        rows = await self.queries.rows("write_outputs", {"batches": Jsonb(items)})
        rows.sort(key=lambda r: r["ord"])
        return [
            None if r["written"] is None else Written(r["written"], r["next_offset"], r["cut"])
            for r in rows
        ]

    async def read(
        self, job_id: UUID, *, offset: int = 0, limit: int = 500, final: bool = False
    ) -> list[OutputChunk]:
        """The job's output from ``offset`` on, in order, up to ``limit`` chunks; ``final``:
        only what is final (no superseded chunk, no marker but the cut)."""
        name = "final_output_from" if final else "output_from"
        params = {"job_id": job_id, "from_offset": offset, "limit": limit}
        return [OutputChunk.model_validate(row) for row in await self.queries.rows(name, params)]

    async def follow(
        self, offsets: Mapping[UUID, int], *, limit: int = 500
    ) -> dict[UUID, Followed]:
        """For each job, from its offset in ``offsets``: whether it has ended (how), and up to
        ``limit`` of its chunks, read in one snapshot (an ended job's are all there). A job
        that no longer exists is left out."""
        params = {"job_ids": list(offsets), "offsets": list(offsets.values()), "limit": limit}
        followed: dict[UUID, Followed] = {}
        for row in await self.queries.rows("outputs_from", params):
            ended = Status(row["status"]) if row["finished"] else None
            job = followed.setdefault(row["job_id"], Followed(ended, []))
            if row["offset"] is not None:
                job.chunks.append(OutputChunk.model_validate(row))
        return followed
