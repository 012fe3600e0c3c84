"""Dead letters: one per terminal failure (written by ``JobStore.fail``), then reviewed.

recorded ──► requeued                 a new job with the dead one's payload and tenant
    │
    └──► discard_requested ──► discarded    two different reviewers, a reason required

Two reviewers are different when they are different persons, whatever their kind: the database
derives each reviewer's person (orc_principal_persons_v1, sql/functions/principals.sql) and
refuses the rest.
"""

from __future__ import annotations

from collections.abc import Collection
from uuid import UUID

from orchestrator.domain.errors import DeadLetterError, DeadLetterNotFound
from orchestrator.domain.models import DeadLetter
from orchestrator.storage.database import Conn
from orchestrator.storage.runner import Queries


class DeadLetterStore:
    def __init__(self, queries: Queries) -> None:
        self.queries = queries

    async def list_letters(
        self,
        *,
        states: Collection[str] | None = None,
        job_type: str | None = None,
        tenant_id: str | None = None,
        error: str | None = None,
        limit: int = 50,
        tenants: Collection[str] | None = None,
    ) -> list[DeadLetter]:
        """Newest first, in ``states`` (None: any), of the type and tenant given, whose error
        has ``error`` in its code, message or class (any case); ``tenants``: only letters of
        these tenants (None: any)."""
        params = {"states": list(states) if states is not None else None,
                  "job_type": job_type, "tenant_id": tenant_id, "error": error, "limit": limit,
                  "tenants": sorted(tenants) if tenants is not None else None}  # fmt: skip
        rows = await self.queries.rows("list_dead_letters", params)
        return [DeadLetter.model_validate(row) for row in rows]

    async def find(
        self, ids: Collection[UUID], *, tenants: Collection[str] | None = None
    ) -> dict[UUID, DeadLetter]:
        """Those of these letters that exist, of ``tenants`` only (None: any), by id."""
        params = {"ids": list(ids), "tenants": sorted(tenants) if tenants is not None else None}
        rows = await self.queries.rows("find_dead_letters", params)
        return {letter.id: letter for letter in map(DeadLetter.model_validate, rows)}

    async def get(self, dead_letter_id: UUID) -> DeadLetter:
        row = await self.queries.row("find_dead_letter", {"dead_letter_id": dead_letter_id})
        if row is None:
            raise DeadLetterNotFound(dead_letter_id)
        return DeadLetter.model_validate(row)

    async def of_job(self, job_id: UUID) -> DeadLetter | None:
        """The job's latest dead letter, if it has one."""
        row = await self.queries.row("dead_letter_of_job", {"job_id": job_id})
        return DeadLetter.model_validate(row) if row is not None else None

    async def lock(self, dead_letter_id: UUID, conn: Conn) -> DeadLetter:
        """The dead letter, locked in ``conn``'s transaction until it commits."""
        row = await self.queries.row("get_dead_letter", {"dead_letter_id": dead_letter_id}, conn)
        if row is None:
            raise DeadLetterNotFound(dead_letter_id)
        return DeadLetter.model_validate(row)

    async def mark_requeued(self, dead_letter_id: UUID, job_id: UUID, conn: Conn) -> None:
        await self.queries.execute(
            "mark_dead_letter_requeued", {"dead_letter_id": dead_letter_id, "job_id": job_id}, conn
        )

    async def request_discard(self, dead_letter_id: UUID, reviewer: str, reason: str) -> None:
        params = {"dead_letter_id": dead_letter_id, "reviewer": reviewer, "reason": reason}
        if await self.queries.row("request_dead_letter_discard", params) is None:
            raise await self._refusal(dead_letter_id, "request a discard of")

    async def confirm_discard(self, dead_letter_id: UUID, reviewer: str) -> None:
        params = {"dead_letter_id": dead_letter_id, "reviewer": reviewer}
        if await self.queries.row("confirm_dead_letter_discard", params) is None:
            raise await self._refusal(dead_letter_id, "confirm the discard of", reviewer)

    async def _refusal(
        self, dead_letter_id: UUID, action: str, reviewer: str | None = None
    ) -> DeadLetterError:
        async with self.queries.transaction() as conn:
            letter = await self.lock(dead_letter_id, conn)
        requester = letter.discard_requested_by or ""
        if reviewer is not None and requester and await self.same_person(requester, reviewer):
            same = "" if requester == reviewer else f", and {reviewer} is the same person"
            return DeadLetterError(
                f"{requester} requested this discard{same}; a second reviewer must confirm it"
            )
        return DeadLetterError(
            f"cannot {action} dead letter {dead_letter_id}: it is {letter.state}"
        )

    async def same_person(self, first: str, second: str) -> bool:
        """Whether two recorded actors are one person (the two-person rule, in the database)."""
        row = await self.queries.row("same_person", {"first": first, "second": second})
        return row is not None and row["same"] is True
