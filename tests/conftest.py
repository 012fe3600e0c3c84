"""Test harness: a real PostgreSQL for every test that touches storage.

With ``DATABASE_URL`` set, that server is used; otherwise the embedded one (``.orchestrator/``).
Each session creates its own database there, migrates it once, and drops it at the end; each
test starts from empty tables.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from orchestrator import Orchestrator, Settings
from orchestrator.database import drop_database, ensure_database, start_embedded, with_database
from orchestrator.migrate import migrate
from orchestrator.models import Job

ROOT = Path(__file__).resolve().parent.parent
TABLES = (
    "orc_job_events, orc_dead_letters, orc_jobs, procrastinate_events, "
    "procrastinate_periodic_defers, procrastinate_jobs, procrastinate_workers"
)


@pytest.fixture(scope="session")
def server_dsn() -> str:
    return os.environ.get("DATABASE_URL") or start_embedded(ROOT / ".orchestrator")


@pytest.fixture(scope="session")
def dsn(server_dsn: str) -> Iterator[str]:
    name = f"orc_test_{uuid.uuid4().hex[:10]}"
    ensure_database(server_dsn, name)
    test_dsn = with_database(server_dsn, name)

    async def apply() -> None:
        async with await psycopg.AsyncConnection.connect(test_dsn, autocommit=True) as conn:
            await migrate(conn)

    asyncio.run(apply())
    yield test_dsn
    drop_database(server_dsn, name)


@pytest.fixture
async def db(dsn: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """A raw autocommit connection to the test database, on empty tables."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE")
        yield conn


def test_settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "fetch_polling_interval": 1.0,
        "health_port": 0,
        "worker_concurrency": 10,
        "pool_min_size": 1,
        "pool_max_size": 10,
        "retry_config": ROOT / "tests" / "retry_config.toml",
    }
    values.update(overrides)
    return Settings(**values)


@pytest.fixture
async def make_orc(
    dsn: str, db: psycopg.AsyncConnection[Any]
) -> AsyncIterator[Callable[..., Orchestrator]]:
    """Build Orchestrators on the test database; they are closed after the test."""
    made: list[Orchestrator] = []

    def make(**settings: Any) -> Orchestrator:
        orc = Orchestrator(settings=test_settings(**settings), dsn=dsn)
        made.append(orc)
        return orc

    yield make
    for orc in made:
        await orc.close()


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
