"""A database outage under a working worker: the server (one of the test's own) is stopped and
started again while a real worker process (the CLI) runs jobs. The worker stays alive (its
liveness probe answers), says it is not ready while the database is away, takes up its work
again when it is back, and every job completes; SIGTERM still ends it with 0."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import re
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import psycopg
import pytest

from orchestrator import JobContext, Orchestrator, Status
from orchestrator.interfaces.watch import EventWatch
from orchestrator.runtime.wakeups import Wakeups
from orchestrator.storage.database import Pool, create_pool
from orchestrator.storage.migrate import migrate
from orchestrator.storage.queries import QUERIES
from tests.support import agent_app
from tests.support.cluster import Cluster
from tests.support.exposition import samples, value
from tests.support.external import MessageService, message_service
from tests.support.harness import WorkerRun, config_with, free_port, probe, settings_for_tests
from tests.support.workers import WorkerProcess


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[Cluster, str]]:
    server = Cluster(tmp_path)
    dsn = server.start()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE DATABASE outage")
    dsn = dsn.replace("/postgres?", "/outage?")
    try:
        yield server, dsn
    finally:
        server.stop()


@pytest.fixture
def service() -> Iterator[MessageService]:
    with message_service() as svc:
        yield svc


async def eventually(
    condition: Callable[[], Awaitable[bool]], timeout: float = 30, what: str = ""
) -> None:
    """Poll ``condition``; a connection lost to the outage counts as "not yet"."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if await condition():
                return
        except psycopg.OperationalError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.1)


async def statuses(orc: Orchestrator, job_ids: list[UUID]) -> list[Status]:
    return [(await orc.get_job(job_id)).status for job_id in job_ids]


async def agents_on(dsn: str) -> Orchestrator:
    """An orchestrator of the agent job type on ``dsn``, migrated (not opened)."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await migrate(conn)
    orc = Orchestrator(
        settings=settings_for_tests(retry_config=config_with(agent_app.TABLE)), dsn=dsn
    )
    agent_app.register(orc)
    return orc


async def ride_through(
    cluster: tuple[Cluster, str], service: MessageService, outage_seconds: float
) -> None:
    server, dsn = cluster
    orc = await agents_on(dsn)
    port = free_port()
    plan: dict[str, Any] = {"service": service.url, "steps": 3, "send_at": [], "step_seconds": 0.3}
    env = {"ORCHESTRATOR_HEALTH_PORT": port, "ORCHESTRATOR_DRAIN_SECONDS": 5}
    with WorkerProcess(dsn, **env) as worker:
        async with orc:
            await eventually(lambda: _is(probe(port), 200), what="the worker is ready")
            job_ids = [await orc.submit("agent", plan) for _ in range(8)]
            await eventually(
                lambda: _some(statuses(orc, job_ids), Status.RUNNING), what="jobs running"
            )
        server.stop()
        down = time.monotonic()
        await eventually(lambda: _is(probe(port), 503), timeout=10, what="not ready")
        while time.monotonic() - down < outage_seconds:
            assert await probe(port, "/healthz") == 200  # alive: no restart while it is away
            assert worker.process.poll() is None, worker.output()[-3000:]
            await asyncio.sleep(0.2)
        server.start()
        async with orc:
            await eventually(lambda: _is(probe(port), 200), what="ready again")
            try:
                await eventually(
                    lambda: _all(statuses(orc, job_ids), Status.COMPLETED),
                    timeout=60,
                    what="every job completed",
                )
            except AssertionError as exc:
                raise AssertionError(
                    f"{exc}: {await statuses(orc, job_ids)}\n{worker.output()[-6000:]}"
                ) from None
            later = await orc.submit("agent", plan)  # and it goes on taking work
            await eventually(lambda: _all(statuses(orc, [later]), Status.COMPLETED))
        assert worker.process.poll() is None
        worker.signal(signal.SIGTERM)
        code = await asyncio.to_thread(worker.wait)
        log = worker.output()
    assert code == 0, log[-3000:]
    assert "database unreachable" in log and "Traceback" not in log, log[-3000:]


async def _is(status: Awaitable[int | None], expected: int) -> bool:
    return await status == expected


async def _some(values: Awaitable[list[Status]], status: Status) -> bool:
    return status in await values


async def _all(values: Awaitable[list[Status]], status: Status) -> bool:
    return set(await values) == {status}


async def test_a_worker_rides_through_a_short_database_outage(
    cluster: tuple[Cluster, str], service: MessageService
) -> None:
    await ride_through(cluster, service, outage_seconds=3)


@pytest.mark.slow
async def test_a_worker_rides_through_a_long_database_outage(
    cluster: tuple[Cluster, str], service: MessageService
) -> None:
    await ride_through(cluster, service, outage_seconds=40)


async def test_a_heartbeat_whose_connection_is_killed_beats_again_on_a_new_one(
    make_orc: Callable[..., Orchestrator],
    db: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The heartbeat counts its silence itself (a worker cut off for most of the zombie
    # threshold stops its jobs before the sweep hands them on): a lost connection is one of
    # its failures, never an error that ends its loop.
    orc = make_orc(heartbeat_interval=0.1, zombie_threshold=30, drain_seconds=0.2)
    release = asyncio.Event()

    @orc.job_type("hang")
    async def hang(ctx: JobContext, payload: None) -> None:
        await release.wait()

    async def heartbeat_at() -> Any:
        cur = await db.execute("SELECT heartbeat_at FROM orc_jobs WHERE id = %s", (job_id,))
        row = await cur.fetchone()
        return row[0] if row else None

    async with WorkerRun(orc):
        job_id = await orc.submit("hang")
        await eventually(lambda: _all(statuses(orc, [job_id]), Status.RUNNING))
        pids: list[tuple[int]] = []

        async def heartbeating() -> bool:
            cur = await db.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND query LIKE %s AND pid <> pg_backend_pid()",
                (QUERIES["heartbeat"][:40] + "%",),
            )
            pids[:] = await cur.fetchall()
            return bool(pids)

        await eventually(heartbeating, what="the heartbeat's connection")
        [(pid,)] = pids
        with caplog.at_level(logging.WARNING):
            await db.execute("SELECT pg_terminate_backend(%s)", (pid,))
            killed_at = (await (await db.execute("SELECT now()")).fetchone())[0]

            async def beating_again() -> bool:
                return bool(await heartbeat_at() > killed_at)

            await eventually(beating_again, timeout=5, what="a heartbeat after the kill")
        release.set()
    assert "heartbeat failed" in caplog.text, caplog.text
    assert "heartbeats failed" not in caplog.text, caplog.text  # its loop was never restarted


async def test_the_wake_up_listener_backs_off_while_the_server_is_away(
    cluster: tuple[Cluster, str], caplog: pytest.LogCaptureFixture
) -> None:
    # docs/operations.md: the listener reconnects after a delay that doubles up to 30 s, one
    # log line per attempt, rather than knocking on the server every second.
    server, dsn = cluster
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await migrate(conn)
    orc = Orchestrator(settings=settings_for_tests(), dsn=dsn)
    async with orc:
        wakeups = Wakeups(
            dsn=dsn, liveness=orc.stores.liveness, wake=lambda: None,
            notified=lambda channel, notification: None, refresh_interval=600,
        )  # fmt: skip
        with caplog.at_level(logging.WARNING, logger="orchestrator.runtime.wakeups"):
            task = asyncio.create_task(wakeups.run())
            try:
                await asyncio.sleep(0.5)  # listening
                server.stop()
                # attempts at 0, 1, 3 s: each line says the next delay, doubling (the outcome,
                # waited for: a loaded machine may log the third later than 3 s)
                await eventually(lambda: _attempts(caplog, 3), timeout=30)
                lines = _listener_lines(caplog)
                assert [delay for _, delay in lines[:3]] == ["1", "2", "4"], caplog.text
                assert lines[0][0] == "lost its connection", caplog.text
                server.start()
                await eventually(
                    lambda: _said(caplog, "wake-up listener: listening again"), timeout=20
                )
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
    # Each attempt is at least twice as far from the previous one as that one from its own.
    times = [r.created for r in caplog.records if r.getMessage().startswith("wake-up listener ")]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(later >= 1.8 * earlier for earlier, later in itertools.pairwise(gaps)), gaps


def _listener_lines(
    caplog: pytest.LogCaptureFixture, listener: str = "wake-up listener"
) -> list[tuple[str, str]]:
    found = []
    for record in caplog.records:
        match = re.match(
            rf"{listener} (lost its connection|still cannot connect) \(.*\); "
            r"reconnecting in (\d+) s$",
            record.getMessage(),
        )  # fmt: skip
        if match:
            found.append((match[1], match[2]))
    return found


async def test_the_api_s_event_listener_backs_off_while_the_server_is_away(
    cluster: tuple[Cluster, str], caplog: pytest.LogCaptureFixture
) -> None:
    # docs/operations.md: the API server's event listener (the waits' and streams' wake-ups)
    # reconnects after 1 s, doubling up to 10 s, one line per attempt.
    server, dsn = cluster
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await migrate(conn)
    orc = Orchestrator(settings=settings_for_tests(), dsn=dsn)
    async with orc:
        watch = EventWatch(dsn=dsn, listeners=orc.stores.listeners, role="api")
        with caplog.at_level(logging.WARNING, logger="orchestrator.watch"):
            task = asyncio.create_task(watch.run())
            try:
                await asyncio.sleep(0.5)  # listening
                server.stop()
                await eventually(lambda: _attempts(caplog, 3, "event listener"), timeout=30)
                lines = _listener_lines(caplog, "event listener")
                assert [delay for _, delay in lines[:3]] == ["1", "2", "4"], caplog.text
                server.start()
                await eventually(
                    lambda: _said(caplog, "event listener: listening again"), timeout=20
                )
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


async def _attempts(
    caplog: pytest.LogCaptureFixture, count: int, listener: str = "wake-up listener"
) -> bool:
    return len(_listener_lines(caplog, listener)) >= count


async def _said(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return text in caplog.text


#: How long a worker may take to claim and finish jobs again once the database is back: its
#: promise is to fetch within 5 s (docs/operations.md); the rest is for a loaded machine and the
#: job's own second. Before (issue 36, item 14), a worker could take half the outage: its slots
#: were held by the attempts it had abandoned until their outcomes were written, and its pool's
#: reconnect back-off had doubled past the database's return.
WORKS_AGAIN_WITHIN = 12.0
#: How long a statement that waited through an outage may wait for its connection once the
#: database is back: the pool connects within a second of its return (docs/operations.md); the
#: rest is for a loaded machine.
CONNECTED_AGAIN_WITHIN = 5.0


async def test_an_attempt_abandoned_in_an_outage_gives_its_slot_back_at_once(
    cluster: tuple[Cluster, str], service: MessageService
) -> None:
    """Every slot of a worker busy when the database goes away: its heartbeats fail, it
    abandons those attempts (after 80 % of the 1.5 s zombie threshold), and their slots are
    free again while the database is still away, not held until each one's end is written
    (which waits for the database); once it is back, the worker claims again at once."""
    server, dsn = cluster
    orc = await agents_on(dsn)
    port = free_port()
    plan = {"service": service.url, "steps": 1, "send_at": [], "step_seconds": 600}
    env = {
        "ORCHESTRATOR_HEALTH_PORT": port, "ORCHESTRATOR_WORKER_CONCURRENCY": 10,
        "ORCHESTRATOR_DRAIN_SECONDS": 1,
    }  # fmt: skip
    with WorkerProcess(dsn, **env) as worker:
        async with orc:
            await orc.submit_many([{"job_type": "agent", "payload": plan}] * 20)
            await eventually(lambda: _is(free_slots(port), 0), what="every slot busy")
        server.stop()
        try:
            await eventually(
                lambda: _is(free_slots(port), 10), timeout=10,
                what="every slot free again while the database is away",
            )  # fmt: skip
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_own_lines(worker.output())}") from None
        assert "abandoned: no heartbeat" in worker.output(), _own_lines(worker.output())
        server.start()
        back = await _started(dsn)
        try:
            await eventually(
                lambda: _in(worker.pid, _workers_since(dsn, back, "job.running")),
                timeout=WORKS_AGAIN_WITHIN, what="a claim once the database is back",
            )  # fmt: skip
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_own_lines(worker.output())}") from None


async def test_an_attempt_abandoned_while_it_commits_held_results_gives_its_slot_back(
    cluster: tuple[Cluster, str], service: MessageService
) -> None:
    """An attempt whose step holds a side effect's result when a write of the step fails (the
    database went away between two calls) ends by committing that result, which it tries again
    until the database takes it; abandoned meanwhile for lack of heartbeats (80 % of a 10 s
    zombie threshold), it stops trying and its slot is free while the database is still away
    (the result is reconciled by the job's next attempt, as after a crash)."""
    server, dsn = cluster
    orc = await agents_on(dsn)
    port = free_port()
    plan = {
        "service": service.url, "steps": 1, "send_at": [1], "second_send_after": 3,
        "step_seconds": 600,
    }  # fmt: skip
    env = {
        "ORCHESTRATOR_HEALTH_PORT": port, "ORCHESTRATOR_WORKER_CONCURRENCY": 4,
        "ORCHESTRATOR_ZOMBIE_THRESHOLD": 10, "ORCHESTRATOR_POOL_TIMEOUT": 1,
        "ORCHESTRATOR_DRAIN_SECONDS": 1,
    }  # fmt: skip
    with WorkerProcess(dsn, **env) as worker:
        async with orc:
            await orc.submit_many([{"job_type": "agent", "payload": plan}] * 4)
            await eventually(lambda: _is(_sent(service), 4), what="every first message sent")
        server.stop()  # before the second messages: each step's write of them fails
        try:
            await eventually(
                lambda: _is(free_slots(port), 4), timeout=20,
                what="every slot free again while the database is away",
            )  # fmt: skip
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_own_lines(worker.output())}") from None
        log = worker.output()
        assert "side effects: database unreachable" in log, _own_lines(log)


#: Lines a worker logs again and again while the database is away.
_REPEATED = ("psycopg.pool", "heartbeat failed", "due-time refresh failed", "Is the server")


def _own_lines(log: str) -> str:
    """The worker's last lines, without those it repeats through the outage."""
    lines = log.splitlines()
    return "\n".join(line for line in lines if not any(r in line for r in _REPEATED))[-4000:]


async def _sent(service: MessageService) -> int:
    return len(service.deliveries)


async def free_slots(port: int) -> int | None:
    """The free slots of a worker's jobs lane, as its /metrics says; None if it did not answer."""
    try:
        async with httpx.AsyncClient(timeout=2) as client:
            response = await client.get(f"http://127.0.0.1:{port}/metrics")
    except httpx.TransportError:
        return None
    return int(value(samples(response.text), "orchestrator_free_slots", lane="jobs"))


async def test_a_statement_waiting_through_an_outage_has_its_connection_once_it_ends(
    cluster: tuple[Cluster, str],
) -> None:
    """A statement (an outcome's write, say) that waits for a pooled connection while the
    database is away has one within CONNECTED_AGAIN_WITHIN of its return: the pool's attempts
    to connect stay about a second apart however long the outage, and go on while the
    statement waits, which started waiting before they were given up. (psycopg_pool's own
    back-off tries 1, 3, 7, 15 and 31 s after a loss, each ±10 %: the database is back some
    20 s after it, and the next attempt would come 7 to 14 s later.)"""
    server, dsn = cluster
    async with create_pool(dsn, min_size=2, max_size=4, timeout=120) as pool:
        await _a_statement(pool)
        server.stop()
        waiting = asyncio.create_task(_a_statement(pool))
        try:
            await asyncio.sleep(18)
            assert not waiting.done()
            server.start()
            try:
                async with asyncio.timeout(CONNECTED_AGAIN_WITHIN):
                    await waiting
            except TimeoutError:
                raise AssertionError(
                    f"no connection within {CONNECTED_AGAIN_WITHIN} s of the database's return:"
                    f" {pool.get_stats()}"
                ) from None
        finally:
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)


async def _a_statement(pool: Pool) -> None:
    """One statement on a pooled connection, tried again after an error (as until_written
    does): the first connections it is handed after a loss are the lost ones."""
    while True:
        try:
            async with pool.connection() as conn:
                await conn.execute("SELECT 1")
                return
        except psycopg.OperationalError:
            await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_after_an_outage_every_worker_works_again_at_once(
    cluster: tuple[Cluster, str], service: MessageService
) -> None:
    """Three workers of ten slots, every slot busy with jobs that checkpoint (through the pool),
    the database away for 40 s (past psycopg_pool's default reconnect attempt 31 s after the
    loss, long before the one at 63 s: the release before issue 36's fix claimed nothing for
    17 s after the return, the issue's third worker for 26.5 s): once it is back, each worker
    claims and finishes jobs again within WORKS_AGAIN_WITHIN."""
    server, dsn = cluster
    orc = await agents_on(dsn)
    plan = {"service": service.url, "steps": 3, "send_at": [], "step_seconds": 0.2}
    env = {"ORCHESTRATOR_DRAIN_SECONDS": 1, "ORCHESTRATOR_WORKER_CONCURRENCY": 10}
    with contextlib.ExitStack() as workers:
        pids = {workers.enter_context(WorkerProcess(dsn, **env)).pid for _ in range(3)}
        async with orc:
            await orc.submit_many([{"job_type": "agent", "payload": plan}] * 600)

            async def all_finishing() -> bool:
                return pids <= await _workers_since(dsn, "-infinity", "job.completed")

            await eventually(all_finishing, timeout=120, what="every worker finishing jobs")
        server.stop()
        await asyncio.sleep(40)
        server.start()
        back = await _started(dsn)
        for kind in ("job.running", "job.completed"):  # claims, then completions
            try:
                await eventually(
                    functools.partial(_all_since, pids, dsn, back, kind),
                    timeout=WORKS_AGAIN_WITHIN,
                )
            except AssertionError as exc:
                some = await _workers_since(dsn, back, kind)
                raise AssertionError(f"{exc}: {kind} of {sorted(some)} of {sorted(pids)}") from None


async def _started(dsn: str) -> str:
    """When the database's server started (by its clock): what was written since, was written
    once it was back (a worker may claim before the test could read the clock)."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute("SELECT pg_postmaster_start_time()")
        return str((await cur.fetchone())[0])


async def _in(pid: int, pids: Awaitable[set[int]]) -> bool:
    return pid in await pids


async def _all_since(pids: set[int], dsn: str, since: str, kind: str) -> bool:
    return pids <= await _workers_since(dsn, since, kind)


async def _workers_since(dsn: str, since: str, kind: str) -> set[int]:
    """The pids of the workers that wrote a ``kind`` event (their claims: job.running; their
    completions: job.completed) since ``since`` (the database's clock)."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT DISTINCT split_part(payload ->> 'worker', '/', 2)::int FROM orc_job_events"
            " WHERE kind = %s AND at >= %s::timestamptz",
            (kind, since),
        )
        return {row[0] for row in await cur.fetchall()}
