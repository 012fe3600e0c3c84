"""Deciding approval gates: approve, reject, and expiry (the ``expire_approvals`` service).

A step that asks for approval leaves its job WAITING_APPROVAL (checkpoints.gate). A decision,
in one transaction with the approval and its job locked:

    approved                         -> PENDING + a new dispatch (no budget used), job.approved
    rejected, on_reject="resume"     -> the same, job.rejected: the step sees the rejection
    rejected, on_reject="fail"       -> a terminal failure (orchestrator.domain.failures),
                                        job.rejected first; no escalation (who rejected it knows)
    expired (by ApprovalExpiry)      -> as rejected, with job.approval_expired, and escalated
                                        (degradation): nobody decided

Every decision records who decided and why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from uuid import UUID

from orchestrator.domain import events
from orchestrator.domain.classification import ErrorClass
from orchestrator.domain.errors import ApprovalError, ApprovalNotFound, InvalidTransition
from orchestrator.domain.events import Fault
from orchestrator.domain.failures import Failures
from orchestrator.domain.states import Status
from orchestrator.services.batches import PassedOver, in_batches, passed_over_words
from orchestrator.storage.approvals import DecisionKind
from orchestrator.storage.database import Conn
from orchestrator.storage.isolation import each_alone
from orchestrator.storage.stores import Stores

EVENT = {"approved": "job.approved", "rejected": "job.rejected", "expired": "job.approval_expired"}
EXPIRED_BY = "expire_approvals"


class ApprovalDecisions:
    def __init__(self, *, stores: Stores, failures: Failures) -> None:
        self.stores = stores
        self.failures = failures

    async def decide(
        self, approval_id: UUID, decision: DecisionKind, *, by: str, reason: str
    ) -> None:
        if not by.strip():
            raise ApprovalError("a decision needs the name of who decides")

        async def decide(conn: Conn) -> None:
            await self.decide_in(conn, approval_id, decision, by=by, reason=reason)

        await self.stores.queries.in_transaction(decide)

    async def decide_in(
        self, conn: Conn, approval_id: UUID, decision: DecisionKind, *, by: str, reason: str
    ) -> None:
        """Decide inside ``conn``'s transaction."""
        approvals = self.stores.approvals
        approval = await approvals.lock(approval_id, conn)
        if approval is None:
            raise ApprovalNotFound(approval_id)
        if approval.status != "pending":
            raise ApprovalError(f"approval {approval_id} is already {approval.status}")
        resumes = decision == "approved" or approval.on_reject == "resume"
        target = Status.PENDING if resumes else Status.FAILED
        job = approval.job
        if approval.job_status is not Status.WAITING_APPROVAL:
            raise InvalidTransition(job.id, approval.job_status.value, target.value)
        await approvals.decide(approval_id, decision, by=by, reason=reason, conn=conn)
        event = events.approval_decided(
            approval_id, step=approval.step, by=by, reason=reason, on_reject=approval.on_reject
        )
        if resumes:
            await approvals.resume(job.id, EVENT[decision], event, conn)
            return
        message = (
            f"approval {decision} by {by}: {reason}"
            if decision == "rejected"
            else f"approval expired: {reason}"
        )
        code = "APPROVAL_EXPIRED" if decision == "expired" else "APPROVAL_REJECTED"
        failure = self.failures.terminal(
            job,
            Fault(message, code, ErrorClass.PERMANENT),
            before=((EVENT[decision], event),),
            degrade=decision == "expired",  # a rejection is a person's own decision
        )
        await self.stores.jobs.fail([failure], conn)


@dataclass(frozen=True)
class ExpiryResult:
    expired: int
    passed_over: int = 0

    @property
    def handled(self) -> int:
        return self.expired + self.passed_over

    def sentence(self) -> str:
        return f"approvals expired: {self.expired}{passed_over_words(self.passed_over)}"


class ApprovalExpiry:
    """Approvals past their expiry are decided as expired, a batch per transaction. One whose
    decision the database refuses even alone is passed over
    (orchestrator.services.batches.PassedOver); the rest of its batch is decided."""

    name = "expire_approvals"

    def __init__(self, *, stores: Stores, decisions: ApprovalDecisions, batch_size: int) -> None:
        self.stores = stores
        self.decisions = decisions
        self.batch_size = batch_size

    async def run_once(self) -> ExpiryResult:
        passed_over = PassedOver(self.name, self.stores.jobs)

        async def batch(limit: int) -> int:
            return await self.expire_batch(limit, passed_over)

        handled = await in_batches(batch, size=self.batch_size)
        return ExpiryResult(handled - len(passed_over.keys), len(passed_over.keys))

    async def expire_batch(self, limit: int, passed_over: PassedOver) -> int:
        """One transaction; how many approvals it looked at."""
        async with self.stores.queries.transaction() as conn:
            due = await self.stores.approvals.expired(limit, conn, passed_over.keys)

            async def expire(some: Sequence[tuple[UUID, UUID]]) -> list[UUID]:
                for approval_id, _ in some:
                    await self.decisions.decide_in(
                        conn, approval_id, "expired", by=EXPIRED_BY,
                        reason="no decision before the approval expired",
                    )  # fmt: skip
                return [approval_id for approval_id, _ in some]

            _, refused = await each_alone(conn, due, expire)
            await passed_over.record(conn, [(r.item[0], r.item[1], r.error) for r in refused])
        return len(due)
