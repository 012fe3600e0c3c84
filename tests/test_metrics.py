"""The worker's metrics, read from a live worker process's /metrics after real jobs took every
path (success, app retry, infra retry, permanent failure, a zombie left by a SIGKILLed worker),
and checked against what the database recorded; the exposition passes ``promtool check
metrics``."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import psycopg
import pytest

from orchestrator import InvalidTransition, Orchestrator, Status
from tests.support import log_guard, scripted, scripted_app
from tests.support.exposition import counted, exporter, samples, value
from tests.support.harness import WorkerRun, free_port, wait_for
from tests.support.tools import promtool
from tests.support.workers import WorkerProcess

APP = "tests.support.scripted_app:orc"
HOUR = timedelta(hours=1)


async def count_events(db: psycopg.AsyncConnection[Any], kind: str, where: str = "") -> int:
    cur = await db.execute(f"SELECT count(*) FROM orc_job_events WHERE kind = %s {where}", (kind,))
    row = await cur.fetchone()
    return int(row[0]) if row else 0


@log_guard.fails_jobs("HTTP_400")
async def test_a_workers_metrics_match_what_the_database_recorded(
    make_orc: Callable[..., Orchestrator], dsn: str, db: psycopg.AsyncConnection[Any]
) -> None:
    orc = make_orc(retry_config=scripted_app.CONFIG)
    scripted.register(orc)
    await orc.open()
    env = {"ORCHESTRATOR_RETRY_CONFIG": scripted_app.CONFIG, "ORCHESTRATOR_WORKER_CONCURRENCY": 4}

    async def status_is(job_id: Any, status: Status) -> bool:
        return (await orc.get_job(job_id)).status is status

    # A zombie: its worker is killed while it runs the job.
    with WorkerProcess(dsn, APP, **env) as doomed:
        zombie = await orc.submit("scripted", {"script": ["block", "ok"]})
        await wait_for(lambda: status_is(zombie, Status.RUNNING), timeout=30)
        doomed.signal(signal.SIGKILL)
        doomed.wait()

    port = free_port()
    with WorkerProcess(dsn, APP, ORCHESTRATOR_HEALTH_PORT=port, **env) as worker:
        jobs = {
            script: await orc.submit("scripted", {"script": list(script)}, tenant_id="acme")
            for script in (("sleep:0.6",), ("app", "ok"), ("infra", "ok"), ("permanent",))
        }

        async def all_finished() -> bool:
            states = [await orc.get_job(j) for j in [zombie, *jobs.values()]]
            return all(job.finished_at is not None for job in states)

        await wait_for(all_finished, timeout=60)
        scraped: list[httpx.Response] = []

        async def settled() -> bool:
            """A scrape once the worker is idle: every attempt it ran has ended (its outcome
            written) and no maintenance tick holds a slot. A tick may run at any scrape (the
            sweep's is every second), so only bounds hold at every one."""
            async with httpx.AsyncClient() as client:
                response = await client.get(f"http://127.0.0.1:{port}/metrics")
            found = samples(response.text)
            lanes = {"jobs": 4, "maintenance": 1}
            for lane, size in lanes.items():
                assert value(found, "orchestrator_slots", lane=lane) == size
                assert 0 <= value(found, "orchestrator_free_slots", lane=lane) <= size
            assert 0 <= value(found, "orchestrator_running_jobs") <= lanes["jobs"]
            scraped[:] = [response]
            return value(found, "orchestrator_running_jobs") == 0 and all(
                value(found, "orchestrator_free_slots", lane=lane) == size
                for lane, size in lanes.items()
            )

        await wait_for(settled, timeout=30)
        (response,) = scraped
        async with httpx.AsyncClient() as client:
            openmetrics = await client.get(
                f"http://127.0.0.1:{port}/metrics",
                headers={"Accept": "application/openmetrics-text; version=1.0.0"},
            )
        worker.signal(signal.SIGTERM)
        assert await asyncio.to_thread(worker.wait) == 0
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert openmetrics.text.endswith("# EOF\n")
    found = samples(response.text)

    def finished(outcome: str, error_class: str = "none", layer: str = "none") -> float:
        return value(
            found, "orchestrator_attempts_finished_total", job_type="scripted",
            outcome=outcome, error_class=error_class, layer=layer,
        )  # fmt: skip

    # Every attempt but the killed worker's first one ran here.
    started = await count_events(db, "job.running") - 1
    assert value(found, "orchestrator_attempts_started_total", job_type="scripted") == started
    assert finished("completed") == await count_events(db, "job.completed") == 4
    assert finished("retried", "TRANSIENT_APP", "app") == 1
    assert finished("retried", "TRANSIENT_INFRA", "infra") == 1
    assert finished("failed", "PERMANENT") == await count_events(
        db, "job.failed", "AND (payload ->> 'terminal')::boolean"
    ) == 1  # fmt: skip
    durations = sum(
        v for (name, _), v in found.items() if name == "orchestrator_attempt_duration_seconds_count"
    )
    assert durations == started
    # The zombie was swept by this worker's maintenance lane, then completed here.
    swept = await count_events(db, "job.zombie_detected")
    assert swept == 1
    assert value(
        found, "orchestrator_maintenance_rows_total", service="sweep_zombies", action="retried"
    ) == swept  # fmt: skip
    assert value(found, "orchestrator_maintenance_runs_total", service="sweep_zombies",
                 result="ok") >= 1  # fmt: skip
    # The two retries were scheduled for later: their lateness was measured.
    assert value(found, "orchestrator_retry_lateness_seconds_count", job_type="scripted") >= 2
    assert value(found, "orchestrator_heartbeats_total", result="ok") >= 1  # the 0.6 s job's
    # Idle (settled): nothing runs, every slot is free.
    assert value(found, "orchestrator_running_jobs") == 0
    assert value(found, "orchestrator_free_slots", lane="jobs") == 4
    assert value(found, "orchestrator_free_slots", lane="maintenance") == 1
    assert value(found, "orchestrator_worker_ready") == 1
    assert "job_id" not in response.text  # no label names a job

    # The fleet, as the exporter reads it, against the database: jobs left waiting now.
    for tenant, queue in (("acme", "q1"), ("acme", "q1"), (None, "q2")):
        await orc.submit("scripted", {"script": ["ok"]}, queue=queue, tenant_id=tenant)
    later = datetime.now(UTC) + timedelta(hours=1)
    await orc.submit("scripted", {"script": ["ok"]}, queue="q1", run_at=later)
    # One job waiting for its retry, and one whose worker died unswept (as the rows say:
    # the exporter reads only the database).
    retrying, unswept = [await orc.submit("scripted", {"script": ["ok"]}, queue="q3")
                         for _ in range(2)]  # fmt: skip
    claimed = "status = 'RUNNING', attempt = 1, lease_token = gen_random_uuid(), locked_by = 'w'"
    await db.execute(f"UPDATE orc_jobs SET {claimed} WHERE id = ANY(%s)", ([retrying, unswept],))
    await db.execute(
        "UPDATE orc_jobs SET status = 'RETRY', next_retry_at = now() + interval '1 hour', "
        "lease_token = NULL, locked_by = NULL WHERE id = %s", (retrying,),
    )  # fmt: skip
    await db.execute(
        "UPDATE orc_jobs SET heartbeat_at = now() - interval '1 hour' WHERE id = %s", (unswept,)
    )
    fleet = await exported_fleet(dsn)
    cur = await db.execute(
        "SELECT status, coalesce(tenant_id, ''), count(*) FROM orc_jobs "
        "WHERE finished_at IS NULL GROUP BY 1, 2"
    )
    for status, tenant, n in await cur.fetchall():
        assert value(fleet, "orchestrator_jobs", status=status, job_type="scripted",
                     tenant=tenant) == n  # fmt: skip
    assert value(fleet, "orchestrator_jobs", status="PENDING", job_type="scripted",
                 tenant="acme") == 2  # fmt: skip
    assert value(fleet, "orchestrator_queue_depth", queue="q1") == 2  # the later one is not due
    assert value(fleet, "orchestrator_queue_depth", queue="q2") == 1
    assert value(fleet, "orchestrator_queue_oldest_age_seconds", queue="q1") > 0
    assert value(fleet, "orchestrator_dead_letters", state="recorded", tenant="acme") == 1
    unfinished = sum(n for _, _, n in await (await db.execute(
        "SELECT status, 1, count(*) FROM orc_jobs WHERE finished_at IS NULL GROUP BY 1"
    )).fetchall())  # fmt: skip
    assert value(fleet, "orchestrator_jobs", status="RETRY", job_type="scripted", tenant="") == 1
    assert value(fleet, "orchestrator_jobs_retrying_ratio") == 1 / unfinished
    assert value(fleet, "orchestrator_queue_depth", queue="q3") == 0  # neither is due
    assert value(fleet, "orchestrator_zombies") == 1
    assert value(fleet, "orchestrator_approvals_waiting") == 0
    assert value(fleet, "orchestrator_fleet_up") == 1


async def exported_fleet(dsn: str) -> dict[Any, float]:
    """One scrape of a real ``orchestrator exporter`` process on this database."""
    async with exporter(dsn) as scrape:
        return await scrape()


@log_guard.fails_jobs("HTTP_400")
async def test_a_live_workers_exposition_passes_promtool(
    make_orc: Callable[..., Orchestrator], dsn: str
) -> None:
    orc = make_orc(retry_config=scripted_app.CONFIG)
    scripted.register(orc)
    await orc.open()
    port = free_port()
    env = {"ORCHESTRATOR_RETRY_CONFIG": scripted_app.CONFIG, "ORCHESTRATOR_HEALTH_PORT": port}
    with WorkerProcess(dsn, APP, **env):
        jobs = [await orc.submit("scripted", {"script": [s]}) for s in ("ok", "permanent")]

        async def finished() -> bool:
            return all([(await orc.get_job(j)).finished_at is not None for j in jobs])

        await wait_for(finished, timeout=30)
        async with httpx.AsyncClient() as client:
            exposition = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    check = promtool("check", "metrics", stdin=exposition)
    assert check.returncode == 0, check.stdout + check.stderr


async def test_with_metrics_off_nothing_is_counted(make_orc: Callable[..., Orchestrator]) -> None:
    orc = make_orc(retry_config=scripted_app.CONFIG, metrics=False)
    scripted.register(orc)
    async with WorkerRun(orc) as worker:
        job_id = await orc.submit("scripted", {"script": ["ok"]})
        await worker.until_finished(job_id)
        found = await counted(orc)
    assert not [name for name, _ in found if name.startswith("orchestrator_attempts")]
    assert not [name for name, _ in found if name == "orchestrator_running_jobs"]


async def test_queue_wait_and_heartbeats_are_measured_for_a_job_due_at_submit(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc = make_orc(retry_config=scripted_app.CONFIG, heartbeat_interval=0.2)
    scripted.register(orc)
    async with WorkerRun(orc) as worker:
        job_id = await orc.submit("scripted", {"script": ["sleep:0.8"]})  # due now: no run_at
        await worker.until_finished(job_id)
    found = await counted(orc)
    assert value(found, "orchestrator_queue_wait_seconds_count", job_type="scripted") == 1
    assert value(found, "orchestrator_retry_lateness_seconds_count", job_type="scripted") == 0
    beats = value(found, "orchestrator_heartbeats_total", result="ok")
    assert beats >= 2  # every 0.2 s of the 0.8 s it ran
    assert value(found, "orchestrator_heartbeat_duration_seconds_count") == beats


async def test_a_superseded_attempts_write_is_counted_as_stale(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = make_orc(retry_config=scripted_app.CONFIG)
    scripted.register(orc)
    async with WorkerRun(orc):
        job_id = await orc.submit("scripted", {"script": ["block"]})
        await wait_for(lambda: _status_is(orc, job_id, Status.RUNNING))
        # superseded, as by a sweep that moved faster than this attempt's next heartbeat
        await db.execute(
            "UPDATE orc_jobs SET lease_token = gen_random_uuid() WHERE id = %s", (job_id,)
        )
        scripted.RELEASE.setdefault(job_id, asyncio.Event()).set()

        async def stale_write_counted() -> bool:
            found = await counted(orc)
            return value(
                found, "orchestrator_stale_writes_total", job_type="scripted", write="completed"
            ) == 1  # fmt: skip

        await wait_for(stale_write_counted)
    assert (await orc.get_job(job_id)).status is Status.RUNNING  # the write changed nothing
    refused = [v for (name, _), v in (await counted(orc)).items()
               if name == "orchestrator_transitions_refused_total"]  # fmt: skip
    assert sum(refused) == 0  # a lease refused it, not the state machine


@pytest.mark.logs_errors(
    r"WF_STATE_TRANSITION_INVALID: job \S+ cannot go from PENDING to CANCELLED"
)
async def test_refused_transitions_are_counted_by_the_guard_that_refused_them(
    make_orc: Callable[..., Orchestrator],
    db: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    orc = make_orc(retry_config=scripted_app.CONFIG)
    scripted.register(orc)
    async with WorkerRun(orc) as worker:
        done = await orc.submit("scripted", {"script": ["ok"]})
        await worker.until_finished(done)
    # An operator's request the state machine refuses: counted, and no page.
    with pytest.raises(InvalidTransition, match="cannot go from COMPLETED to CANCELLED"):
        await orc.cancel(done)
    found = await counted(orc)
    assert value(found, "orchestrator_transitions_refused_total", from_status="COMPLETED",
                 to_status="CANCELLED", refused_by="request") == 1  # fmt: skip

    # The database's guard refusing a change this code thinks legal (as after a state machine
    # changed without `orchestrator migrate`): raised as the same error, logged and counted.
    waiting = await orc.submit("scripted", {"script": ["ok"]}, run_at=datetime.now(UTC) + HOUR)
    cur = await db.execute(
        "DELETE FROM orc_state_transitions WHERE from_status = 'PENDING' "
        "AND to_status = 'CANCELLED' RETURNING from_status, to_status"
    )
    removed = await cur.fetchone()
    assert removed is not None
    caplog.clear()
    try:
        with (
            caplog.at_level(logging.ERROR, logger="orchestrator"),
            pytest.raises(InvalidTransition) as refused,
        ):
            await orc.cancel(waiting)
    finally:
        await db.execute("INSERT INTO orc_state_transitions VALUES (%s, %s)", removed)
    assert refused.value.by_database
    assert (refused.value.source, refused.value.target) == ("PENDING", "CANCELLED")
    message = f"WF_STATE_TRANSITION_INVALID: job {waiting} cannot go from PENDING to CANCELLED"
    assert str(refused.value) == message
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [message]
    found = await counted(orc)
    assert value(found, "orchestrator_transitions_refused_total", from_status="PENDING",
                 to_status="CANCELLED", refused_by="database") == 1  # fmt: skip
    assert value(found, "orchestrator_transitions_refused_total", from_status="PENDING",
                 to_status="CANCELLED", refused_by="request") == 0  # fmt: skip
    assert (await orc.get_job(waiting)).status is Status.PENDING


async def _status_is(orc: Orchestrator, job_id: Any, status: Status) -> bool:
    return (await orc.get_job(job_id)).status is status
