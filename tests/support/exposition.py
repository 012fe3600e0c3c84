"""A Prometheus exposition read back as the tests compare it: one value per sample; and a real
``orchestrator exporter`` process to scrape."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support.harness import free_port, wait_for

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(exposition: str) -> Samples:
    """(sample name, sorted labels) -> value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
    }


def value(found: Samples, name: str, **labels: str) -> float:
    """The sample's value; 0 when it was not exposed."""
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


async def counted(orc: Any) -> Samples:
    """What an Orchestrator in this process has counted so far."""
    body, _ = await orc.metrics.exposition("")
    return samples(body.decode())


@contextlib.asynccontextmanager
async def exporter(dsn: str) -> AsyncIterator[Callable[[], Awaitable[Samples]]]:
    """A real ``orchestrator exporter`` process on this database, answering every scrape from
    the database (no reuse of the last), and a function that scrapes it. It must end with 0 on
    SIGTERM; it is killed if the test failed first."""
    port = free_port()
    process = _start_exporter(dsn, port)
    try:
        async with httpx.AsyncClient() as client:

            async def ready() -> bool:
                try:
                    response = await client.get(f"http://127.0.0.1:{port}/readyz")
                except httpx.TransportError:
                    return False
                return response.status_code == 200

            async def scrape() -> Samples:
                response = await client.get(f"http://127.0.0.1:{port}/metrics", timeout=30)
                assert response.status_code == 200, response.text
                return samples(response.text)

            await wait_for(ready, timeout=30)
            yield scrape
        process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(process.wait, 30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _start_exporter(dsn: str, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "DATABASE_URL": dsn, "ORCHESTRATOR_EXPORTER_MIN_INTERVAL": "0"}
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "exporter", "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
