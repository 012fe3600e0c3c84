"""The operators' actions: cancel a job, requeue or discard a dead letter, decide an approval.
Each checks its arguments before it touches anything, and a status change the state machine
refuses is counted, by whom it was refused."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any
from uuid import UUID

import psycopg

from orchestrator.domain.applications import Application, Kind
from orchestrator.domain.errors import DeadLetterError, InvalidTransition
from orchestrator.facade.arguments import storable, uuid_of
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
