"""The lease contract by its effects (docs/contracts.md): a heartbeat moves the lease forward,
read back from the job's row, and a worker that keeps heartbeating past the zombie threshold
keeps its job while the real sweep runs (no ``job.zombie_detected``), for an external worker
over the HTTP API and for an in-process worker alike. A heartbeat answered 200 that wrote
nothing fails here."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import httpx
import psycopg
import pytest

from orchestrator import Orchestrator, Status
from orchestrator.domain.principals import Scope
from tests.support.api_server import ApiServer, api_orchestrator, token
from tests.support.harness import WorkerRun, run_sweep, wait_for
from tests.support.workers import FAST

#: The zombie threshold of the server and of the sweepers here (tests/support/workers.FAST).
THRESHOLD = float(FAST["ORCHESTRATOR_ZOMBIE_THRESHOLD"])
#: How long the workers keep their jobs: three zombie thresholds.
HELD = 3 * THRESHOLD


@pytest.fixture(scope="module")
def server(dsn: str) -> Iterator[ApiServer]:
    with ApiServer(dsn) as running:
        yield running


@pytest.fixture
async def orc(make_orc: Callable[..., Orchestrator]) -> Orchestrator:
    return await api_orchestrator(make_orc, zombie_threshold=THRESHOLD, heartbeat_interval=0.2)


@pytest.fixture
async def worker(orc: Orchestrator, server: ApiServer) -> AsyncIterator[httpx.AsyncClient]:
    """An external worker's client, with a worker token."""
    secret = await token(orc.stores.tokens, "lease-worker", Scope.WORKER)
    headers = {"Authorization": f"Bearer {secret}"}
    async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=30) as client:
        yield client


async def heartbeat_at(db: psycopg.AsyncConnection[Any], job_id: UUID) -> datetime | None:
    """The job's last heartbeat, as its row has it (None once it is no longer running)."""
    cursor = await db.execute("SELECT heartbeat_at FROM orc_jobs WHERE id = %s", (job_id,))
    row = await cursor.fetchone()
    assert row is not None
    value: datetime | None = row[0]
    return value


async def claimed(orc: Orchestrator, worker: httpx.AsyncClient) -> dict[str, Any]:
    job_id = await orc.submit("external_echo", {"output": 1})
    claim = {"job_types": ["external_echo"], "worker": "lease", "wait_seconds": 5}
    [task] = (await worker.post("/api/v1/internal/task-claim", json=claim)).json()["tasks"]
    assert task["job_id"] == str(job_id)
    return {
        "job_id": task["job_id"],
        "attempt": task["attempt"],
        "lease_token": task["lease_token"],
    }


async def test_an_external_heartbeat_moves_the_lease_forward(
    orc: Orchestrator, worker: httpx.AsyncClient, db: psycopg.AsyncConnection[Any]
) -> None:
    lease = await claimed(orc, worker)
    job_id = UUID(lease["job_id"])
    before = await heartbeat_at(db, job_id)
    await asyncio.sleep(0.3)
    beat = await worker.post("/api/v1/internal/heartbeat", json=lease)
    assert beat.status_code == 200, beat.text
    after = await heartbeat_at(db, job_id)
    assert before is not None and after is not None
    assert after - before >= timedelta(seconds=0.3)  # written, not only answered
    expires = datetime.fromisoformat(beat.json()["lease_expires_at"])
    assert abs(expires - (after + timedelta(seconds=THRESHOLD))) < timedelta(seconds=1)


async def test_an_external_worker_heartbeating_past_the_zombie_threshold_keeps_its_job(
    orc: Orchestrator, worker: httpx.AsyncClient
) -> None:
    """It heartbeats every few tenths of a second for three thresholds while the sweep runs
    as often, then completes: the same attempt, never taken for a zombie."""
    lease = await claimed(orc, worker)
    job_id = UUID(lease["job_id"])
    swept = 0
    loop = asyncio.get_running_loop()
    until = loop.time() + HELD
    while loop.time() < until:
        beat = await worker.post("/api/v1/internal/heartbeat", json=lease)
        assert beat.status_code == 200, beat.text
        swept += await run_sweep(orc)
        await asyncio.sleep(0.3)
    done = await worker.post(
        "/api/v1/internal/task-complete", json={**lease, "status": "success", "output": 2}
    )
    assert done.json() == {"outcome": "completed"}, done.text
    job = await orc.get_job(job_id)
    assert (job.status, job.attempt, swept) == (Status.COMPLETED, 1, 0)
    assert "job.zombie_detected" not in [e.kind for e in await orc.job_events(job_id)]


async def test_an_in_process_worker_heartbeating_past_the_zombie_threshold_keeps_its_job(
    orc: Orchestrator, make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    """A job that runs three thresholds long, its worker heartbeating, while another process's
    sweep runs every few tenths of a second: its heartbeat moves forward, it completes in its
    first attempt, and nothing took it for a zombie."""
    sweeper = make_orc(zombie_threshold=THRESHOLD, heartbeat_interval=0.2)
    await sweeper.open()
    job_id = await orc.submit("scripted", {"script": [f"sleep:{HELD}"]})
    swept, beats = 0, []
    async with WorkerRun(orc) as run:

        async def running() -> bool:
            return (await orc.get_job(job_id)).status is Status.RUNNING

        await wait_for(running)
        while (await orc.get_job(job_id)).status is Status.RUNNING:
            if (at := await heartbeat_at(db, job_id)) is not None:
                beats.append(at)
            swept += await run_sweep(sweeper)
            await asyncio.sleep(0.3)
        await run.until_finished(job_id)
    job = await orc.get_job(job_id)
    assert (job.status, job.attempt, swept) == (Status.COMPLETED, 1, 0)
    assert "job.zombie_detected" not in [e.kind for e in await orc.job_events(job_id)]
    assert beats[-1] - beats[0] >= timedelta(seconds=HELD - 2 * THRESHOLD)  # moved forward
