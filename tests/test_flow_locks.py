"""Flow key locks in one order (docs/flow-control.md, "Key locks in one order"), on a real
database: batches of completions, and a sweep of zombies, that meet keys in opposite orders take
turns instead of deadlocking, and worker processes finishing and sweeping jobs across many keys
at once cause no deadlock that PostgreSQL counts.

Each job leaving RUNNING pumps its key's line under the key's lock (orc_flow_release_v1). Before
migration 0053 a batch took each key's lock as its row was written: two batches writing jobs of
keys A, B and B, A each held one key and waited for the other."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any
from uuid import UUID

import psycopg
from psycopg.types.json import Jsonb

from orchestrator import ErrorClass, Orchestrator, Status
from orchestrator.domain import states
from orchestrator.domain.events import Fault
from orchestrator.domain.failures import DispatchEnd
from orchestrator.domain.models import JobState
from orchestrator.storage.queries import QUERIES
from tests.support import flow_app, log_guard
from tests.support.harness import run_sweep, wait_for
from tests.support.workers import WorkerProcess

APP = "tests.support.flow_app:orc"


async def deadlocks_once_alone(db: psycopg.AsyncConnection[Any]) -> int:
    """The deadlocks PostgreSQL counted in the test database, once every other connection has
    gone (a backend sends its statistics before it leaves pg_stat_activity)."""

    async def alone() -> bool:
        cur = await db.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        row = await cur.fetchone()
        return row is not None and row[0] == 0

    await wait_for(alone, timeout=30)
    await db.execute("SELECT pg_stat_clear_snapshot()")
    cur = await db.execute(
        "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def count(db: psycopg.AsyncConnection[Any], sql: str, *args: Any) -> int:
    cur = await db.execute(sql, args)
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def pid_of(conn: psycopg.AsyncConnection[Any]) -> int:
    cur = await conn.execute("SELECT pg_backend_pid()")
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def blocked_by(db: psycopg.AsyncConnection[Any], pid: int) -> bool:
    """Whether some backend waits for a lock ``pid`` holds."""
    sql = "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY (pg_blocking_pids(pid))"
    return await count(db, sql, pid) > 0


# -- two keys, each with two jobs running and a line of waiters -------------------------------


async def running_on_two_keys(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any], dsn: str
) -> dict[str, list[UUID]]:
    """Two jobs running on each of the keys hold:a and hold:b (their concurrency), submitted
    a, b, b, a (so in that id order), held by a worker process that is then killed (their
    leases and doing dispatches stay), and three waiters in each key's line."""
    env = {"ORCHESTRATOR_RETRY_CONFIG": flow_app.CONFIG, "ORCHESTRATOR_WORKER_CONCURRENCY": 10,
           "ORCHESTRATOR_ZOMBIE_THRESHOLD": 3600}  # fmt: skip
    running: dict[str, list[UUID]] = {"a": [], "b": []}
    with WorkerProcess(dsn, APP, **env):
        for pool in "abba":
            running[pool].append(await orc.submit("hold", {"pool": pool, "seconds": 3600}))
            await asyncio.sleep(0.002)  # ids are time-ordered
        all_running = [*running["a"], *running["b"]]
        await wait_for(lambda: _all(db, "status = 'RUNNING'", all_running), timeout=60)
        waiters = [await orc.submit("hold", {"pool": pool, "seconds": 0}) for pool in "ab" * 3]
        await wait_for(lambda: _lined_up(db, waiters), timeout=60)
    return running


async def _all(db: psycopg.AsyncConnection[Any], where: str, ids: list[UUID]) -> bool:
    n = await count(db, f"SELECT count(*) FROM orc_jobs WHERE id = ANY (%s) AND {where}", ids)
    return n == len(ids)


async def _lined_up(db: psycopg.AsyncConnection[Any], ids: list[UUID]) -> bool:
    n = await count(
        db, "SELECT count(*) FROM orc_flow_waiters WHERE job_id = ANY (%s)"
        " AND dispatched_at IS NULL", ids,
    )  # fmt: skip
    return n == len(ids)


async def complete(conn: psycopg.AsyncConnection[Any], job_ids: list[UUID]) -> list[bool]:
    """The worker's group commit of these jobs' completions, as one batch: the statement
    DispatchStore.complete runs, its items in job-id order."""
    cur = await conn.execute(
        "SELECT id, lease_token, procrastinate_job_id FROM orc_jobs WHERE id = ANY (%s)"
        " ORDER BY id", (job_ids,),
    )  # fmt: skip
    items = [
        {"ord": i, "job_id": str(job_id), "lease_token": str(lease), "result": None,
         "event": {"attempt": 1}, "procrastinate_job_id": dispatch, "delete_dispatch": False}
        for i, (job_id, lease, dispatch) in enumerate(await cur.fetchall())
    ]  # fmt: skip
    cur = await conn.execute(
        QUERIES["complete_jobs"],
        {"items": Jsonb(items), "target": Status.COMPLETED.value,
         "sources": states.sources_of(Status.COMPLETED)},
    )  # fmt: skip
    return [bool(row[1]) for row in await cur.fetchall()]


async def racing(
    dsn: str,
    db: psycopg.AsyncConnection[Any],
    held: UUID,
    first: Callable[[psycopg.AsyncConnection[Any]], Awaitable[Any]],
    second: Callable[[], Awaitable[Any]],
) -> tuple[Any, Any]:
    """``first`` (on a connection of its own) runs until it waits for the job ``held``, whose
    row another transaction holds; then ``second`` runs until it waits for ``first`` or ends;
    then ``held`` is let go. What each returned (a deadlock raises from its victim)."""
    async with (
        await psycopg.AsyncConnection.connect(dsn) as holder,
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn,
    ):
        holder_pid, conn_pid = await pid_of(holder), await pid_of(conn)
        await holder.execute("SELECT FROM orc_jobs WHERE id = %s FOR UPDATE", (held,))
        one = asyncio.ensure_future(first(conn))
        await wait_for(lambda: blocked_by(db, holder_pid), timeout=20)
        two = asyncio.ensure_future(second())

        async def second_waits_or_ended() -> bool:
            return two.done() or await blocked_by(db, conn_pid)

        await wait_for(second_waits_or_ended, timeout=20)
        await holder.rollback()
        return await asyncio.wait_for(asyncio.gather(one, two), timeout=30)


async def test_completion_batches_meeting_two_keys_in_opposite_orders_take_turns(
    make_orc: Callable[..., Orchestrator], dsn: str, db: psycopg.AsyncConnection[Any]
) -> None:
    """One batch completes a job of key a, then one of key b (their id order); another, a job
    of b, then one of a. With the first's second job held elsewhere, each batch used to hold
    its first key (its release pumped it) and wait: the first for b, the second for a."""
    before = await deadlocks_once_alone(db)
    orc = make_orc(retry_config=flow_app.CONFIG)
    flow_app.register(orc)
    await orc.open()
    running = await running_on_two_keys(orc, db, dsn)
    (a1, a2), (b1, b2) = running["a"], running["b"]
    assert a1 < b1 < b2 < a2  # batch one meets a then b; batch two b then a

    async def second() -> list[bool]:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            return await complete(conn, [b2, a2])

    one, two = await racing(dsn, db, b1, lambda conn: complete(conn, [a1, b1]), second)
    assert (one, two) == ([True, True], [True, True])
    # each release handed its slot to the next waiter of its key
    assert await count(db, "SELECT count(*) FROM orc_flow_waiters WHERE dispatched_at IS NULL") == 2
    await orc.close()
    assert await deadlocks_once_alone(db) == before


async def test_a_sweep_of_zombies_racing_a_completion_across_keys_takes_turns(
    make_orc: Callable[..., Orchestrator], dsn: str, db: psycopg.AsyncConnection[Any]
) -> None:
    """A batch completes a job of key a, then one of key b, while the zombie sweep takes a
    zombie of b, then one of a (the oldest heartbeat first). With the batch's second job held
    elsewhere, the sweep used to take b and wait for a, which the batch held while it waited
    for b. The sweep takes its keys at once, in one order, before writing any job."""
    before = await deadlocks_once_alone(db)
    orc = make_orc(retry_config=flow_app.CONFIG)
    flow_app.register(orc)
    await orc.open()
    running = await running_on_two_keys(orc, db, dsn)
    (a1, a2), (b1, b2) = running["a"], running["b"]
    await db.execute(
        "UPDATE orc_jobs SET heartbeat_at = CASE id WHEN %s THEN now() - interval '2 hours'"
        " WHEN %s THEN now() - interval '1 hour' ELSE now() + interval '1 hour' END"
        " WHERE id = ANY (%s)", (b2, a2, [a1, a2, b1, b2]),
    )  # fmt: skip
    completed, swept = await racing(
        dsn, db, b1, lambda conn: complete(conn, [a1, b1]), lambda: run_sweep(orc)
    )
    assert (completed, swept) == ([True, True], 2)
    assert {(await orc.get_job(j)).status for j in (a2, b2)} == {Status.RETRY}
    await orc.close()
    assert await deadlocks_once_alone(db) == before


async def lock_id(db: psycopg.AsyncConnection[Any], key: str) -> int:
    """The key's advisory lock (orc_flow_lock_v1's)."""
    return await count(db, "SELECT hashtextextended('orc_flow_key:' || %s, 0)", key)


async def free(db: psycopg.AsyncConnection[Any], lock: int) -> bool:
    """Whether no transaction holds the advisory lock ``lock`` (taken and let go at once)."""
    async with db.transaction():
        cur = await db.execute("SELECT pg_try_advisory_xact_lock(%s)", (lock,))
        row = await cur.fetchone()
        assert row is not None
        return bool(row[0])


async def keyed_by_lock_id(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any], dsn: str
) -> tuple[Orchestrator, dict[str, list[UUID]], dict[str, int]]:
    """An open orchestrator and the jobs running on the two keys (running_on_two_keys), with
    the keys' advisory locks, each named by its place in lock-id order: "low" and "high"."""
    orc = make_orc(retry_config=flow_app.CONFIG)
    flow_app.register(orc)
    await orc.open()
    running = await running_on_two_keys(orc, db, dsn)
    locks = {pool: await lock_id(db, f"hold:{pool}") for pool in "ab"}
    low, high = sorted("ab", key=locks.__getitem__)
    return (
        orc,
        {"low": running[low], "high": running[high]},
        {"low": locks[low], "high": locks[high]},
    )


async def test_a_sweep_or_a_batch_waiting_for_a_key_holds_no_other(
    make_orc: Callable[..., Orchestrator], dsn: str, db: psycopg.AsyncConnection[Any]
) -> None:
    """The rule itself, without a second writer to race: with the key of lower lock id held
    elsewhere, a sweep of a zombie of each key (the other key's the oldest), then a batch
    completing a job of each key (the other key's first in id order), waits for it holding no
    key. Before, each took the other key as it wrote that job, then waited holding it."""
    orc, running, locks = await keyed_by_lock_id(make_orc, db, dsn)
    (high_0, high_1), (low_0, low_1) = running["high"], running["low"]
    zombies = [high_1, low_0]  # the high key's the oldest: the sweep writes it first
    await db.execute(
        "UPDATE orc_jobs SET heartbeat_at = CASE id WHEN %s THEN now() - interval '2 hours'"
        " WHEN %s THEN now() - interval '1 hour' ELSE now() + interval '1 hour' END"
        " WHERE id = ANY (%s)", (*zombies, [high_0, high_1, low_0, low_1]),
    )  # fmt: skip
    batch = [high_0, low_1]
    assert high_0 < low_1  # the batch writes the high key's job first
    for writer in (lambda: run_sweep(orc), lambda: _complete_alone(dsn, batch)):
        await waits_holding_no_other_key(dsn, db, wanted=locks["low"], other=locks["high"],
                                         writer=writer)  # fmt: skip
    assert {(await orc.get_job(j)).status for j in zombies} == {Status.RETRY}
    assert {(await orc.get_job(j)).status for j in batch} == {Status.COMPLETED}


@log_guard.fails_jobs("TEST_GONE")  # both jobs, failed for good with nobody to tell
async def test_a_batch_of_terminal_failures_waiting_for_a_key_holds_no_other(
    make_orc: Callable[..., Orchestrator], dsn: str, db: psycopg.AsyncConnection[Any]
) -> None:
    """The same rule for the failure batch (orc_fail_jobs_v1, every terminal failure's path):
    a job of each key failed for good in one batch, the key of higher lock id's job first, with
    the other key held elsewhere, waits holding no key; then both are FAILED, and each key's
    release pumped its line."""
    orc, running, locks = await keyed_by_lock_id(make_orc, db, dsn)
    batch = [running["high"][0], running["low"][1]]
    assert batch[0] < batch[1]  # the batch writes the high key's job first
    fault = Fault("gone for good", "TEST_GONE", ErrorClass.PERMANENT)
    failures = []
    for job_id in batch:
        held = JobState.model_validate(dict(await orc.get_job(job_id)))  # its lease too
        dispatch = DispatchEnd(await count(db, DISPATCH_OF, job_id), "succeeded")
        failures.append(orc.failures.terminal(held, fault, dispatch=dispatch))
    letters = await waits_holding_no_other_key(
        dsn, db, wanted=locks["low"], other=locks["high"],
        writer=lambda: orc.stores.jobs.fail(failures),
    )  # fmt: skip
    assert None not in letters
    assert {(await orc.get_job(j)).status for j in batch} == {Status.FAILED}
    assert await count(db, "SELECT count(*) FROM orc_flow_waiters WHERE dispatched_at IS NULL") == 4
    await orc.close()


DISPATCH_OF = "SELECT procrastinate_job_id FROM orc_jobs WHERE id = %s"


async def waits_holding_no_other_key(
    dsn: str,
    db: psycopg.AsyncConnection[Any],
    *,
    wanted: int,
    other: int,
    writer: Callable[[], Awaitable[Any]],
) -> Any:
    """``writer`` runs while another transaction holds the key lock ``wanted``: once it waits,
    the lock ``other`` must be free (it waits for one key holding none). What it returned."""
    async with await psycopg.AsyncConnection.connect(dsn) as holder:
        holder_pid = await pid_of(holder)
        await holder.execute("SELECT pg_advisory_xact_lock(%s)", (wanted,))
        task = asyncio.ensure_future(writer())
        await wait_for(lambda: blocked_by(db, holder_pid), timeout=20)
        try:
            assert await free(db, other), "it waits for one key while holding another"
        finally:
            await holder.rollback()
        return await asyncio.wait_for(task, timeout=30)


async def _complete_alone(dsn: str, job_ids: list[UUID]) -> list[bool]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        return await complete(conn, job_ids)


# -- a fleet ----------------------------------------------------------------------------------


async def test_worker_processes_finishing_and_sweeping_jobs_of_many_keys_never_deadlock(
    make_orc: Callable[..., Orchestrator], empty_dsn: str, db: psycopg.AsyncConnection[Any]
) -> None:
    """Three worker processes of 20 slots run rounds of short jobs over twelve keys (each two at
    once, the rest in line): their completions go in batches across keys, each release pumping
    its key. One worker is killed mid-round: the others' sweeps retry its jobs, across keys,
    and their safety nets redispatch those it had fetched but not claimed, while they complete
    their own. PostgreSQL counts no deadlock in the test database."""
    dsn = empty_dsn
    before = await deadlocks_once_alone(db)
    env = {"ORCHESTRATOR_RETRY_CONFIG": flow_app.CONFIG, "ORCHESTRATOR_WORKER_CONCURRENCY": 20,
           # The killed worker also leaves dispatches it fetched but had not claimed yet (their
           # claims left for later): the safety net gives those jobs new dispatches once the
           # worker is silent this long, here within seconds rather than the minute or so of
           # the defaults (30 s, a run a minute).
           "ORCHESTRATOR_STALLED_WORKER_SECONDS": 3, "ORCHESTRATOR_SAFETY_NET_CRON": "* * * * * *",
           "ORCHESTRATOR_SAFETY_NET_GRACE_SECONDS": 1}  # fmt: skip
    orc = make_orc(retry_config=flow_app.CONFIG)
    flow_app.register(orc)
    await orc.open()
    with contextlib.ExitStack() as stack:
        workers = [stack.enter_context(WorkerProcess(dsn, APP, **env)) for _ in range(3)]
        for round_ in range(3):
            seconds = 1.0 if round_ == 1 else 0.02
            ids = await orc.submit_many(
                {"job_type": "hold", "payload": {"pool": f"p{i % 12}", "seconds": seconds}}
                for i in range(240)
            )
            if round_ == 1:  # its jobs of several keys running become zombies
                pid = workers[0].pid
                await wait_for(lambda pid=pid: _runs_on_several_keys(db, pid), timeout=60)
                workers.pop(0).stop()
            await wait_for(lambda ids=ids: _all(db, "finished_at IS NOT NULL", ids), timeout=180)
    await orc.close()
    assert await deadlocks_once_alone(db) == before


async def _runs_on_several_keys(db: psycopg.AsyncConnection[Any], pid: int) -> bool:
    keys = await count(
        db, "SELECT count(DISTINCT flow_key) FROM orc_jobs WHERE status = 'RUNNING'"
        " AND locked_by LIKE %s", f"%/{pid}/%",
    )  # fmt: skip
    return keys >= 2
