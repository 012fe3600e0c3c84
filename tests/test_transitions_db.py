"""Every (from, to) pair of statuses, against real PostgreSQL, at two levels:

- raw SQL: the guard trigger accepts legal changes and rejects every other one with
  WF_STATE_TRANSITION_INVALID, changing nothing;
- the stores' operations (claim, complete, fail, retry, hand back, cancel, approval
  requests and decisions, a wait for children and the release of a job that waited; a waiting
  job is completed or failed as Graphile Worker's
  complete_jobs and permanently_fail_jobs write it, with no lease): the legal ones apply; an
  illegal one is refused with InvalidTransition (or, for a dispatch's claim, is a no-op) and
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
from psycopg.types.json import Jsonb

from orchestrator.domain import events, states
from orchestrator.domain.classification import ErrorClass
from orchestrator.domain.degradation import Degrader, TypeDegradation
from orchestrator.domain.errors import InvalidTransition, StaleLease
from orchestrator.domain.events import Fault
from orchestrator.domain.failures import Failures
from orchestrator.domain.models import Claim, Fence
from orchestrator.domain.notices import Notifier
from orchestrator.domain.policy import Layer
from orchestrator.domain.states import CLAIMABLE, TERMINAL, Status
from orchestrator.services.approvals import ApprovalDecisions
from orchestrator.storage.database import create_pool
from orchestrator.storage.dispatches import Completion
from orchestrator.storage.stores import Stores
from tests.support import log_guard

PAIRS = list(itertools.product(Status, Status))
LEASE = uuid.UUID("00000000-0000-4000-8000-000000000001")


async def insert_job(db: psycopg.AsyncConnection[Any], status: Status) -> uuid.UUID:
    """A job in ``status``, with a dispatch its worker is running and an open approval."""
    job_id = uuid.uuid4()
    running = status is Status.RUNNING
    cur = await db.execute(
        "INSERT INTO procrastinate_jobs (queue_name, task_name, lock, args, status) "
        "VALUES ('echo', 'orc.echo', %s, jsonb_build_object('job_id', %s::text), 'doing') "
        "RETURNING id",
        (str(job_id), str(job_id)),
    )
    row = await cur.fetchone()
    assert row is not None
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
            row[0],
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
        # Not a status change (a heartbeat's write, a finished job's row rewritten as it is):
        # the guard lets it through, and neither the trigger nor the write changes anything.
        await db.execute(update, (target.value, lease, job_id))
        row, events = await snapshot(db, job_id)
        assert {k for k in row if row[k] != before[0][k]} <= {"updated_at"}
        assert events == before[1]
    elif states.is_legal(source, target):
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
async def stores(dsn: str, db: psycopg.AsyncConnection[Any]) -> Any:
    pool = create_pool(dsn, min_size=1, max_size=4)
    await pool.open()
    yield Stores.on(pool)
    await pool.close()


def claim_for(job_id: uuid.UUID) -> Claim:
    return Claim(
        id=job_id, job_type="echo", tenant_id=None, payload={}, attempt=1, max_attempts=3,
        dispatch_attempt=1, retry_count=0, max_retries=3, lease_token=LEASE, locked_by="test",
        queue="echo", priority=0, timeout_seconds=None, trace_id="t", agent_id=None,
        started_at=datetime.now(UTC), run_at=datetime.now(UTC), most_attempts=12,
    )  # fmt: skip


def nobody_notified() -> Failures:
    notifier = Notifier(
        submit_row=lambda job_type, payload: {}, escalation_type="send_notification",
        escalation_target=None, approval_type="approval_notify", approval_target=None,
    )  # fmt: skip
    return Failures(Degrader(of_type=lambda job_type: TypeDegradation(), notifier=notifier))


def operation(
    stores: Stores, source: Status, target: Status, job_id: uuid.UUID
) -> Callable[[], Awaitable[Any]]:
    """The store operation that moves the job to ``target``; a refused one raises why."""
    claim = claim_for(job_id)
    fault = Fault("x", "X", ErrorClass.TRANSIENT_APP)
    error = events.last_error(claim, fault, terminal=True)

    async def dispatch_id() -> int:
        job = await stores.jobs.get(job_id)
        assert job.procrastinate_job_id is not None
        return job.procrastinate_job_id

    async def written(done: bool) -> None:
        if not done:
            raise await stores.jobs.refusal(job_id, target, LEASE)

    async def claim_it() -> Any:  # the claim a fetch makes for this dispatch (orc_claim_v1)
        pjob_id = await dispatch_id()
        async with stores.queries.connection() as conn:
            cur = await conn.execute(
                "SELECT * FROM orc_claim_v1(%s, %s, 1, 'test', %s, %s)",
                (job_id, pjob_id, states.sources_of(Status.RUNNING), Status.RUNNING.value),
            )
            return await cur.fetchone()

    async def complete() -> None:
        completion = Completion(claim, {"ok": True}, 0.0, await dispatch_id())
        async with stores.queries.connection() as conn:
            [done] = await stores.dispatches.complete([completion], conn)
        await written(done)

    async def fail() -> None:
        failure = nobody_notified().terminal(claim, fault)
        [letter] = await stores.jobs.fail([failure])
        await written(letter is not None)

    async def retry() -> None:
        done = await stores.dispatches.retry(
            claim, await dispatch_id(), layer=Layer.APP, delay_ms=0,
            error=error, failed_event={}, retry_event={},
        )  # fmt: skip
        await written(done)

    async def hand_back() -> None:
        await written(await stores.dispatches.hand_back(claim, await dispatch_id(), {}))

    async def request_approval() -> None:
        await stores.approvals.request(
            Fence(job_id, LEASE, 1), approval_id=uuid.uuid4(), step=1, key="another",
            question="ok?", details={}, on_reject="fail", expires_in=3600, notice=None,
        )  # fmt: skip

    async def decide(decision: Any) -> None:
        async with stores.queries.connection() as conn:
            cur = await conn.execute("SELECT id FROM orc_approvals WHERE job_id = %s", (job_id,))
            row = await cur.fetchone()
        assert row is not None
        decisions = ApprovalDecisions(stores=stores, failures=nobody_notified())
        await decisions.decide(row["id"], decision, by="reviewer", reason="test")

    async def complete_unheld() -> None:  # as graphile_worker.complete_jobs writes it
        item = {"ord": 0, "job_id": str(job_id), "lease_token": None, "result": None,
                "event": {}, "procrastinate_job_id": None, "delete_dispatch": False}  # fmt: skip
        async with stores.queries.connection() as conn:
            cur = await conn.execute(
                "SELECT completed FROM orc_complete_jobs_v1(%s, %s, %s)",
                (Jsonb([item]), target.value, states.sources_of(target)),
            )
            [done] = await cur.fetchone() or (False,)
        if not done:
            raise await stores.jobs.refusal(job_id, target, None)

    async def fail_unheld() -> None:  # as graphile_worker.permanently_fail_jobs writes it
        unheld = claim.model_copy(update={"lease_token": None, "locked_by": None})
        failure = nobody_notified().terminal(unheld, fault, degrade=False)
        [letter] = await stores.jobs.fail([failure])
        if letter is None:
            raise await stores.jobs.refusal(job_id, target, None)

    async def another(status: str, **columns: Any) -> uuid.UUID:
        other = uuid.uuid4()
        names = ", ".join(["id", "job_type", "status", "payload", "queue", "max_attempts",
                           "max_retries", "trace_id", *columns])  # fmt: skip
        holes = ", ".join(["%s"] * (8 + len(columns)))
        async with stores.queries.connection() as conn:
            await conn.execute(
                f"INSERT INTO orc_jobs ({names}) VALUES ({holes})",
                (other, "echo", status, Jsonb({}), "echo", 3, 3, "t", *columns.values()),
            )
        return other

    async def wait_for_child() -> None:  # a step's wait_for (docs/workflows.md)
        child = await another("PENDING")
        async with stores.queries.connection() as conn:
            await conn.execute(
                "INSERT INTO orc_job_children (parent_id, step, key, n, child_id,"
                " cancel_with_parent) VALUES (%s, 1, 'spawn1', 1, %s, true)",
                (job_id, child),
            )
        await stores.graph.wait_for(Fence(job_id, LEASE, 1), [child])

    async def release() -> None:  # the last job it waits for ends, in that transaction
        awaited = await another("RUNNING", lease_token=uuid.uuid4(), has_dependants=True)
        async with stores.queries.connection() as conn:
            await conn.execute(
                "INSERT INTO orc_job_dependencies (job_id, awaited_id, ord, on_failure)"
                " VALUES (%s, %s, 1, 'cancel')",
                (job_id, awaited),
            )
            await conn.execute(
                "INSERT INTO orc_job_waits (job_id, unsettled, task_prefix) VALUES (%s, 1, 'orc.')",
                (job_id,),
            )
            await conn.execute(
                "UPDATE orc_jobs SET status = 'COMPLETED', lease_token = NULL WHERE id = %s",
                (awaited,),
            )

    if source is Status.BLOCKED and target is Status.PENDING:
        return release
    if source is Status.WAITING_APPROVAL and target in (Status.PENDING, Status.FAILED):
        return lambda: decide("approved" if target is Status.PENDING else "rejected")
    if source in CLAIMABLE and target in (Status.COMPLETED, Status.FAILED):
        return complete_unheld if target is Status.COMPLETED else fail_unheld
    match target:
        case Status.WAITING_APPROVAL:
            return request_approval
        case Status.RUNNING:
            return claim_it
        case Status.COMPLETED:
            return complete
        case Status.FAILED:
            return fail
        case Status.RETRY:
            return retry
        case Status.PENDING:
            return hand_back
        case Status.CANCELLED:
            return lambda: stores.jobs.cancel(job_id, reason="test", by="test")
        case Status.BLOCKED:
            return wait_for_child
    raise AssertionError(target)


@log_guard.fails_jobs("X")
@pytest.mark.parametrize(("source", "target"), PAIRS)
async def test_store_operations(
    db: psycopg.AsyncConnection[Any], stores: Stores, source: Status, target: Status
) -> None:
    job_id = await insert_job(db, source)
    before = await snapshot(db, job_id)
    run = operation(stores, source, target, job_id)
    if states.is_legal(source, target):
        claimed = await run()
        row, events = await snapshot(db, job_id)
        assert row["status"] == target.value
        assert events > before[1]  # every transition is recorded in the history
        if target is Status.RUNNING:  # the claim hands its attempt the job's new lease
            assert (claimed["id"], claimed["lease_token"], claimed["attempt"]) == (
                job_id, row["lease_token"], row["attempt"],
            )  # fmt: skip
            assert row["lease_token"] not in (None, before[0]["lease_token"])
    elif target is Status.RUNNING:
        assert await run() is None  # a dispatch of an unclaimable job is a no-op
        assert await snapshot(db, job_id) == before
    else:
        with pytest.raises(InvalidTransition) as info:
            await run()
        assert info.value.code == "WF_STATE_TRANSITION_INVALID"
        assert (info.value.source, info.value.target) == (source.value, target.value)
        assert await snapshot(db, job_id) == before


@log_guard.fails_jobs("X")
@pytest.mark.parametrize("source", sorted(CLAIMABLE))
@pytest.mark.parametrize("target", [Status.COMPLETED, Status.FAILED])
async def test_an_attempts_write_never_ends_a_waiting_job(
    db: psycopg.AsyncConnection[Any], stores: Stores, source: Status, target: Status
) -> None:
    """A waiting job may end COMPLETED or FAILED only by a write that names no lease (Graphile
    Worker's complete_jobs, permanently_fail_jobs): an attempt's, fenced by its lease, is
    refused as stale."""
    job_id = await insert_job(db, source)
    before = await snapshot(db, job_id)
    with pytest.raises(StaleLease):
        await operation(stores, Status.RUNNING, target, job_id)()
    assert await snapshot(db, job_id) == before


async def test_events_are_append_only(db: psycopg.AsyncConnection[Any], stores: Stores) -> None:
    job_id = await insert_job(db, Status.PENDING)
    await stores.jobs.cancel(job_id, reason="x", by="test")
    with pytest.raises(psycopg.Error, match="append-only"):
        await db.execute(
            "UPDATE orc_job_events SET kind = 'job.completed' WHERE job_id = %s", (job_id,)
        )


@pytest.mark.parametrize("status", sorted(TERMINAL))
@pytest.mark.parametrize(
    "change",
    [
        "result = '{\"forged\": true}'",
        "last_error = '{}'",
        "finished_at = now() + interval '1 day'",
        "attempt = attempt + 1",
        "retry_count = retry_count + 1",
        "dispatch_attempt = 7",
        "next_retry_at = now()",
        "locked_by = 'someone'",
    ],
)
async def test_a_finished_jobs_outcome_cannot_change_even_by_hand(
    db: psycopg.AsyncConnection[Any], status: Status, change: str
) -> None:
    job_id = await insert_job(db, status)
    before = await snapshot(db, job_id)
    with pytest.raises(psycopg.Error, match="WF_STATE_TRANSITION_INVALID") as info:
        await db.execute(f"UPDATE orc_jobs SET {change} WHERE id = %s", (job_id,))
    assert info.value.sqlstate == "WF001"
    assert await snapshot(db, job_id) == before
    await db.execute("DELETE FROM orc_jobs WHERE id = %s", (job_id,))  # retention still can


async def test_only_a_terminal_transition_sets_finished_at(
    db: psycopg.AsyncConnection[Any],
) -> None:
    job_id = await insert_job(db, Status.PENDING)
    with pytest.raises(psycopg.Error, match="only a terminal transition sets finished_at"):
        await db.execute("UPDATE orc_jobs SET finished_at = now() WHERE id = %s", (job_id,))
