"""Flow control held by a fleet of worker processes on a real database (docs/flow-control.md):
fetches that meet many keys at once never deadlock; a limit removed, lowered or raised in the
retry config file applies to every worker, its waiters handed room or released; any change to
a pause reschedules its waiters, and the safety net's backstop covers a waiter whose time
passed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from orchestrator import Orchestrator
from tests.support import flow_app
from tests.support.harness import BASE_CONFIG, run_safety_net, wait_for
from tests.support.workers import WorkerProcess

APP = "tests.support.flow_app:orc"


async def deadlocks(dsn: str) -> int:
    """Deadlocks PostgreSQL detected in the test database, as its statistics say."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
        )
        row = await cur.fetchone()
        assert row is not None
        return int(row[0])


async def unfinished(db: psycopg.AsyncConnection[Any], ids: list[Any]) -> int:
    cur = await db.execute(
        "SELECT count(*) FROM orc_jobs WHERE id = ANY(%s) AND finished_at IS NULL", (ids,)
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def running_of(db: psycopg.AsyncConnection[Any], key: str) -> int:
    cur = await db.execute(
        "SELECT count(*) FROM orc_jobs WHERE flow_key = %s AND status = 'RUNNING'", (key,)
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def most_running(db: psycopg.AsyncConnection[Any], key: str, *, seconds: float) -> int:
    """The most jobs of ``key`` seen running at once, sampled for ``seconds``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    most = 0
    while loop.time() < end:
        most = max(most, await running_of(db, key))
        await asyncio.sleep(0.02)
    return most


# -- fetches across keys ----------------------------------------------------------------------


async def test_fetches_of_many_keys_on_many_workers_never_deadlock(
    dsn: str, make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    """Three workers of 25 slots, rounds of jobs of eight keys in turn (each key two at once):
    each fetch meets several keys, parks most of their jobs and admits others, while the
    workers' completions pump the keys. PostgreSQL's statistics for the test database count
    no deadlock (one worker's fetch used to take its keys' locks in the order of its dispatches,
    another's in another order)."""
    env = {"ORCHESTRATOR_RETRY_CONFIG": flow_app.CONFIG, "ORCHESTRATOR_WORKER_CONCURRENCY": 25}
    orc = make_orc(retry_config=flow_app.CONFIG)
    flow_app.register(orc)
    await orc.open()
    before = await deadlocks(dsn)
    with contextlib.ExitStack() as stack:
        for _ in range(3):
            stack.enter_context(WorkerProcess(dsn, APP, **env))
        for _ in range(4):
            ids = [
                await orc.submit("hold", {"pool": f"p{i % 8}", "seconds": 0.01}) for i in range(150)
            ]
            await wait_for(lambda ids=ids: _none_left(db, ids), timeout=120)
    # (the workers' connections are closed: their sessions' statistics are flushed)
    assert await deadlocks(dsn) == before


async def _none_left(db: psycopg.AsyncConnection[Any], ids: list[Any]) -> bool:
    return await unfinished(db, ids) == 0


# -- a limit changed in the file --------------------------------------------------------------

HELD = """
[limits.held]
key = "hold:{payload.pool}"
@ALLOWANCE@

[job_types.hold]
limit = "held"
"""


def held(path: Path, allowance: str | None) -> None:
    """The retry config at ``path``: the tests' base, with the ``held`` limit of this
    allowance (None: no limit)."""
    table = "" if allowance is None else HELD.replace("@ALLOWANCE@", allowance)
    path.write_text(BASE_CONFIG.read_text() + table)


def reloading(path: Path) -> dict[str, Any]:
    return {"ORCHESTRATOR_RETRY_CONFIG": path, "ORCHESTRATOR_RETRY_CONFIG_POLL_SECONDS": "0.2"}


async def test_a_limit_raised_then_removed_in_the_file_applies_to_every_worker(
    dsn: str, tmp_path: Path, make_orc: Callable[..., Orchestrator],
    db: psycopg.AsyncConnection[Any],
) -> None:  # fmt: skip
    """Two worker processes reloading the file, 60 jobs of a second on one key: at
    concurrency 1 they run one at a time; raised to 3, three at a time and never more; the
    limit removed, more at once, and the key reports no limit (the sync used to keep the
    removed limit's row, which went on holding every worker, after a restart too)."""
    path = tmp_path / "retry_config.toml"
    held(path, "concurrency = 1")
    orc = make_orc(retry_config=path)
    flow_app.register(orc)
    await orc.open()
    # Enough that jobs still wait when the limit goes, however slowly a loaded machine reloads
    # (30 drained, 3 at a time, before a worker saw the removal, once).
    hold = {"job_type": "hold", "payload": {"pool": "r", "seconds": 1}}
    ids = await orc.submit_many([hold] * 60)
    seen: list[int] = []

    async def running(at_least: int) -> bool:
        seen.append(await running_of(db, "hold:r"))
        return seen[-1] >= at_least

    with contextlib.ExitStack() as stack:
        for _ in range(2):
            stack.enter_context(WorkerProcess(dsn, APP, **reloading(path)))
        await wait_for(lambda: running(1), timeout=30)
        assert await most_running(db, "hold:r", seconds=1) == 1
        held(path, "concurrency = 3")
        await wait_for(lambda: running(3), timeout=15)
        assert await most_running(db, "hold:r", seconds=1) <= 3
        held(path, None)
        await wait_for(lambda: running(4), timeout=15)
        [key] = await orc.flow_keys("hold:r")
        assert key.concurrency is None and key.limit_name == "held"
        await wait_for(lambda: _none_left(db, ids), timeout=30)


async def test_a_limit_removed_while_no_worker_runs_holds_nothing_once_one_starts(
    dsn: str, tmp_path: Path, make_orc: Callable[..., Orchestrator],
    db: psycopg.AsyncConnection[Any],
) -> None:  # fmt: skip
    """A worker stops while jobs wait at concurrency 1; the limit is removed from the file;
    the worker started again on it runs the waiting jobs at once, several at a time. The first
    is killed: it counts as live (its registry entry fresh) until it has been silent
    ORCHESTRATOR_STALLED_WORKER_SECONDS, and a withdrawal waits for the live peers that declare
    otherwise (docs/applications.md): 3 s here."""
    path = tmp_path / "retry_config.toml"
    held(path, "concurrency = 1")
    orc = make_orc(retry_config=path)
    flow_app.register(orc)
    await orc.open()
    ids = [await orc.submit("hold", {"pool": "s", "seconds": 0.5}) for _ in range(12)]
    quick = {"ORCHESTRATOR_STALLED_WORKER_SECONDS": "3"}
    with WorkerProcess(dsn, APP, **reloading(path), **quick):
        await wait_for(lambda: _waiting(db, "hold:s", 11), timeout=30)
    held(path, None)
    seen: list[int] = []

    async def several() -> bool:
        seen.append(await running_of(db, "hold:s"))
        return seen[-1] >= 2

    with WorkerProcess(dsn, APP, **reloading(path), **quick):
        await wait_for(several, timeout=30)
        await wait_for(lambda: _none_left(db, ids), timeout=30)
    [key] = await orc.flow_keys("hold:s")
    assert key.concurrency is None


async def _waiting(db: psycopg.AsyncConnection[Any], key: str, n: int) -> bool:
    cur = await db.execute("SELECT count(*) FROM orc_flow_waiters WHERE key = %s", (key,))
    row = await cur.fetchone()
    return row is not None and row[0] >= n


# -- a pause changed --------------------------------------------------------------------------


async def _paused_waiters(orc: Orchestrator, db: psycopg.AsyncConnection[Any], pool: str,
                          n: int) -> list[Any]:  # fmt: skip
    """``n`` jobs of ``hold:<pool>`` waiting for the key's pause (an hour long), the key having
    run one job first (a key exists once a job of it was claimed)."""
    first = await orc.submit("hold", {"pool": pool, "seconds": 0})
    await wait_for(lambda: _none_left(db, [first]), timeout=30)
    await orc.pause_flow_key(f"hold:{pool}", seconds=3600, reason="incident", by="test")
    ids = [await orc.submit("hold", {"pool": pool, "seconds": 0}) for _ in range(n)]

    async def paused() -> bool:
        jobs = [await orc.get_job(i) for i in ids]
        return all(j.waiting_for is not None and "paused until" in j.waiting_for for j in jobs)

    await wait_for(paused, timeout=30)
    return ids


async def test_a_shortened_pause_starts_its_waiters_at_its_new_end(
    dsn: str, make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    """Paused for an hour with three jobs waiting (each sent for the pause's end), then paused
    again for a second: on two worker processes the three start soon after it ends (they used
    to keep the hour's end)."""
    orc = make_orc(retry_config=flow_app.CONFIG)
    flow_app.register(orc)
    await orc.open()
    with contextlib.ExitStack() as stack:
        for _ in range(2):
            stack.enter_context(WorkerProcess(dsn, APP, ORCHESTRATOR_RETRY_CONFIG=flow_app.CONFIG))
        ids = await _paused_waiters(orc, db, "q", 3)
        await orc.pause_flow_key("hold:q", seconds=1, reason="shorter", by="test")
        await wait_for(lambda: _none_left(db, ids), timeout=15)
        await orc.pause_flow_key("hold:q", seconds=3600, reason="again", by="test")
        later = [await orc.submit("hold", {"pool": "q", "seconds": 0}) for _ in range(2)]
        await wait_for(lambda: _waiting(db, "hold:q", 2), timeout=15)
        await orc.resume_flow_key("hold:q")
        await wait_for(lambda: _none_left(db, later), timeout=15)


@pytest.mark.parametrize("lost", ["shortened", "dispatch"])
async def test_the_backstop_starts_waiters_whose_time_was_lost(
    lost: str, dsn: str, make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    """The safety net's backstop covers waiters that already have a time: a pause shortened
    by a writer that did not reschedule them (the release before's pause), and a waiter whose
    time passed a while ago and whose dispatch is gone."""
    orc = make_orc(retry_config=flow_app.CONFIG)
    flow_app.register(orc)
    await orc.open()
    with WorkerProcess(dsn, APP, ORCHESTRATOR_RETRY_CONFIG=flow_app.CONFIG):
        ids = await _paused_waiters(orc, db, "b", 2)
        if lost == "shortened":
            await db.execute("UPDATE orc_flow_keys SET paused_until = now() WHERE key = 'hold:b'")
        else:
            await db.execute(
                "DELETE FROM procrastinate_jobs WHERE id IN (SELECT procrastinate_job_id"
                " FROM orc_jobs WHERE id = ANY(%s))", (ids,),
            )  # fmt: skip
            await db.execute(
                "UPDATE orc_flow_keys SET paused_until = NULL WHERE key = 'hold:b';"
                " UPDATE orc_flow_waiters SET dispatched_at = now() - interval '2 minutes'"
                " WHERE key = 'hold:b'"
            )
        await run_safety_net(orc)
        await wait_for(lambda: _none_left(db, ids), timeout=15)
