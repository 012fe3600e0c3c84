"""All reads and writes of application jobs, through the named queries.

Each method is one state transition (or one read). Writes made for an attempt carry its
:class:`~orchestrator.models.Claim` and are fenced by its lease token; when a write matches no
row, :meth:`JobStore._refusal` says why (missing job, illegal transition, superseded lease).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, LiteralString
from uuid import UUID

from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from orchestrator import states
from orchestrator.database import Conn
from orchestrator.degradation import Degraded
from orchestrator.errors import DeadLetterError, InvalidTransition, JobNotFound, StaleLease
from orchestrator.group_commit import GroupCommit
from orchestrator.ids import uuid7
from orchestrator.models import Claim, DeadLetter, Job, JobEvent, SubmitResult
from orchestrator.policy import Layer
from orchestrator.queries import QUERIES
from orchestrator.states import Status

TASK_PREFIX = "orc."  # Procrastinate task name of a job type: TASK_PREFIX + job_type


class JobStore:
    def __init__(self, pool: AsyncConnectionPool) -> None:
        self.pool = pool
        self._completions = GroupCommit(self._complete_many)

    # -- named queries, for this module and the few that share its pool ---------------------

    async def one(
        self, name: LiteralString, params: dict[str, Any], conn: Conn | None = None
    ) -> dict[str, Any] | None:
        if conn is not None:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(QUERIES[name], params)
            return await cur.fetchone()
        async with self.pool.connection() as pooled:
            cur = pooled.cursor(row_factory=dict_row)
            await cur.execute(QUERIES[name], params)
            return await cur.fetchone()

    async def rows(
        self, name: LiteralString, params: dict[str, Any], conn: Conn | None = None
    ) -> list[dict[str, Any]]:
        """The rows ``name`` returns ([] for a statement that returns none), on ``conn`` if
        given, else on a pooled connection."""
        if conn is not None:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(QUERIES[name], params)
            return await cur.fetchall() if cur.description else []
        async with self.pool.connection() as pooled:
            return await self.rows(name, params, pooled)

    async def execute(
        self, name: LiteralString, params: dict[str, Any], conn: Conn | None = None
    ) -> None:
        if conn is not None:
            await conn.execute(QUERIES[name], params)
            return
        async with self.pool.connection() as pooled:
            await pooled.execute(QUERIES[name], params)

    async def refusal(self, job_id: UUID, target: Status, lease_token: UUID | None) -> Exception:
        """Why a fenced write matched nothing: no such job, an illegal transition, or a lease
        that is no longer this attempt's."""
        row = await self.one("job_state", {"job_id": job_id})
        if row is None:
            return JobNotFound(job_id)
        if not states.is_legal(Status(row["status"]), target):
            return InvalidTransition(job_id, row["status"], target.value)
        return StaleLease(job_id, lease_token)

    # -- submit ----------------------------------------------------------------------------

    async def submit(
        self, specs: Sequence[dict[str, Any]], *, connection: Conn | None = None
    ) -> list[SubmitResult]:
        params = {
            "specs": Jsonb([{**spec, "ord": i} for i, spec in enumerate(specs)]),
            "initial_status": Status.PENDING.value,
            "waiting": sorted(s.value for s in states.CLAIMABLE),
            "task_prefix": TASK_PREFIX,
        }
        rows = await self.rows("submit_jobs", params, connection)
        rows.sort(key=lambda r: r["ord"])
        return [SubmitResult(job_id=r["job_id"], outcome=r["outcome"]) for r in rows]

    # -- one attempt -----------------------------------------------------------------------

    async def claim(
        self, job_id: UUID, procrastinate_job_id: int, run: int, worker: str
    ) -> Claim | None:
        row = await self.one(
            "claim_job",
            {
                "job_id": job_id,
                "procrastinate_job_id": procrastinate_job_id,
                "run": run,
                "worker": worker,
                "running": Status.RUNNING.value,
                "sources": states.sources_of(Status.RUNNING),
            },
        )
        return Claim.model_validate(row) if row else None

    async def complete(
        self,
        claim: Claim,
        result: Any,
        event: dict[str, Any],
        *,
        procrastinate_job_id: int | None = None,
        delete_dispatch: bool = False,
    ) -> None:
        """COMPLETED; with ``procrastinate_job_id``, that dispatch is finished in the same
        transaction (it is finished even when the completion is refused). Completions that
        arrive together are written together (group_commit.py)."""
        item = {
            "job_id": str(claim.id),
            "lease_token": str(claim.lease_token),
            "result": result,
            "event": event,
            "procrastinate_job_id": procrastinate_job_id,
            "delete_dispatch": delete_dispatch,
        }
        if not await self._completions.submit(item):
            raise await self.refusal(claim.id, Status.COMPLETED, claim.lease_token)

    async def _complete_many(self, items: Sequence[dict[str, Any]]) -> list[bool]:
        params = {
            "items": Jsonb([{**item, "ord": i} for i, item in enumerate(items)]),
            "target": Status.COMPLETED.value,
            "sources": states.sources_of(Status.COMPLETED),
        }
        rows = await self.rows("complete_jobs", params)
        rows.sort(key=lambda r: r["ord"])
        return [r["completed"] for r in rows]

    async def fail(
        self,
        claim: Claim,
        error: dict[str, Any],
        event: dict[str, Any],
        degraded: Degraded | None = None,
    ) -> UUID:
        """FAILED (an attempt's outcome) with a dead letter; returns the dead letter's id."""
        async with self.pool.connection() as conn, conn.transaction():
            return await self.fail_job(claim.id, claim.lease_token, error, event, conn, degraded)

    async def fail_job(
        self,
        job_id: UUID,
        lease_token: UUID | None,
        error: dict[str, Any],
        event: dict[str, Any],
        conn: Conn,
        degraded: Degraded | None = None,
    ) -> UUID:
        """FAILED with a dead letter, and its degradation (its event, the human notification
        it submits), in ``conn``'s transaction. ``lease_token`` None fails a job no attempt
        holds (one waiting for an approval); returns the dead letter's id."""
        row = await self.one(
            "fail_job",
            {
                "job_id": job_id,
                "lease_token": lease_token,
                "target": Status.FAILED.value,
                "sources": states.sources_of(Status.FAILED),
                "error": Jsonb(error),
                "event": Jsonb(event),
                "degraded": Jsonb(degraded.event) if degraded else None,
                "dead_letter_id": uuid7(),
            },
            conn,
        )
        if row is None:
            raise await self.refusal(job_id, Status.FAILED, lease_token)
        if degraded and degraded.submit:
            await self.submit(degraded.submit, connection=conn)
        dead_letter_id: UUID = row["id"]
        return dead_letter_id

    async def schedule_retry(
        self,
        claim: Claim,
        *,
        layer: Layer,
        next_retry_at: datetime,
        error: dict[str, Any],
        failed_event: dict[str, Any],
        retry_event: dict[str, Any],
    ) -> None:
        params = {
            **_fence(claim, Status.RETRY),
            "retry_increment": 1 if layer is Layer.APP else 0,
            "next_retry_at": next_retry_at,
            "error": Jsonb(error),
            "failed_event": Jsonb(failed_event),
            "retry_event": Jsonb(retry_event),
        }
        async with self.pool.connection() as conn, conn.transaction():
            row = await self.one("schedule_retry", params, conn)
            if row is not None and layer is Layer.APP:
                await self.one("dispatch_jobs", dispatch_params([claim.id]), conn)
        if row is None:
            raise await self.refusal(claim.id, Status.RETRY, claim.lease_token)

    async def hand_back(self, claim: Claim, event: dict[str, Any]) -> None:
        """RUNNING -> PENDING without using budget, with a new dispatch (drain, interrupt)."""
        async with self.pool.connection() as conn, conn.transaction():
            row = await self.one(
                "hand_back_job", {**_fence(claim, Status.PENDING), "event": Jsonb(event)}, conn
            )
            if row is not None:
                await self.one("dispatch_jobs", dispatch_params([claim.id]), conn)
        if row is None:
            raise await self.refusal(claim.id, Status.PENDING, claim.lease_token)

    # -- operator actions ------------------------------------------------------------------

    async def cancel(self, job_id: UUID, event: dict[str, Any]) -> None:
        """CANCELLED; a waiting dispatch is cancelled, a running one aborted, and an open
        approval closed."""
        async with self.pool.connection() as conn, conn.transaction():
            row = await self.one(
                "cancel_job",
                {
                    "job_id": job_id,
                    "target": Status.CANCELLED.value,
                    "sources": states.sources_of(Status.CANCELLED),
                    "event": Jsonb(event),
                },
                conn,
            )
            if row is not None:
                await self.execute(
                    "cancel_job_approvals",
                    {"job_id": job_id, "by": event.get("by"), "reason": event.get("reason")},
                    conn,
                )
        if row is None:
            raise await self.refusal(job_id, Status.CANCELLED, None)

    async def redispatch_lost(
        self, *, grace_seconds: float, stalled_seconds: float, limit: int
    ) -> list[UUID]:
        """The retry safety net: re-dispatch waiting jobs whose dispatch was lost."""
        async with self.pool.connection() as conn, conn.transaction():
            lost = await self.rows(
                "lost_dispatches",
                {
                    "waiting": sorted(s.value for s in states.CLAIMABLE),
                    "grace_seconds": grace_seconds,
                    "stalled_seconds": stalled_seconds,
                    "limit": limit,
                },
                conn,
            )
            if not lost:
                return []
            await self.settle_dispatches(
                [r["procrastinate_job_id"] for r in lost if r["procrastinate_status"] == "doing"],
                conn,
            )
            ids = [row["id"] for row in lost]
            await self.one("dispatch_jobs", dispatch_params(ids), conn)
            await self.record_events(
                [
                    {
                        "job_id": str(row["id"]),
                        "kind": "job.redispatched",
                        "payload": {
                            "lost_procrastinate_job_id": row["procrastinate_job_id"],
                            "lost_procrastinate_status": row["procrastinate_status"],
                        },
                    }
                    for row in lost
                ],
                conn,
            )
            return ids

    async def settle_dispatches(self, procrastinate_job_ids: list[int], conn: Conn) -> None:
        """Finish (as failed) the Procrastinate jobs a dead worker left in ``doing``."""
        if procrastinate_job_ids:
            await self.execute(
                "settle_procrastinate_jobs", {"procrastinate_job_ids": procrastinate_job_ids}, conn
            )

    # -- liveness --------------------------------------------------------------------------

    async def heartbeat(
        self,
        leases: dict[UUID, UUID],
        *,
        zombie_threshold: float,
        expiry_grace: float,
        conn: Conn | None = None,
    ) -> set[UUID]:
        """Refresh the heartbeats of these attempts (lease token -> job id) in one statement;
        returns the lease tokens still held."""
        rows = await self.rows(
            "heartbeat",
            {
                "lease_tokens": list(leases),
                "job_ids": list(leases.values()),
                "threshold": zombie_threshold,
                "expiry_grace": expiry_grace,
                "running": Status.RUNNING.value,
            },
            conn,
        )
        return {row["lease_token"] for row in rows}

    async def zombies(self, conn: Conn, *, threshold: float, limit: int) -> list[dict[str, Any]]:
        return await self.rows(
            "zombies",
            {"running": Status.RUNNING.value, "threshold": threshold, "limit": limit},
            conn,
        )

    async def sweep(
        self,
        conn: Conn,
        *,
        retry: list[dict[str, Any]],
        fail: list[dict[str, Any]],
        submit: dict[str, list[dict[str, Any]]] | None = None,
    ) -> tuple[list[UUID], list[UUID]]:
        """Apply the sweep's decisions; returns the ids moved to RETRY and to FAILED. ``submit``
        (job id -> rows): the jobs a failed one's degradation submits, if it did fail."""
        retried: list[UUID] = []
        failed: list[UUID] = []
        if retry:
            rows = await self.rows(
                "sweep_to_retry",
                {
                    "decisions": Jsonb(retry),
                    "target": Status.RETRY.value,
                    "sources": states.sources_of(Status.RETRY),
                },
                conn,
            )
            retried = [row["id"] for row in rows]
            if retried:
                await self.one("dispatch_jobs", dispatch_params(retried), conn)
        if fail:
            rows = await self.rows(
                "sweep_to_failed",
                {
                    "decisions": Jsonb(fail),
                    "target": Status.FAILED.value,
                    "sources": states.sources_of(Status.FAILED),
                },
                conn,
            )
            failed = [row["id"] for row in rows]
            rows_to_submit = [r for job_id in failed for r in (submit or {}).get(str(job_id), [])]
            if rows_to_submit:
                await self.submit(rows_to_submit, connection=conn)
        return retried, failed

    async def record_events(self, events: list[dict[str, Any]], conn: Conn | None = None) -> None:
        await self.execute("record_events", {"events": Jsonb(events)}, conn)

    async def lock_dead_letter(self, dead_letter_id: UUID, conn: Conn) -> DeadLetter:
        row = await self.one("get_dead_letter", {"dead_letter_id": dead_letter_id}, conn)
        if row is None:
            raise DeadLetterError(f"no dead letter with id {dead_letter_id}")
        return DeadLetter.model_validate(row)

    async def mark_dead_letter_requeued(
        self, dead_letter_id: UUID, job_id: UUID, conn: Conn
    ) -> None:
        await self.execute(
            "mark_dead_letter_requeued", {"dead_letter_id": dead_letter_id, "job_id": job_id}, conn
        )

    async def request_dead_letter_discard(
        self, dead_letter_id: UUID, reviewer: str, reason: str
    ) -> None:
        params = {"dead_letter_id": dead_letter_id, "reviewer": reviewer, "reason": reason}
        if await self.one("request_dead_letter_discard", params) is None:
            raise await self._dead_letter_refusal(dead_letter_id, "request a discard of")

    async def confirm_dead_letter_discard(self, dead_letter_id: UUID, reviewer: str) -> None:
        params = {"dead_letter_id": dead_letter_id, "reviewer": reviewer}
        if await self.one("confirm_dead_letter_discard", params) is None:
            raise await self._dead_letter_refusal(
                dead_letter_id, "confirm the discard of", reviewer
            )

    async def _dead_letter_refusal(
        self, dead_letter_id: UUID, action: str, reviewer: str | None = None
    ) -> DeadLetterError:
        async with self.pool.connection() as conn:
            letter = await self.lock_dead_letter(dead_letter_id, conn)
        if reviewer is not None and letter.discard_requested_by == reviewer:
            return DeadLetterError(
                f"{reviewer} requested this discard; a second reviewer must confirm it"
            )
        return DeadLetterError(
            f"cannot {action} dead letter {dead_letter_id}: it is {letter.state}"
        )

    async def prune_checkpoints(self, *, older_than_seconds: float, limit: int) -> int:
        """Delete up to ``limit`` checkpoint rows and ``limit`` ledger rows of jobs finished
        more than ``older_than_seconds`` ago; returns the larger of the two counts."""
        params = {"older_than": older_than_seconds, "limit": limit}
        async with self.pool.connection() as conn:
            checkpoints = await conn.execute(QUERIES["prune_checkpoints"], params)
            effects = await conn.execute(QUERIES["prune_side_effects"], params)
        return max(checkpoints.rowcount, effects.rowcount)

    async def job_steps(self, job_id: UUID) -> list[dict[str, Any]]:
        return await self.rows("job_steps", {"job_id": job_id})

    async def approvals(self, *, status: str | None, limit: int) -> list[dict[str, Any]]:
        return await self.rows("list_approvals", {"status": status, "limit": limit})

    # -- reads -----------------------------------------------------------------------------

    async def get_job(self, job_id: UUID) -> Job:
        row = await self.one("get_job", {"job_id": job_id})
        if row is None:
            raise JobNotFound(job_id)
        return Job.model_validate(row)

    async def job_events(self, job_id: UUID) -> list[JobEvent]:
        rows = await self.rows("job_events", {"job_id": job_id})
        return [JobEvent.model_validate(row) for row in rows]

    async def list_jobs(
        self, *, status: Status | None = None, job_type: str | None = None, limit: int = 50
    ) -> list[Job]:
        rows = await self.rows(
            "list_jobs",
            {"status": status.value if status else None, "job_type": job_type, "limit": limit},
        )
        return [Job.model_validate(row) for row in rows]

    async def ping(self) -> bool:
        return await self.one("ping", {}) is not None

    async def soonest_due(self, *, lookback: float) -> tuple[float | None, bool]:
        """Seconds until the next waiting job is due (None: none is), and whether one came due
        within the last ``lookback`` seconds."""
        row = await self.one(
            "soonest_due",
            {"retry": Status.RETRY.value, "pending": Status.PENDING.value, "lookback": lookback},
        )
        assert row is not None
        seconds = None if row["seconds"] is None else float(row["seconds"])
        return seconds, bool(row["overdue"])

    async def dead_letters(self, *, state: str | None = None, limit: int = 50) -> list[DeadLetter]:
        rows = await self.rows("list_dead_letters", {"state": state, "limit": limit})
        return [DeadLetter.model_validate(row) for row in rows]


def _fence(claim: Claim, target: Status) -> dict[str, Any]:
    return {
        "job_id": claim.id,
        "lease_token": claim.lease_token,
        "target": target.value,
        "sources": states.sources_of(target),
    }


def dispatch_params(job_ids: list[UUID]) -> dict[str, Any]:
    return {"job_ids": job_ids, "task_prefix": TASK_PREFIX}
