"""The operators' actions: cancel a job, requeue or discard a dead letter, decide an approval.
Each checks its arguments before it touches anything, and a status change the state machine
refuses is counted, by whom it was refused."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Iterator, Sequence
from dataclasses import astuple
from typing import Any
from uuid import UUID

import psycopg

from orchestrator.domain.applications import Application, Kind
from orchestrator.domain.dead_letters import (
    BECOMES,
    BULK_MAX,
    TAKES,
    Action,
    BulkReview,
    LetterFilter,
    LetterOutcome,
)
from orchestrator.domain.errors import (
    DeadLetterError,
    DeadLetterNotFound,
    InvalidArgument,
    InvalidTransition,
)
from orchestrator.facade.arguments import storable, tenants_named, uuid_of
from orchestrator.facade.lifecycle import Lifecycle
from orchestrator.facade.submit import JobRows, JobSpec
from orchestrator.runtime.metrics import Metrics
from orchestrator.storage.approvals import DecisionKind

logger = logging.getLogger("orchestrator")


def refused_by_database(metrics: Metrics, exc: InvalidTransition) -> None:
    logger.error("%s", exc)
    metrics.transition_refused(exc.source, exc.target, "database")


class OperatorActions:
    def __init__(self, lifecycle: Lifecycle, rows: JobRows, metrics: Metrics) -> None:
        self._lifecycle = lifecycle
        self._rows = rows
        self._metrics = metrics

    async def forget_application(self, application: Application) -> list[str]:
        """Withdraw all an application gone for good declares (docs/applications.md): the
        shared rows no other application declares go; the ``kind name`` of each."""
        stores = self._lifecycle.stores
        declared = await stores.applications.forget(application)
        await stores.flow.relimited(declared.gone(Kind.LIMIT))
        return [f"{kind.value} {name}" for kind, names in declared.withdrawn.items()
                for name in names]  # fmt: skip

    async def cancel(self, job_id: UUID | str, *, reason: str, by: str) -> None:
        storable(reason=reason, by=by)
        with self._counting_refusals():
            await self._lifecycle.stores.jobs.cancel(uuid_of(job_id), reason=reason, by=by)

    async def requeue_dead_letter(self, dead_letter_id: UUID | str) -> UUID:
        letter_id = uuid_of(dead_letter_id, "dead letter")
        stores = self._lifecycle.stores

        async def requeue(conn: psycopg.AsyncConnection[Any]) -> UUID:
            letter = await stores.dead_letters.lock(letter_id, conn)
            if letter.state not in ("recorded", "discard_requested"):
                raise DeadLetterError(f"dead letter {letter_id} is already {letter.state}")
            spec = self._rows.row(
                JobSpec(
                    job_type=letter.job_type, payload=letter.payload, tenant_id=letter.tenant_id
                )
            )
            (result,) = await stores.jobs.submit([{**spec, "replay_of": str(letter_id)}], conn)
            await stores.dead_letters.mark_requeued(letter_id, result.job_id, conn)
            return result.job_id

        return await stores.queries.in_transaction(requeue)

    async def request_discard(self, dead_letter_id: UUID | str, *, by: str, reason: str) -> None:
        storable(by=by, reason=reason)
        if not reason.strip():
            raise DeadLetterError("a discard needs a reason")
        await self._lifecycle.stores.dead_letters.request_discard(
            uuid_of(dead_letter_id, "dead letter"), by, reason
        )

    async def confirm_discard(self, dead_letter_id: UUID | str, *, by: str) -> None:
        storable(by=by)
        await self._lifecycle.stores.dead_letters.confirm_discard(
            uuid_of(dead_letter_id, "dead letter"), by
        )

    async def review_dead_letters(
        self,
        action: Action,
        ids: Sequence[UUID | str] | None,
        *,
        matching: LetterFilter,
        by: str,
        reason: str,
        tenants: Collection[str] | None,
    ) -> BulkReview:
        """``action`` on each letter given by id, or (no ids) on each letter the action can
        take that ``matching`` takes, at most BULK_MAX, newest first: each in its own
        transaction, as one letter's action would be (the two-person rule too, per letter).
        ``tenants``: only letters of these tenants are taken; an id of another's is
        ``not_found``, as one that does not exist."""
        job_type, tenant_id, error = astuple(matching)
        storable(job_type=job_type, tenant_id=tenant_id, error=error, by=by, reason=reason,
                 tenants=tenants)  # fmt: skip
        tenants_named(tenant_id=tenant_id, tenants=tenants)
        if ids is not None and matching != LetterFilter():
            raise InvalidArgument("ids: give the letters' ids or filters, not both")
        if action == "discard-request" and not reason.strip():
            raise InvalidArgument("reason: a discard needs a reason")
        store = self._lifecycle.stores.dead_letters
        if ids is None:
            letters = await store.list_letters(
                states=TAKES[action], job_type=job_type, tenant_id=tenant_id,
                error=error or None, limit=BULK_MAX + 1, tenants=tenants,
            )  # fmt: skip
            chosen, more = [letter.id for letter in letters[:BULK_MAX]], len(letters) > BULK_MAX
        else:
            if len(ids) > BULK_MAX:
                raise InvalidArgument(f"ids: at most {BULK_MAX} letters a call, got {len(ids)}")
            chosen = list(dict.fromkeys(uuid_of(i, "dead letter") for i in ids))
            more = False
        seen = await store.find(chosen, tenants=tenants)
        outcomes = []
        for letter_id in chosen:
            if letter_id in seen:
                outcomes.append(await self._review(action, letter_id, by=by, reason=reason))
            else:
                missing = str(DeadLetterNotFound(letter_id))
                outcomes.append(
                    LetterOutcome(dead_letter_id=letter_id, outcome="not_found", detail=missing)
                )
        return BulkReview(outcomes=outcomes, more=more)

    async def _review(self, action: Action, letter_id: UUID, *, by: str, reason: str
                      ) -> LetterOutcome:  # fmt: skip
        job_id = None
        try:
            match action:
                case "requeue":
                    job_id = await self.requeue_dead_letter(letter_id)
                case "discard-request":
                    await self.request_discard(letter_id, by=by, reason=reason)
                case "discard-confirm":
                    await self.confirm_discard(letter_id, by=by)
        except DeadLetterError as exc:
            return LetterOutcome(dead_letter_id=letter_id, outcome="refused", detail=str(exc))
        return LetterOutcome(dead_letter_id=letter_id, outcome=BECOMES[action], job_id=job_id)

    async def decide(
        self, approval_id: UUID | str, decision: DecisionKind, *, by: str, reason: str
    ) -> None:
        approval = uuid_of(approval_id, "approval")
        storable(by=by, reason=reason)
        with self._counting_refusals():
            await self._lifecycle.opened.decisions.decide(approval, decision, by=by, reason=reason)

    @contextlib.contextmanager
    def _counting_refusals(self) -> Iterator[None]:
        """An operator's action the state machine refuses is counted (the database's own
        refusals are counted where they are raised: refused_by_database)."""
        try:
            yield
        except InvalidTransition as exc:
            if not exc.by_database:
                self._metrics.transition_refused(exc.source, exc.target, "request")
            raise
