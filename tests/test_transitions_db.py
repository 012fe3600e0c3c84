"""Every (from, to) pair of statuses, against real PostgreSQL, at two levels:

- raw SQL: the guard trigger accepts legal changes and rejects every other one with
  WF_STATE_TRANSITION_INVALID, changing nothing;
- the store's operations (claim, complete, fail, retry, hand back, cancel): the legal ones
  apply; an illegal one raises InvalidTransition (or, for a dispatch's claim, is a no-op) and
  leaves the row and its history exactly as they were.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from checkpoints import CheckpointStore, Fence
from orchestrator import approvals, states
from orchestrator.database import create_pool
from orchestrator.errors import InvalidTransition
from orchestrator.models import Claim
from orchestrator.policy import Layer
from orchestrator.states import TERMINAL, Status
from orchestrator.store import JobStore

PAIRS = list(itertools.product(Status, Status))
LEASE = uuid.UUID("00000000-0000-4000-8000-000000000001")
PJ_ID = 424242


async def insert_job(db: psycopg.AsyncConnection[Any], status: Status) -> uuid.UUID:
    job_id = uuid.uuid4()
    running = status is Status.RUNNING
    await db.execute(
        """
        INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts, max_retries,
                              trace_id, lease_token, procrastinate_job_id, dispatch_attempt,
                              next_retry_at, finished_at)
        VALUES (%s, 'echo', %s, '{}', 'echo', 3, 3, 't', %s, %s, 1, %s, %s)
        """,
        (
            job_id,
            status.value,
            LEASE if running else None,
            PJ_ID,
            datetime.now(UTC) - timedelta(seconds=1) if status is Status.RETRY else None,
            datetime.now(UTC) if status in TERMINAL else None,
        ),
    )
    await db.execute(
        "INSERT INTO orc_approvals (id, job_id, step, key, question, on_reject, expires_at) "
        "VALUES (gen_random_uuid(), %s, 1, 'gate', 'ok?', 'fail', now() + interval '1 hour')",
        (job_id,),
    )
    return job_id


async def snapshot(db: psycopg.AsyncConnection[Any], job_id: uuid.UUID) -> tuple[Any, int]:
    cur = db.cursor(row_factory=dict_row)
    await cur.execute("SELECT * FROM orc_jobs WHERE id = %s", (job_id,))
    row = await cur.fetchone()
    await cur.execute("SELECT count(*) AS n FROM orc_job_events WHERE job_id = %s", (job_id,))
    events = await cur.fetchone()
    assert events is not None
    return row, events["n"]


@pytest.mark.parametrize(("source", "target"), PAIRS)
async def test_guard_trigger(
    db: psycopg.AsyncConnection[Any], source: Status, target: Status
) -> None:
    job_id = await insert_job(db, source)
    before = await snapshot(db, job_id)
    lease = LEASE if target is Status.RUNNING else None
    update = "UPDATE orc_jobs SET status = %s, lease_token = %s WHERE id = %s"
    if source is target:
        return  # not a status change; nothing to guard
    if states.is_legal(source, target):
        await db.execute(update, (target.value, lease, job_id))
        row, _ = await snapshot(db, job_id)
        assert row["status"] == target.value
        assert (row["finished_at"] is not None) == (target in TERMINAL)
    else:
        with pytest.raises(psycopg.Error, match="WF_STATE_TRANSITION_INVALID") as info:
            await db.execute(update, (target.value, lease, job_id))
        assert info.value.sqlstate == "WF001"
        assert await snapshot(db, job_id) == before


@pytest.fixture
async def store(dsn: str, db: psycopg.AsyncConnection[Any]) -> Any:
    pool: AsyncConnectionPool = create_pool(dsn, min_size=1, max_size=4)
    await pool.open()
    yield JobStore(pool)
    await pool.close()


def claim_for(job_id: uuid.UUID) -> Claim:
    return Claim(
        id=job_id, job_type="echo", payload={}, attempt=1, max_attempts=3, dispatch_attempt=1,
        retry_count=0, max_retries=3, lease_token=LEASE, locked_by="test", queue="echo",
        priority=0, timeout_seconds=None, trace_id="t", agent_id=None,
        started_at=datetime.now(UTC),
    )  # fmt: skip


def operation(
    store: JobStore, source: Status, target: Status, job_id: uuid.UUID
) -> Callable[[], Awaitable[Any]]:
    claim = claim_for(job_id)
    error = {"message": "x", "code": "X", "classification": "TRANSIENT_APP"}
    fence = Fence(job_id, LEASE, 1)

    async def decide(decision: Any) -> None:
        async with store.pool.connection() as conn:
            cur = await conn.execute("SELECT id FROM orc_approvals WHERE job_id = %s", (job_id,))
            row = await cur.fetchone()
        assert row is not None
        await approvals.decide(store, row["id"], decision, by="reviewer", reason="test")

    if source is Status.WAITING_APPROVAL and target in (Status.PENDING, Status.FAILED):
        return lambda: decide("approved" if target is Status.PENDING else "rejected")
    match target:
        case Status.WAITING_APPROVAL:
            return lambda: CheckpointStore(store.pool).request_approval(
                fence, approval_id=uuid.uuid4(), step=1, key="another", question="ok?",
                details={}, on_reject="fail", expires_in=3600,
            )  # fmt: skip
        case Status.RUNNING:
            return lambda: store.claim(job_id, PJ_ID, run=1, worker="test")
        case Status.COMPLETED:
            return lambda: store.complete(claim, {"ok": True}, {})
        case Status.FAILED:
            return lambda: store.fail(claim, error, {})
        case Status.RETRY:
            return lambda: store.schedule_retry(
                claim, layer=Layer.APP, next_retry_at=datetime.now(UTC), error=error,
                failed_event={}, retry_event={},
            )  # fmt: skip
        case Status.PENDING:
            return lambda: store.hand_back(claim, {})
        case Status.CANCELLED:
            return lambda: store.cancel(job_id, {"reason": "test"})
    raise AssertionError(target)


@pytest.mark.parametrize(("source", "target"), PAIRS)
async def test_store_operations(
    db: psycopg.AsyncConnection[Any], store: JobStore, source: Status, target: Status
) -> None:
    job_id = await insert_job(db, source)
    before = await snapshot(db, job_id)
    run = operation(store, source, target, job_id)
    if states.is_legal(source, target):
        await run()
        row, events = await snapshot(db, job_id)
        assert row["status"] == target.value
        assert events > before[1]  # every transition is recorded in the history
    elif target is Status.RUNNING:
        assert await run() is None  # a dispatch of an unclaimable job is a no-op
        assert await snapshot(db, job_id) == before
    else:
        with pytest.raises(InvalidTransition) as info:
            await run()
        assert info.value.code == "WF_STATE_TRANSITION_INVALID"
        assert (info.value.source, info.value.target) == (source.value, target.value)
        assert await snapshot(db, job_id) == before


async def test_events_are_append_only(db: psycopg.AsyncConnection[Any], store: JobStore) -> None:
    job_id = await insert_job(db, Status.PENDING)
    await store.cancel(job_id, {"reason": "x"})
    with pytest.raises(psycopg.Error, match="append-only"):
        await db.execute(
            "UPDATE orc_job_events SET kind = 'job.completed' WHERE job_id = %s", (job_id,)
        )
