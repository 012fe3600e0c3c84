"""What most tests share: settings for a test orchestrator, waiting on a condition, a worker run
in the test's own event loop, and one run of each maintenance service."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import psycopg

from orchestrator import Orchestrator, Settings
from orchestrator.domain.models import Job

ROOT = Path(__file__).resolve().parents[2]
BASE_CONFIG = ROOT / "tests" / "support" / "retry_config.toml"


#: What a test may leave in the session's database, emptied before each test that asks for it.
TABLES = (
    "orc_job_events, orc_dead_letters, orc_jobs, procrastinate_events, "
    "procrastinate_periodic_defers, procrastinate_jobs, procrastinate_workers, orc_api_tokens, "
    "orc_event_listeners, orc_job_rollups, orc_queue_depth, orc_schedules, orc_flow_keys, "
    "orc_flow_limits, orc_flow_spends, orc_flow_shares, orc_application_conflicts"
)
CLEAR = (
    f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE",
    # the declarations of the rows emptied above (limits, schedules), and every application's
    # but the one the session's migrate declared its job types for (docs/applications.md)
    "DELETE FROM orc_application_definitions WHERE kind IN ('limit', 'schedule') "
    "OR application <> 'default'",
    "UPDATE orc_rollup_watermark SET rolled_up_to = NULL",
    "UPDATE orc_retention_progress SET caught_up_to = now()",
)


def clear_tables(dsn: str) -> None:
    """Empty the session database's tables: a test or a module whose servers and workers use
    the database directly starts from nothing a test before it left (in whichever order the
    test processes ran them). A server of the module still running its loops may lock the
    tables in another order than the TRUNCATE: PostgreSQL then ends one of the two, and when
    that is the TRUNCATE it is tried again."""
    for attempt in range(1, 6):
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                for statement in CLEAR:
                    conn.execute(statement)
            return
        except psycopg.errors.DeadlockDetected:
            if attempt == 5:
                raise
            time.sleep(0.1 * attempt)


def config_with(*tables: str) -> Path:
    """The tests' retry config with these tables added, as a file. A worker refuses a table
    naming a job type its application lacks, so each support app brings its own table."""
    text = BASE_CONFIG.read_text() + "".join(tables)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"orchestrator-tests-{digest}.toml"
    if not path.exists():
        path.write_text(text)
    return path


def settings_for_tests(**overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "fetch_polling_interval": 1.0,
        "health_port": 0,
        "worker_concurrency": 10,
        "pool_min_size": 1,
        "pool_max_size": 10,
        "retry_config": BASE_CONFIG,
    }
    values.update(overrides)
    return Settings(**values)


async def wait_for(
    condition: Callable[[], Awaitable[bool]], timeout: float = 15.0, interval: float = 0.05
) -> None:
    """Poll ``condition`` until it holds; fail the test after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await condition():
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


async def finished(orc: Orchestrator, job_id: uuid.UUID, timeout: float = 30.0) -> Job:
    """The job, once it has finished (run by whichever worker, in this process or another)."""

    async def done() -> bool:
        return (await orc.get_job(job_id)).finished_at is not None

    await wait_for(done, timeout=timeout)
    return await orc.get_job(job_id)


class WorkerRun:
    """A worker running in this event loop for the duration of an ``async with``."""

    def __init__(self, orc: Orchestrator, **options: Any) -> None:
        self.orc = orc
        self.options = options
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> WorkerRun:
        await self.orc.open()
        self.task = asyncio.create_task(
            self.orc.run_worker(install_signal_handlers=False, **self.options)
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.task is not None
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task

    async def until_finished(self, *job_ids: uuid.UUID, timeout: float = 15.0) -> None:
        async def finished() -> bool:
            assert self.task is not None
            if self.task.done():
                self.task.result()  # surface a crashed worker
            for job_id in job_ids:
                if (await self.orc.get_job(job_id)).finished_at is None:
                    return False
            return True

        await wait_for(finished, timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def probe(port: int, path: str = "/readyz") -> int | None:
    """The status a worker's probe answers, or None when nothing answers."""
    try:
        async with httpx.AsyncClient(timeout=2) as client:
            return (await client.get(f"http://127.0.0.1:{port}{path}")).status_code
    except httpx.TransportError:
        return None


# -- one run of a maintenance service, as a periodic tick runs it: how many rows it handled ---


async def run_sweep(orc: Orchestrator) -> int:
    return (await orc.maintenance.sweep.run_once()).handled


async def run_safety_net(orc: Orchestrator) -> int:
    return (await orc.maintenance.safety_net.run_once()).handled


async def run_prune(orc: Orchestrator) -> int:
    return (await orc.maintenance.prune.run_once()).handled
