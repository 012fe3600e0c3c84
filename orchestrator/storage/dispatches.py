"""Dispatches: the Procrastinate jobs that run application jobs, fetched and ended by a worker.

A dispatch (a ``procrastinate_jobs`` row) carries its application job's id and is locked on it.
A worker's fetch takes dispatches and, in the same statement, claims their jobs
(``orc_fetch_dispatches_v3``): a job is RUNNING exactly while one of its dispatches is doing.
A job under a limit whose key has no room is parked instead (docs/flow-control.md).
Each attempt's outcome is written together with the end of the dispatch that ran it, in one
transaction: completed and succeeded (``orc_complete_jobs_v1``), retried at the application
layer with a new dispatch, re-run by Procrastinate at the infrastructure layer
(``procrastinate_retry_job_v2``), handed back with a new dispatch, or failed
(``JobStore.fail``). Every statement that touches a job and its dispatch locks the job first;
the fetch, which must take a dispatch before it knows the job, only tries the job's lock, and a
job held elsewhere at that instant is claimed afterwards by :meth:`DispatchStore.claim`
(docs/architecture.md, "Lock order").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from procrastinate import jobs as procrastinate_jobs
from psycopg.types.json import Jsonb

from orchestrator.domain import states
from orchestrator.domain.failures import DispatchStatus
from orchestrator.domain.models import Claim
from orchestrator.domain.policy import Layer
from orchestrator.domain.states import Status
from orchestrator.storage.database import Conn
from orchestrator.storage.jobs import TASK_PREFIX, Held, JobStore
from orchestrator.storage.runner import Queries, Row


@dataclass(frozen=True)
class Dispatch:
    """One fetched dispatch. ``claim`` is its job's claim, made by the fetch, or None for a
    stale or duplicate dispatch of a job (nothing to run) and for a plain Procrastinate task.
    ``claim_later``: another transaction held the job when the fetch tried it, so the claim is
    still to be made (:meth:`DispatchStore.claim`)."""

    id: int
    task_name: str
    runs: int  # runs of this dispatch that ended before this one (Procrastinate's attempts)
    claim: Claim | None
    row: Row  # Procrastinate's row, for running a plain Procrastinate task
    claim_later: bool = False

    @property
    def is_job(self) -> bool:
        return self.task_name.startswith(TASK_PREFIX)

    def procrastinate_job(self) -> procrastinate_jobs.Job:
        return procrastinate_jobs.Job.from_row(self.row)

    def due_at(self, claim: Claim) -> float | None:
        """When this dispatch became due (epoch seconds), if known: the time it was scheduled
        for (a retry, a job submitted for later), else, for a job's first attempt, its run_at
        (its submit). None for a later attempt's unscheduled dispatch (a hand-back)."""
        scheduled: datetime | None = self.row.get("scheduled_at")
        if scheduled is not None:
            return scheduled.timestamp()
        return claim.run_at.timestamp() if claim.attempt == 1 else None


@dataclass(frozen=True)
class Throttle:
    """A provider's 429 or 529 on a flow key: it pauses for ``seconds`` (its hint) from the
    database's now, or, with none, the key's rate halves (docs/flow-control.md)."""

    key: str
    seconds: float | None
    reason: str


@dataclass(frozen=True)
class Completion:
    """A successful attempt's result, to be written with its dispatch's end."""

    claim: Claim
    result: Any
    duration_ms: float
    dispatch_id: int


@dataclass(frozen=True)
class Taker:
    """Who fetches dispatches, and of which queues: a worker's lane."""

    queues: Sequence[str] | None  # None: every queue ...
    excluded: Sequence[str]  # ... but these (external job types', other applications')
    worker_id: int  # its Procrastinate registry id
    worker: str  # its host and process, as ``locked_by`` shows them


class DispatchStore:
    def __init__(self, queries: Queries, jobs: JobStore) -> None:
        self.queries = queries
        self.jobs = jobs

    async def fetch(
        self,
        *,
        limit: int,
        queues: Sequence[str] | None,
        worker_id: int,
        worker: str,
        conn: Conn,
        excluded: Sequence[str] = (),
    ) -> list[Dispatch]:
        """Up to ``limit`` due dispatches of ``queues`` (None: every queue) but the
        ``excluded`` ones, each job claimed (RUNNING, attempt + 1, a new lease,
        ``job.running``) by the same statement; [] when nothing is due."""
        taker = Taker(queues, excluded, worker_id, worker)
        rows = await self.queries.rows("fetch_dispatches", _fetching(limit, taker), conn)
        return [_dispatch(row) for row in rows]

    async def claim(self, dispatch: Dispatch, *, worker_id: int, worker: str) -> Claim | None:
        """The claim the fetch left for later (``dispatch.claim_later``), made now: it waits for
        the job row alone; None if the dispatch went stale meanwhile (its job was replaced,
        cancelled or claimed by another), and the caller ends it."""
        row = await self.queries.row(
            "claim_dispatch",
            {
                "job_id": UUID(dispatch.row["args"]["job_id"]),
                "dispatch_id": dispatch.id,
                "run": dispatch.runs + 1,
                "worker_id": worker_id,
                "worker": worker,
                "claimable": states.sources_of(Status.RUNNING),
                "running": Status.RUNNING.value,
                "task_prefix": TASK_PREFIX,
            },
        )
        return Claim.model_validate(row) if row else None

    async def claim_now(self, job_id: UUID, *, worker_id: int, worker: str) -> Held | None:
        """Claim this waiting job at once, due or not, through the dispatch it waits in (the
        internal replay endpoint); None when it is not waiting (running, finished, unknown)."""

        async def claim(conn: Conn) -> Held | None:
            params = {"job_id": job_id, "claimable": states.sources_of(Status.RUNNING)}
            job = await self.queries.row("lock_replayed_job", params, conn)
            if job is None or job["procrastinate_job_id"] is None:
                return None
            taken = await self.queries.row(
                "take_dispatch",
                {"dispatch_id": job["procrastinate_job_id"], "worker_id": worker_id},
                conn,
            )
            if taken is None:
                return None
            row = await self.queries.row(
                "claim_dispatch",
                {
                    "job_id": job_id,
                    "dispatch_id": taken["id"],
                    "run": taken["attempts"] + 1,
                    "worker_id": worker_id,
                    "worker": worker,
                    "claimable": states.sources_of(Status.RUNNING),
                    "running": Status.RUNNING.value,
                    "task_prefix": TASK_PREFIX,
                },
                conn,
            )
            return Held(Claim.model_validate(row), taken["id"], 0.0) if row else None

        return await self.queries.in_transaction(claim)

    async def complete(self, completions: Sequence[Completion], conn: Conn) -> list[bool]:
        """COMPLETED with its result and ``job.completed`` (shaped by orc_completed_event_v1 from
        the attempt's facts given here), and the dispatch succeeded, for each; returns whether
        each job was COMPLETED (a refused one's dispatch is ended all the same)."""
        rows = await self.queries.rows("complete_jobs", _completing(completions), conn)
        rows.sort(key=lambda r: r["ord"])
        return [r["completed"] for r in rows]

    async def complete_and_fetch(
        self, completion: Completion, taker: Taker, conn: Conn
    ) -> tuple[bool, list[Dispatch]]:
        """A completion (as :meth:`complete`) and, in the same statement, run after it, a fetch
        of one dispatch for ``taker`` (as :meth:`fetch`), which may claim a job the end
        released: whether the job was COMPLETED, and what was fetched."""
        params = _completing([completion]) | _fetching(1, taker)
        [row] = await self.queries.rows("complete_and_fetch", params, conn)
        return row["completed"], [_dispatch(row)] if row["id"] is not None else []

    async def retry(
        self,
        claim: Claim,
        dispatch_id: int,
        *,
        layer: Layer,
        delay_ms: float,
        error: dict[str, Any],
        failed_event: dict[str, Any],
        retry_event: dict[str, Any],
        throttle: Throttle | None = None,
    ) -> bool:
        """RETRY for ``delay_ms`` from the database's now (no caller's clock is read: its time
        is written in the row and in ``available_at`` and ``next_available_at``), lease
        released, ``job.failed`` and ``job.retry_scheduled``. The application layer counts a
        retry and gives the job a new dispatch (this one succeeded); the infrastructure layer
        has Procrastinate re-run this dispatch at that time. A pause is retried as the
        application layer is, using no budget. ``throttle``: the job's flow key is paused (or
        slowed) in the same transaction. False: refused (the dispatch ends failed)."""
        params = {
            **_fence(claim, Status.RETRY),
            "layer": layer.value,
            "retry_increment": layer.retries_used,
            "delay_seconds": delay_ms / 1000,
            "error": Jsonb(error),
            "failed_event": Jsonb(failed_event),
            "retry_event": Jsonb(retry_event),
        }
        async with self.queries.transaction() as conn:
            retrying = await self.queries.row("schedule_retry", params, conn)
            written = retrying is not None
            if throttle is not None:  # after the job's lock (the lock order: job, then key)
                await self.queries.row(
                    "flow_throttled",
                    {"key": throttle.key, "seconds": throttle.seconds, "reason": throttle.reason},
                    conn,
                )
            if retrying is not None and layer is Layer.INFRA:
                params = {"dispatch_id": dispatch_id, "retry_at": retrying["next_retry_at"]}
                await self.queries.row("retry_dispatch", params, conn)
                return True
            if written:
                await self.jobs.dispatch([claim.id], conn)
            await self.end(dispatch_id, "succeeded" if written else "failed", conn)
        return written

    async def hand_back(self, claim: Claim, dispatch_id: int, event: dict[str, Any]) -> bool:
        """RUNNING -> PENDING without using budget (a drain), with a new dispatch; this one ends
        aborted. False: refused."""
        async with self.queries.transaction() as conn:
            row = await self.queries.row(
                "hand_back_job", {**_fence(claim, Status.PENDING), "event": Jsonb(event)}, conn
            )
            if row is not None:
                await self.jobs.dispatch([claim.id], conn)
            await self.end(dispatch_id, "aborted", conn)
        return row is not None

    async def park(
        self, claim: Claim, dispatch_id: int, *, cost: int, blocked: str, release: bool,
        not_before: float | None = None,
    ) -> bool:  # fmt: skip
        """RUNNING -> PENDING without using budget, as a waiter of the job's flow key for a call
        of ``cost`` that found no room (``blocked``: requests, units, share or paused);
        ``release``: the claim's reservation, which no call used, leaves the window. This
        dispatch ends succeeded; the key's pump gives the job a new one when its room frees, or
        it is sent for ``not_before`` seconds from now (its room on a fallback model's key), and
        while its key is paused for the pause's end at the soonest (orc_flow_park_v2). False:
        refused."""
        async with self.queries.transaction() as conn:
            row = await self.queries.row(
                "park_job",
                {**_fence(claim, Status.PENDING), "cost": cost, "blocked": blocked,
                 "release": release, "not_before": not_before},
                conn,
            )  # fmt: skip
            parked = bool(row and row["parked"])
            await self.end(dispatch_id, "succeeded" if parked else "failed", conn)
        return parked

    async def end(self, dispatch_id: int, status: DispatchStatus, conn: Conn | None = None) -> bool:
        """End the dispatch, if it is still doing; whether it was."""
        row = await self.queries.row(
            "end_dispatch", {"dispatch_id": dispatch_id, "status": status}, conn
        )
        return bool(row and row["ended"])

    async def retry_task(self, dispatch_id: int, retry_at: datetime | None) -> None:
        """Procrastinate runs a plain task's dispatch again at ``retry_at`` (now if None), as its
        retry strategy decided."""
        await self.queries.row("retry_dispatch", {"dispatch_id": dispatch_id, "retry_at": retry_at})

    async def aborting(self, dispatch_ids: Sequence[int]) -> list[int]:
        """Which of these dispatches have been asked to abort (their job was cancelled)."""
        rows = await self.queries.rows("dispatches_to_abort", {"ids": list(dispatch_ids)})
        return [row["id"] for row in rows]

    # -- the workers that fetch (Procrastinate's registry: its stalled-worker rules apply) --

    async def register_worker(self, *, prune_after: float) -> int:
        """Register a worker (and forget those silent for ``prune_after`` seconds)."""
        await self.queries.rows("prune_stalled_workers", {"seconds": prune_after})
        row = await self.queries.row("register_worker")
        assert row is not None
        worker_id: int = row["worker_id"]
        return worker_id

    async def beat_worker(self, worker_id: int) -> bool:
        """Refresh the worker's registry heartbeat; False if the registry forgot it."""
        return await self.queries.execute("worker_heartbeat", {"worker_id": worker_id}) == 1

    async def unregister_worker(self, worker_id: int) -> None:
        await self.queries.execute("unregister_worker", {"worker_id": worker_id})


def _fence(claim: Claim, target: Status) -> dict[str, Any]:
    return {
        "job_id": claim.id,
        "lease_token": claim.lease_token,
        "target": target.value,
        "sources": states.sources_of(target),
    }


def _fetching(limit: int, taker: Taker) -> dict[str, Any]:
    """The parameters of a fetch (the queries fetch_dispatches, complete_and_fetch)."""
    return {
        "limit": limit,
        "queues": list(taker.queues) if taker.queues is not None else None,
        "excluded": list(taker.excluded),
        "worker_id": taker.worker_id,
        "task_prefix": TASK_PREFIX,
        "worker": taker.worker,
        "claimable": states.sources_of(Status.RUNNING),
        "running": Status.RUNNING.value,
    }


def _completing(completions: Sequence[Completion]) -> dict[str, Any]:
    """The parameters of a completion (the queries complete_jobs, complete_and_fetch)."""
    items = [
        {
            "ord": i,
            "job_id": str(c.claim.id),
            "lease_token": str(c.claim.lease_token),
            "result": c.result,
            "attempt": c.claim.attempt,
            "run": c.claim.dispatch_attempt,
            "worker": c.claim.locked_by,
            "duration_ms": round(c.duration_ms, 3),
            "procrastinate_job_id": c.dispatch_id,
            "delete_dispatch": False,
        }
        for i, c in enumerate(completions)
    ]
    items.sort(key=lambda item: item["job_id"])  # job-id order, as a heartbeat locks them
    return {
        "items": Jsonb(items),
        "target": Status.COMPLETED.value,
        "sources": states.sources_of(Status.COMPLETED),
    }


def _dispatch(row: Row) -> Dispatch:
    args = dict(row["args"])
    # The fetch returns these in the args; they are not stored there.
    claim = args.pop("claim", None)
    claim_later = args.pop("claim_later", False)
    return Dispatch(
        id=row["id"],
        task_name=row["task_name"],
        runs=row["attempts"],
        claim=Claim.model_validate(claim) if claim else None,
        row={**row, "args": args},
        claim_later=claim_later,
    )
