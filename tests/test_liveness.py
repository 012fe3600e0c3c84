"""Liveness with real worker processes and real signals: a frozen worker (SIGSTOP/SIGCONT), the
drain on SIGTERM (short jobs, a long job handed back, a second signal), and sweepers running
at once over a crowd of zombies left by a SIGKILLed worker. Intervals are shortened through the
environment (tests/support/workers.py), never by patching. (A SIGKILL mid-job, recovered from its
checkpoint: tests/test_crash.py.)"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any
from uuid import UUID

import psycopg
import pytest

from orchestrator import JobContext, Orchestrator, Status
from orchestrator.services.approvals import ExpiryResult
from orchestrator.services.prune import PruneResult
from orchestrator.services.safety_net import SafetyNetResult
from orchestrator.services.sweep import SweepResult
from orchestrator.storage.queries import QUERIES
from tests.support import agent_app
from tests.support.external import MessageService, message_service
from tests.support.harness import (
    WorkerRun,
    config_with,
    free_port,
    probe,
    run_sweep,
    wait_for,
)
from tests.support.workers import WorkerProcess


@pytest.fixture
def service() -> Iterator[MessageService]:
    with message_service() as svc:
        yield svc


@pytest.fixture
async def orc(make_orc: Callable[..., Orchestrator]) -> Orchestrator:
    """The test's own view of the database (it runs no worker)."""
    app = make_orc(
        retry_config=config_with(agent_app.TABLE), zombie_threshold=1.5, heartbeat_interval=0.2,
        sweep_limit=30,
    )  # fmt: skip
    agent_app.register(app)
    await app.open()
    return app


async def readyz(port: int) -> int | None:
    return await probe(port, "/readyz")


async def until(condition: Callable[[], Any], timeout: float = 30) -> None:
    async def check() -> bool:
        value = condition()
        return bool(await value if inspect.isawaitable(value) else value)

    await wait_for(check, timeout=timeout)


async def checkpoints(orc: Orchestrator, job_id: UUID) -> list[tuple[int, int]]:
    """(step, attempt) of each committed checkpoint."""
    return [
        (s["step"], s["attempt"]) for s in await orc.job_steps(job_id) if s["kind"] == "checkpoint"
    ]


async def exited(worker: WorkerProcess, timeout: float = 30) -> tuple[int, float]:
    """Exit code and seconds it took, waiting without blocking the event loop."""
    started = time.monotonic()
    code = await asyncio.to_thread(worker.wait, timeout)
    return code, time.monotonic() - started


# -- a frozen worker ----------------------------------------------------------------------------


async def test_a_frozen_worker_resumed_after_its_job_was_swept_writes_nothing(
    orc: Orchestrator, dsn: str, service: MessageService
) -> None:
    # step 2 is slow in the first attempt, and sends nothing: the worker freezes in its sleep
    plan = {"service": service.url, "steps": 3, "slow_step": 2, "send_at": [1, 3]}
    with WorkerProcess(dsn) as first:
        job_id = await orc.submit("agent", plan)
        await until(lambda: _committed(orc, job_id, 1))
        first.signal(signal.SIGSTOP)  # frozen in step 2: no heartbeats, no writes
        with WorkerProcess(dsn):
            # the second worker's sweep takes the job, and the second worker resumes it
            job = await _finished(orc, job_id)
            first.signal(signal.SIGCONT)
            await until(lambda: "cancelling it here" in first.output(), timeout=10)
            await asyncio.sleep(1.0)  # time for any stale write to land (none may)
            assert first.process.poll() is None  # the frozen worker lives on, healthy
        events = await orc.job_events(job_id)
        log = first.output()
    assert job.status is Status.COMPLETED and job.attempt == 2, log[-3000:]
    kinds = [e.kind for e in events]
    assert kinds.count("job.zombie_detected") == 1 and kinds.count("job.completed") == 1
    # everything after the zombie detection is the second attempt's
    detected = kinds.index("job.zombie_detected")
    assert all(e.payload.get("attempt", 2) == 2 for e in events[detected + 2 :])
    assert await checkpoints(orc, job_id) == [(1, 1), (2, 2), (3, 2)]
    assert service.duplicates() == {} and len(service.deliveries) == 2
    assert f"job {job_id} was handed to another attempt; cancelling it here" in log
    assert "stale write refused" not in log, log  # stopped before it tried to write anything
    assert (await orc.get_job(job_id)).status is Status.COMPLETED


async def _status_is(orc: Orchestrator, job_id: UUID, status: Status) -> bool:
    return (await orc.get_job(job_id)).status is status


async def _finished(orc: Orchestrator, job_id: UUID, timeout: float = 30) -> Any:
    await until(lambda: _has_finished(orc, job_id), timeout=timeout)
    return await orc.get_job(job_id)


async def _has_finished(orc: Orchestrator, job_id: UUID) -> bool:
    return (await orc.get_job(job_id)).finished_at is not None


# -- the drain ------------------------------------------------------------------------------------


async def test_sigterm_lets_short_jobs_finish_and_exits_0_well_before_the_deadline(
    orc: Orchestrator, dsn: str, service: MessageService
) -> None:
    plan = {"service": service.url, "steps": 3, "step_seconds": 0.4}
    with WorkerProcess(dsn, ORCHESTRATOR_DRAIN_SECONDS=30) as worker:
        job_ids = [await orc.submit("agent", plan) for _ in range(3)]
        await until(lambda: _all_status(orc, job_ids, Status.RUNNING))
        worker.signal(signal.SIGTERM)
        code, seconds = await exited(worker)
        log = worker.output()
    assert code == 0, log[-3000:]
    assert seconds < 10  # the jobs needed ~1.2 s; the deadline was 30 s
    for job_id in job_ids:
        job, events = await orc.get_job(job_id), await orc.job_events(job_id)
        assert (job.status, job.attempt, job.retry_count) == (Status.COMPLETED, 1, 0)
        assert "job.interrupted" not in [e.kind for e in events]
    assert "WARNING orchestrator.runtime.drain: SIGTERM: draining (3 job(s) running" in log


async def test_an_idle_worker_stops_without_a_warning(dsn: str) -> None:
    """Nothing running: a normal shutdown, logged at INFO."""
    with WorkerProcess(dsn) as worker:
        await until(lambda: "started: database" in worker.output())
        worker.signal(signal.SIGTERM)
        code, _ = await exited(worker)
        log = worker.output()
    assert code == 0, log[-3000:]
    assert "INFO orchestrator.runtime.drain: SIGTERM: draining (0 job(s) running" in log
    assert "WARNING" not in log and "ERROR" not in log, log


async def _all_status(orc: Orchestrator, job_ids: list[UUID], status: Status) -> bool:
    return all([(await orc.get_job(j)).status is status for j in job_ids])


async def test_sigterm_hands_a_long_job_back_at_the_deadline_and_another_worker_resumes_it(
    orc: Orchestrator, dsn: str, service: MessageService
) -> None:
    port, other_port = free_port(), free_port()
    # 12 steps of 1 s: the job still runs when the signal comes, however long the second
    # worker takes to be ready on a loaded machine (6 were done before it, once).
    plan = {"service": service.url, "steps": 12, "step_seconds": 1.0, "send_at": [2, 5]}
    with WorkerProcess(dsn, ORCHESTRATOR_DRAIN_SECONDS=2, ORCHESTRATOR_HEALTH_PORT=port) as first:
        await until(lambda: _equals(readyz(port), 200))
        job_id = await orc.submit("agent", plan)
        await until(lambda: _committed(orc, job_id, 1))
        # The other worker polls only every 60 s: only a wake-up can start the job in time.
        with WorkerProcess(
            dsn, ORCHESTRATOR_HEALTH_PORT=other_port, ORCHESTRATOR_FETCH_POLLING_INTERVAL=60
        ) as second:
            await until(lambda: _equals(readyz(other_port), 200))  # idle, ready for work
            first.signal(signal.SIGTERM)
            await until(lambda: _equals(readyz(port), 503), timeout=5)  # draining: not ready
            code, seconds = await exited(first)
            job = await _finished(orc, job_id)
            events = await orc.job_events(job_id)
        log = first.output()
    assert code == 0 and seconds < 2 + 5 + 1, log[-3000:]  # deadline + EXIT_GRACE, at worst
    assert job.status is Status.COMPLETED and job.result is not None
    assert job.retry_count == 0  # a hand-back spends no retry budget
    kinds = [e.kind for e in events]
    assert kinds.count("job.interrupted") == 1 and "job.zombie_detected" not in kinds
    interrupted = next(e for e in events if e.kind == "job.interrupted")
    resumed = next(e for e in events if e.kind == "job.running" and e.payload["attempt"] == 2)
    assert interrupted.payload["reason"] == "drain deadline"
    assert (resumed.at - interrupted.at).total_seconds() < 2  # woken, not polled
    assert f"/{second.pid}/" in resumed.payload["worker"]
    # resumed from its last checkpoint: every step committed once, none repeated
    steps = await checkpoints(orc, job_id)
    assert [s for s, _ in steps] == list(range(1, 13))
    assert {a for _, a in steps} == {1, 2} and steps[0] == (1, 1)
    assert service.duplicates() == {}


async def _equals(value: Any, expected: Any) -> bool:
    return (await value) == expected


async def _committed(orc: Orchestrator, job_id: UUID, step: int) -> bool:
    return any(s >= step for s, _ in await checkpoints(orc, job_id))


async def test_a_second_sigterm_exits_at_once_and_the_sweep_recovers_the_job(
    orc: Orchestrator, dsn: str, service: MessageService
) -> None:
    plan = {"service": service.url, "steps": 2, "slow_step": 1, "send_at": []}
    with WorkerProcess(dsn, ORCHESTRATOR_DRAIN_SECONDS=45) as first:
        job_id = await orc.submit("agent", plan)
        await until(lambda: _status_is(orc, job_id, Status.RUNNING))
        first.signal(signal.SIGTERM)
        await until(lambda: "draining" in first.output(), timeout=10)
        first.signal(signal.SIGTERM)
        code, seconds = await exited(first, timeout=10)
        assert code == 1 and seconds < 2, first.output()[-3000:]
    assert (await orc.get_job(job_id)).status is Status.RUNNING  # left for the sweep
    with WorkerProcess(dsn):
        job = await _finished(orc, job_id)
    kinds = [e.kind for e in await orc.job_events(job_id)]
    assert job.status is Status.COMPLETED and kinds.count("job.zombie_detected") == 1


# -- sweepers -------------------------------------------------------------------------------------


async def zombies(orc: Orchestrator, dsn: str, n: int) -> list[UUID]:
    """``n`` jobs left RUNNING by a worker killed with SIGKILL in the middle of them."""
    plan = {"service": "http://127.0.0.1:9", "steps": 1, "step_seconds": 60, "send_at": []}
    with WorkerProcess(dsn, ORCHESTRATOR_WORKER_CONCURRENCY=n) as worker:
        job_ids = await orc.submit_many([{"job_type": "agent", "payload": plan}] * n)
        await until(lambda: _all_status(orc, job_ids, Status.RUNNING))
        worker.signal(signal.SIGKILL)
        await exited(worker)
    await asyncio.sleep(1.6)  # past the zombie threshold (1.5 s)
    return job_ids


async def zombie_events(orc: Orchestrator, job_ids: list[UUID]) -> list[int]:
    counts = []
    for job_id in job_ids:
        kinds = [e.kind for e in await orc.job_events(job_id)]
        counts.append(kinds.count("job.zombie_detected"))
    return counts


async def test_two_sweepers_at_the_same_moment_process_each_zombie_exactly_once(
    orc: Orchestrator, make_orc: Callable[..., Orchestrator], dsn: str
) -> None:
    job_ids = await zombies(orc, dsn, 100)
    # small batches (one transaction each), so the two runs interleave and contend
    sweepers = [
        make_orc(zombie_threshold=1.5, heartbeat_interval=0.2, sweep_limit=100, sweep_batch_size=10)
        for _ in range(2)
    ]
    for sweeper in sweepers:
        await sweeper.open()
    done = await asyncio.gather(*(run_sweep(s) for s in sweepers))
    assert sum(done) == 100 and all(done), done  # both found zombies the other had not locked
    assert await zombie_events(orc, job_ids) == [1] * 100
    for job_id in job_ids:
        job = await orc.get_job(job_id)
        assert (job.status, job.retry_count, job.lease_token) == (Status.RETRY, 1, None)


async def test_a_per_run_limit_spreads_a_mass_recovery_over_several_runs(
    orc: Orchestrator, dsn: str
) -> None:
    job_ids = await zombies(orc, dsn, 100)
    runs = [await run_sweep(orc) for _ in range(5)]  # sweep_limit = 30
    assert runs == [30, 30, 30, 10, 0]
    assert await zombie_events(orc, job_ids) == [1] * 100


async def test_a_sweep_run_logs_what_it_did_in_a_sentence(
    orc: Orchestrator, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    # docs/operations.md, "Mass recovery": each run logs one warning in words, not a repr.
    await zombies(orc, dsn, 3)
    with caplog.at_level(logging.WARNING, logger="orchestrator.services.maintenance"):
        assert (await orc.maintenance.run("sweep_zombies")).handled == 3
        assert (await orc.maintenance.run("sweep_zombies")).handled == 0  # nothing: no line
    lines = [
        r.getMessage() for r in caplog.records if r.name == "orchestrator.services.maintenance"
    ]
    assert lines == ["sweep_zombies: zombie jobs recovered: 3 (3 retried, 0 failed, their budget "
                     "spent)"], lines  # fmt: skip


@pytest.mark.parametrize(
    ("result", "sentence"),
    [
        (SweepResult(2, 1, 0), "zombie jobs recovered: 3 (2 retried, 1 failed, their budget spent)"),
        (SweepResult(0, 0, 4), "zombie jobs recovered: 0 (0 retried, 0 failed, their budget "
         "spent); 4 passed over (refused even alone: tried again at the next run)"),
        (SafetyNetResult(5), "waiting jobs given a new dispatch: 5"),
        (SafetyNetResult(0, 1), "waiting jobs given a new dispatch: 0; 1 passed over (refused "
         "even alone: tried again at the next run)"),
        (ExpiryResult(7), "approvals expired: 7"),
        (PruneResult(9), "checkpoint and ledger rows of long-finished jobs deleted: 9"),
    ],
)  # fmt: skip
def test_each_maintenance_result_reads_as_a_sentence(result: Any, sentence: str) -> None:
    assert result.sentence() == sentence


async def test_the_sweep_query_uses_the_partial_index_among_100k_terminal_jobs(
    db: psycopg.AsyncConnection[Any],
) -> None:
    await db.execute(
        """
        INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts, max_retries,
                              trace_id, finished_at)
        SELECT gen_random_uuid(), 'agent', s, '{}', 'agent', 3, 3, 't', now()
          FROM generate_series(1, 100000) AS i,
               LATERAL (SELECT (ARRAY['COMPLETED', 'FAILED', 'CANCELLED'])[1 + i % 3] AS s) AS x
        """
    )
    await db.execute(
        """
        INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts, max_retries,
                              trace_id, lease_token, heartbeat_at, attempt)
        SELECT gen_random_uuid(), 'agent', 'RUNNING', '{}', 'agent', 3, 3, 't',
               gen_random_uuid(), now() - make_interval(secs => i), 1
          FROM generate_series(1, 50) AS i
        """
    )
    await db.execute("ANALYZE orc_jobs")
    explain = f"EXPLAIN {QUERIES['zombies']}"
    rows = await (
        await db.execute(
            explain, {"running": "RUNNING", "threshold": 300, "limit": 500, "passed_over": []}
        )
    ).fetchall()
    plan = "\n".join(row[0] for row in rows)
    assert "orc_jobs_running_heartbeat" in plan, plan
    assert "Seq Scan" not in plan, plan


# -- a heartbeat that meets its attempt's own outcome ----------------------------------------------


async def test_a_heartbeat_racing_its_attempts_own_outcome_warns_of_no_lost_lease(
    make_orc: Callable[..., Orchestrator],
    db: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The heartbeat takes the running leases, then its statement meets a row whose lease the
    # attempt's own completion ended a moment before: not a lease lost to another attempt.
    # The test holds the job's row so that the completion waits first and the heartbeat
    # behind it; both then run in that order.
    orc = make_orc(heartbeat_interval=1.0, zombie_threshold=30, drain_seconds=0.2)
    release = asyncio.Event()

    @orc.job_type("quick")
    async def quick(ctx: JobContext, payload: None) -> str:
        await release.wait()
        return "done"

    async def waiting_on_the_row() -> list[str]:
        cur = await db.execute(
            "SELECT query FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' ORDER BY query_start"
        )
        return [row[0] for row in await cur.fetchall()]

    async with WorkerRun(orc):
        job_id = await orc.submit("quick")
        await until(lambda: _all_status(orc, [job_id], Status.RUNNING))
        heartbeats = orc.workers[0].heartbeats
        beats = heartbeats.beats
        await until(lambda: heartbeats.beats > beats)  # the next tick is a second away
        with caplog.at_level(logging.DEBUG, logger="orchestrator.runtime.heartbeat"):
            async with await psycopg.AsyncConnection.connect(db.info.dsn) as holder:
                await holder.execute("SELECT 1 FROM orc_jobs WHERE id = %s FOR UPDATE", (job_id,))
                release.set()
                await until(lambda: _count(waiting_on_the_row(), 1))  # the completion
                await until(lambda: _count(waiting_on_the_row(), 2))  # then the heartbeat
                first, second = await waiting_on_the_row()
                assert "orc_complete_jobs" in first and "heartbeat_at = least" in second
            await until(lambda: _all_status(orc, [job_id], Status.COMPLETED))
            await asyncio.sleep(0.5)  # the heartbeat's answer, and a tick after it
    assert "handed to another attempt" not in caplog.text, caplog.text
    assert f"job {job_id}: its own outcome ended its lease" in caplog.text, caplog.text


async def _count(values: Awaitable[list[str]], n: int) -> bool:
    return len(await values) == n
