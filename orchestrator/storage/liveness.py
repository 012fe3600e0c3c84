"""Liveness: heartbeats, zombies, lost dispatches, and when the next waiting job is due."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from psycopg.types.json import Jsonb
from pydantic import BaseModel, ConfigDict

from orchestrator.domain import events, states
from orchestrator.domain.models import JobState
from orchestrator.domain.states import Status
from orchestrator.storage.database import Conn
from orchestrator.storage.jobs import JobStore
from orchestrator.storage.runner import Queries


class Zombie(JobState):
    """A RUNNING job whose heartbeat is older than the threshold (locked by the sweep)."""

    lease_token: UUID
    heartbeat_at: datetime
    deadline_at: datetime | None
    procrastinate_job_id: int | None
    swept_at: datetime  # the database's now in the sweep's transaction: its decisions' clock


@dataclass(frozen=True)
class ZombieRetry:
    """A zombie with budget left: RETRY ``delay_ms`` after the database's now, with these
    events (the statement adds that time to them)."""

    zombie: Zombie
    delay_ms: float
    last_error: dict[str, Any]
    detected: dict[str, Any]  # job.zombie_detected
    retry: dict[str, Any]  # job.retry_scheduled


class LostDispatch(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: UUID
    procrastinate_job_id: int | None
    procrastinate_status: str | None


@dataclass(frozen=True)
class Due:
    seconds: float | None  # until the next waiting job is due; None: none is
    overdue: bool  # whether one came due within the lookback
    now: float  # the database's clock as it answered (seconds since the epoch)


class LivenessStore:
    def __init__(self, queries: Queries, jobs: JobStore) -> None:
        self.queries = queries
        self.jobs = jobs

    async def heartbeat(
        self,
        leases: Mapping[UUID, UUID],
        *,
        zombie_threshold: float,
        expiry_grace: float,
        conn: Conn | None = None,
    ) -> set[UUID]:
        """Refresh the heartbeats of these attempts (lease token -> job id) in one statement;
        returns the lease tokens still held."""
        beats = sorted(leases.items(), key=lambda lease: lease[1])  # job-id order, as completions
        rows = await self.queries.rows(
            "heartbeat",
            {
                "lease_tokens": [token for token, _ in beats],
                "job_ids": [job_id for _, job_id in beats],
                "threshold": zombie_threshold,
                "expiry_grace": expiry_grace,
                "running": Status.RUNNING.value,
            },
            conn,
        )
        return {row["lease_token"] for row in rows}

    async def zombies(
        self, *, threshold: float, limit: int, passed_over: Sequence[UUID] = (), conn: Conn
    ) -> list[Zombie]:
        """Up to ``limit`` zombies but the jobs ``passed_over``, oldest heartbeat first, locked
        (SKIP LOCKED: sweepers running at once never share one), and then the flow keys their
        release pumps, all at once in one order (docs/flow-control.md, "Key locks in one
        order"): the writes that follow take no other."""
        rows = await self.queries.rows(
            "zombies",
            {
                "threshold": threshold,
                "limit": limit,
                "passed_over": list(passed_over),
            },
            conn,
        )
        zombies = [Zombie.model_validate(row) for row in rows]
        if len(zombies) > 1:
            await self.queries.execute(
                "lock_flow_keys_of", {"job_ids": [z.id for z in zombies]}, conn
            )
        return zombies

    async def retry_zombies(self, retries: Sequence[ZombieRetry], conn: Conn) -> list[UUID]:
        """RETRY (retry_count + 1, lease superseded) and a new dispatch for each; returns the
        ids moved."""
        if not retries:
            return []
        decisions = [
            {
                "id": str(r.zombie.id),
                "lease_token": str(r.zombie.lease_token),
                "delay_seconds": r.delay_ms / 1000,
                "error": r.last_error,
                "zombie": r.detected,
                "retry": r.retry,
            }
            for r in retries
        ]
        rows = await self.queries.rows(
            "sweep_to_retry",
            {
                "decisions": Jsonb(decisions),
                "target": Status.RETRY.value,
                "sources": states.sources_of(Status.RETRY),
            },
            conn,
        )
        moved = [row["id"] for row in rows]
        if moved:
            await self.jobs.dispatch(moved, conn)
        return moved

    async def settle(self, dispatch_ids: Sequence[int], conn: Conn) -> None:
        """Finish (as failed) the dispatches a dead worker left ``doing``."""
        if dispatch_ids:
            await self.queries.execute(
                "settle_procrastinate_jobs", {"procrastinate_job_ids": list(dispatch_ids)}, conn
            )

    async def lost_dispatches(
        self,
        *,
        grace_seconds: float,
        stalled_seconds: float,
        limit: int,
        passed_over: Sequence[UUID] = (),
        conn: Conn,
    ) -> list[LostDispatch]:
        """The retry safety net's batch, locked (SKIP LOCKED): up to ``limit`` waiting jobs
        past due by ``grace_seconds`` whose dispatch is gone, finished, or held by a worker
        silent for ``stalled_seconds``, but the jobs ``passed_over``."""
        rows = await self.queries.rows(
            "lost_dispatches",
            {
                "grace_seconds": grace_seconds,
                "stalled_seconds": stalled_seconds,
                "limit": limit,
                "passed_over": list(passed_over),
            },
            conn,
        )
        return [LostDispatch.model_validate(row) for row in rows]

    async def redispatch(self, lost: Sequence[LostDispatch], conn: Conn) -> list[UUID]:
        """Settle each one's dispatch held by a dead worker, and give the job a new one
        (``job.redispatched``); returns the jobs."""
        await self.settle(
            [
                d.procrastinate_job_id
                for d in lost
                if d.procrastinate_status == "doing" and d.procrastinate_job_id is not None
            ],
            conn,
        )
        await self.jobs.dispatch([d.id for d in lost], conn)
        await self.jobs.record_events(
            [
                (d.id, "job.redispatched",
                 events.redispatched(d.procrastinate_job_id, d.procrastinate_status))
                for d in lost
            ],
            conn,
        )  # fmt: skip
        return [d.id for d in lost]

    async def soonest_due(self, *, lookback: float) -> Due:
        """When the next waiting job is due, and whether one came due within ``lookback``
        seconds (a worker may not have seen it)."""
        row = await self.queries.row(
            "soonest_due",
            {"lookback": lookback},
        )
        assert row is not None
        seconds = None if row["seconds"] is None else float(row["seconds"])
        return Due(seconds, bool(row["overdue"]), float(row["now"]))

    async def ping(self) -> bool:
        return await self.queries.row("ping") is not None
