"""Locks taken in one order (docs/architecture.md, "Lock order"), on real PostgreSQL with real
concurrent connections: keyed submits and cancels racing a busy worker's fetch never deadlock
and the worker keeps running; the fetch waits for no job row; a deadlock that can still happen
is run again where the orchestrator owns the transaction, and is a TransactionConflict (never
the driver's error) where the caller does.

A keyed submit and a cancel lock a waiting job and then its dispatch; the fetch takes a
dispatch first. Before migration 0014 the fetch then waited for the job, and the two deadlocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any
from uuid import UUID

import psycopg
import pytest
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from orchestrator import InvalidTransition, JobContext, Orchestrator, Status, TransactionConflict
from orchestrator.storage.stores import Stores
from tests.support.harness import WorkerRun, wait_for

KEYS = 2
SUBMITTERS = 20  # concurrent submits of one key, each on a connection of its own
ROUNDS = 10
#: A keyed job's history: replaced in place while it waits, its key revoked while it runs.
HISTORY = re.compile(r"created( replaced)* running( key_revoked)? completed")


def busy_app(
    make_orc: Callable[..., Orchestrator], runs: Counter[UUID], **settings: Any
) -> Orchestrator:
    orc = make_orc(**settings)

    @orc.job_type("busy")
    async def busy(ctx: JobContext, payload: dict[str, Any]) -> dict[str, Any]:
        runs[ctx.job_id] += 1
        await asyncio.sleep(payload["seconds"])
        return payload

    return orc


async def deadlocks(db: psycopg.AsyncConnection[Any]) -> int:
    """Deadlocks the server has detected in this database (as of the stats it has been sent)."""
    await db.execute("SELECT pg_stat_clear_snapshot()")
    cur = await db.execute(
        "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def deadlocks_after_closing(db: psycopg.AsyncConnection[Any], *orcs: Orchestrator) -> int:
    """The deadlock count once every other connection to the database has gone: a backend
    sends its statistics before it leaves pg_stat_activity."""
    for orc in orcs:
        await orc.close()

    async def alone() -> bool:
        cur = await db.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        row = await cur.fetchone()
        return row is not None and row[0] == 0

    await wait_for(alone, timeout=20)
    return await deadlocks(db)


async def live_dispatches(db: psycopg.AsyncConnection[Any]) -> int:
    cur = await db.execute(
        "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')"
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def test_replace_submits_of_one_key_never_deadlock_with_a_busy_worker(
    make_orc: Callable[..., Orchestrator],
    db: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs: Counter[UUID] = Counter()
    worker_orc = busy_app(make_orc, runs)
    submitter = busy_app(make_orc, runs, pool_max_size=KEYS * SUBMITTERS)
    await submitter.open()
    before = await deadlocks(db)
    errors: list[BaseException] = []
    returned: dict[str, set[UUID]] = {f"key-{k}": set() for k in range(KEYS)}

    async def submit(key: str, n: int) -> None:
        job_id = await submitter.submit(
            "busy", {"seconds": 0.05, "n": n}, job_key=key, job_key_mode="replace"
        )
        returned[key].add(job_id)

    with caplog.at_level(logging.WARNING):
        async with WorkerRun(worker_orc, concurrency=4) as worker:
            for round_ in range(ROUNDS):
                outcomes = await asyncio.gather(
                    *(
                        submit(key, round_ * SUBMITTERS + i)
                        for i in range(SUBMITTERS)
                        for key in returned
                    ),
                    return_exceptions=True,
                )
                errors += [o for o in outcomes if isinstance(o, BaseException)]
                await asyncio.sleep(0.03)  # the worker takes the jobs just created
            every = {job_id for ids in returned.values() for job_id in ids}
            await worker.until_finished(*every, timeout=60)
            assert worker.task is not None and not worker.task.done()
            after_rounds = await submitter.submit("busy", {"seconds": 0})
            await worker.until_finished(after_rounds)
            jobs = {job_id: await submitter.get_job(job_id) for job_id in every}
            histories = {job_id: await submitter.job_events(job_id) for job_id in every}
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("orchestrator")]

    assert errors == []
    assert [m for m in logged if "deadlock" in m or "unreachable" in m] == []
    for job_id, job in jobs.items():
        kinds = " ".join(e.kind.removeprefix("job.") for e in histories[job_id])
        assert HISTORY.fullmatch(kinds), kinds
        assert (job.status, job.attempt, runs[job_id]) == (Status.COMPLETED, 1, 1)
    for key, ids in returned.items():
        # Every submit is in exactly one job's history: it created the job or replaced it.
        recorded = sum(
            1
            for job_id in ids
            for e in histories[job_id]
            if e.kind in ("job.created", "job.replaced")
        )
        assert recorded == SUBMITTERS * ROUNDS
        for job_id in ids:  # a job keeps its key unless a later one took it while it ran
            revoked = any(e.kind == "job.key_revoked" for e in histories[job_id])
            assert jobs[job_id].job_key == (None if revoked else key)
        newest = max(ids, key=lambda job_id: histories[job_id][0].id)  # by its job.created
        assert jobs[newest].job_key == key
    assert await live_dispatches(db) == 0
    assert await deadlocks_after_closing(db, worker_orc, submitter) == before


async def test_cancels_racing_the_fetch_never_deadlock(
    make_orc: Callable[..., Orchestrator],
    db: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs: Counter[UUID] = Counter()
    worker_orc = busy_app(make_orc, runs)
    operator = busy_app(make_orc, runs, pool_max_size=SUBMITTERS)
    await operator.open()
    before = await deadlocks(db)
    errors: list[BaseException] = []
    every: list[UUID] = []

    async def submit_then_cancel() -> None:
        job_id = await operator.submit("busy", {"seconds": 0.01})
        every.append(job_id)
        with contextlib.suppress(InvalidTransition):  # it finished first
            await operator.cancel(job_id, reason="changed my mind")

    with caplog.at_level(logging.WARNING):
        async with WorkerRun(worker_orc, concurrency=4) as worker:
            for _ in range(ROUNDS):
                outcomes = await asyncio.gather(
                    *(submit_then_cancel() for _ in range(SUBMITTERS)), return_exceptions=True
                )
                errors += [o for o in outcomes if isinstance(o, BaseException)]
            await worker.until_finished(*every, timeout=60)
            assert worker.task is not None and not worker.task.done()
            statuses = Counter([(await operator.get_job(job_id)).status for job_id in every])
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("orchestrator")]

    assert errors == []
    assert [m for m in logged if "deadlock" in m or "unreachable" in m] == []
    assert set(statuses) <= {Status.CANCELLED, Status.COMPLETED}
    assert await live_dispatches(db) == 0
    assert await deadlocks_after_closing(db, worker_orc, operator) == before


async def test_the_fetch_waits_for_no_job_another_transaction_holds(
    make_orc: Callable[..., Orchestrator], dsn: str, db: psycopg.AsyncConnection[Any]
) -> None:
    # A job's row held (as a submit replacing it or a cancel holds it) while its dispatch is
    # due: the fetch takes the dispatch, leaves the claim for later, and goes on with the next.
    runs: Counter[UUID] = Counter()
    orc = busy_app(make_orc, runs, fetch_polling_interval=60)
    await orc.open()
    held = await orc.submit("busy", {"seconds": 0})
    other = await orc.submit("busy", {"seconds": 0})
    async with await psycopg.AsyncConnection.connect(dsn) as holder:
        await holder.execute("SELECT FROM orc_jobs WHERE id = %s FOR UPDATE", (held,))
        async with WorkerRun(orc, concurrency=2) as worker:
            try:
                await worker.until_finished(other, timeout=10)
                assert (await orc.get_job(held)).status is Status.PENDING
            finally:
                await holder.rollback()  # a fetch stuck behind it could not stop
            await worker.until_finished(held, timeout=10)
    job = await orc.get_job(held)
    assert (job.status, job.attempt, runs[held]) == (Status.COMPLETED, 1, 1)
    assert [e.kind for e in await orc.job_events(held)] == [
        "job.created", "job.running", "job.completed",
    ]  # fmt: skip
    assert await live_dispatches(db) == 0


async def blocked_by(db: psycopg.AsyncConnection[Any], pid: int) -> bool:
    cur = await db.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY (pg_blocking_pids(pid))", (pid,)
    )
    row = await cur.fetchone()
    return row is not None and row[0] > 0


async def deadlock_against(
    dsn: str, db: psycopg.AsyncConnection[Any], job_id: UUID, action: Awaitable[Any]
) -> asyncio.Task[Any]:
    """Run ``action`` (which locks the job, then its dispatch) against a transaction that locks
    the dispatch, then the job: a deadlock, whose victim is ``action`` (the other side checks
    for deadlocks only after 10 s). Returns ``action``'s task, once the other side is done."""
    async with await psycopg.AsyncConnection.connect(dsn) as other:
        cur = await other.execute("SELECT pg_backend_pid()")
        row = await cur.fetchone()
        assert row is not None
        await other.execute("SET LOCAL deadlock_timeout = '10s'")
        await other.execute(
            "SELECT FROM procrastinate_jobs AS p JOIN orc_jobs AS j"
            " ON p.id = j.procrastinate_job_id WHERE j.id = %s FOR UPDATE OF p",
            (job_id,),
        )
        task = asyncio.ensure_future(action)
        await wait_for(lambda: blocked_by(db, row[0]))
        await other.execute("SELECT FROM orc_jobs WHERE id = %s FOR UPDATE", (job_id,))
        await other.commit()
    return task


@pytest.mark.parametrize("action", ["replace", "cancel"])
async def test_a_deadlock_victim_the_orchestrator_owns_is_run_again(
    make_orc: Callable[..., Orchestrator],
    dsn: str,
    db: psycopg.AsyncConnection[Any],
    action: str,
) -> None:
    orc = busy_app(make_orc, Counter())
    await orc.open()
    job_id = await orc.submit("busy", {"seconds": 0, "n": 1}, job_key="k")
    before = await deadlocks(db)
    if action == "replace":
        again = orc.submit("busy", {"seconds": 0, "n": 2}, job_key="k")
    else:
        again = orc.cancel(job_id, reason="test")
    task = await deadlock_against(dsn, db, job_id, again)
    assert await task in (job_id, None)
    job = await orc.get_job(job_id)
    if action == "replace":
        assert (job.status, job.payload["n"], job.revision) == (Status.PENDING, 2, 1)
    else:
        assert job.status is Status.CANCELLED
    assert await deadlocks_after_closing(db, orc) == before + 1  # it happened, and was retried


async def test_a_deadlock_inside_the_callers_transaction_is_a_transaction_conflict(
    make_orc: Callable[..., Orchestrator], dsn: str, db: psycopg.AsyncConnection[Any]
) -> None:
    orc = busy_app(make_orc, Counter())
    await orc.open()
    job_id = await orc.submit("busy", {"seconds": 0, "n": 1}, job_key="k")
    async with await psycopg.AsyncConnection.connect(dsn) as caller:

        async def submit_in_a_transaction() -> None:
            async with caller.transaction():
                await orc.submit("busy", {"n": 2}, job_key="k", connection=caller)

        task = await deadlock_against(dsn, db, job_id, submit_in_a_transaction())
        with pytest.raises(TransactionConflict) as info:
            await task
    assert isinstance(info.value.__cause__, psycopg.errors.DeadlockDetected)
    assert "nothing of it was kept: run it again" in str(info.value)
    job = await orc.get_job(job_id)
    assert (job.payload["n"], job.revision) == (1, 0)  # the caller's transaction rolled back


async def test_batches_naming_the_same_keys_in_other_orders_take_turns(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = busy_app(make_orc, Counter())
    await orc.open()
    before = await deadlocks(db)
    keys = [f"key-{k}" for k in range(4)]
    for round_ in range(20):
        batches = [
            [{"job_type": "busy", "payload": {"n": round_}, "job_key": key} for key in order]
            for order in (keys, keys[::-1])
        ]
        await asyncio.gather(*(orc.submit_many(batch) for batch in batches))
    assert len(await orc.list_jobs(limit=100)) == len(keys)  # one job per key
    assert await deadlocks_after_closing(db, orc) == before


@pytest.mark.parametrize("mode", ["auto", "force_generic_plan"])
async def test_a_heartbeat_locks_its_jobs_in_id_order_as_completions_do(
    dsn: str, db: psycopg.AsyncConnection[Any], mode: str
) -> None:
    """With the lowest-id job's row held elsewhere, a heartbeat of twenty running jobs waits
    for it before locking any other: a batch of completions, which locks in id order too,
    never holds a row the heartbeat waits for while it waits for one the heartbeat holds (they
    deadlocked in the soak when the heartbeat locked in its plan's order)."""
    cur = await db.execute(
        "INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts, max_retries,"
        " trace_id, lease_token, locked_by, attempt, dispatch_attempt, heartbeat_at, started_at,"
        " deadline_at) SELECT gen_random_uuid(), 'beat', 'RUNNING', 'null', 'beat', 3, 3, 't',"
        " gen_random_uuid(), 'w', 1, 1, now(), now(), now() + interval '1 hour'"
        " FROM generate_series(1, 20) RETURNING id, lease_token"
    )
    leases = {token: job_id for job_id, token in await cur.fetchall()}
    lowest = min(leases.values())

    async def configure(conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute(f"SET plan_cache_mode = {mode}")
        conn.prepare_threshold = 0  # prepared at once: the generic plan, in that mode

    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn, min_size=1, max_size=1, open=False, configure=configure,
        kwargs={"row_factory": dict_row, "autocommit": True},
    )  # fmt: skip
    await pool.open(wait=True)
    liveness = Stores.on(pool).liveness
    try:
        for _ in range(6):  # past the plan cache's five custom plans
            await liveness.heartbeat(leases, zombie_threshold=60, expiry_grace=60)
        async with await psycopg.AsyncConnection.connect(dsn) as holder:
            await holder.execute("SELECT FROM orc_jobs WHERE id = %s FOR UPDATE", (lowest,))
            beat = asyncio.ensure_future(
                liveness.heartbeat(leases, zombie_threshold=60, expiry_grace=60)
            )
            await wait_for(lambda: waiting_for_a_row(db), timeout=10)
            others = [job_id for job_id in leases.values() if job_id != lowest]
            await holder.execute(
                "SELECT FROM orc_jobs WHERE id = ANY (%s) FOR UPDATE NOWAIT", (others,)
            )  # none of them locked by the heartbeat yet
            await holder.rollback()
            assert len(await beat) == 20
    finally:
        await pool.close()


async def waiting_for_a_row(db: psycopg.AsyncConnection[Any]) -> bool:
    cur = await db.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        " AND query LIKE '%%SET heartbeat_at%%'"
    )
    row = await cur.fetchone()
    return row is not None and row[0] > 0
