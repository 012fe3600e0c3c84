"""The Python client's ``output()`` (docs/output.md, "Reading"), both flavours (``AsyncClient``
and the blocking ``Client``), against ``orchestrator serve`` and a worker process on a real
PostgreSQL: readers from before a job to after it read what is stored, in order, and its final
output once it ends; a reader whose server is killed mid-stream, twice, resumes after its last
chunk, missing and repeating nothing; one whose server stays away gives up after
``reconnect_seconds``; a revoked token, another tenant's job and a bad offset raise at once."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any
from uuid import UUID

import httpx
import pytest

from orchestrator import Orchestrator, Status
from orchestrator.client import ApiError, AsyncClient, Client
from orchestrator.domain.output import OutputChunk
from orchestrator.domain.principals import Scope
from tests.support import output_app
from tests.support.api_server import ApiServer, token
from tests.support.harness import finished, wait_for
from tests.support.workers import WorkerProcess

APP = "tests.support.output_app:orc"
ENV = {"ORCHESTRATOR_RETRY_CONFIG": output_app.CONFIG}
#: What a reader given an error answer, or one whose server stays away, is allowed to take.
AT_ONCE = 10.0


@pytest.fixture
async def orc(make_orc: Callable[..., Orchestrator]) -> AsyncIterator[Orchestrator]:
    made = make_orc(retry_config=output_app.CONFIG)
    output_app.register(made)
    async with made:
        yield made


@pytest.fixture
def worker(empty_dsn: str) -> Iterator[WorkerProcess]:
    with WorkerProcess(empty_dsn, APP, **ENV) as running:
        yield running


def serve(dsn: str, port: int | None = None) -> ApiServer:
    return ApiServer(dsn, app=APP, port=port, ORCHESTRATOR_RETRY_CONFIG=output_app.CONFIG)


async def follow(
    url: str, secret: str, job_id: UUID, into: list[OutputChunk], **options: Any
) -> None:
    """``AsyncClient.output``, each chunk put ``into`` the list as it comes."""
    async with AsyncClient(url, secret) as api:
        async for chunk in api.output(job_id, **options):
            into.append(chunk)


def follow_blocking(
    url: str, secret: str, job_id: UUID, into: list[OutputChunk], **options: Any
) -> None:
    """``Client.output`` (in a thread of its own), each chunk put ``into`` the list."""
    with Client(url, secret) as api:
        for chunk in api.output(job_id, **options):
            into.append(chunk)


def readers(
    url: str, secret: str, job_id: UUID, **options: Any
) -> tuple[list[OutputChunk], list[OutputChunk], asyncio.Future[Any]]:
    """Both flavours reading the job's output: what each has read so far, and how each ended
    (None, or what it raised)."""
    read: list[OutputChunk] = []
    read_blocking: list[OutputChunk] = []
    both = asyncio.gather(
        follow(url, secret, job_id, read, **options),
        asyncio.to_thread(follow_blocking, url, secret, job_id, read_blocking, **options),
        return_exceptions=True,
    )
    return read, read_blocking, both


async def test_readers_from_before_a_job_to_after_it_read_what_is_stored_and_its_final_output(
    orc: Orchestrator, empty_dsn: str, worker: WorkerProcess
) -> None:
    secret = await token(orc.stores.tokens, "reader", Scope.READ)
    with serve(empty_dsn) as server:
        async with asyncio.timeout(60):
            job_id = await orc.submit("streamer", {"deltas": 30, "every": 0.02, "fail_first": True})
            live, live_blocking, reading = readers(server.url, secret, job_id)
            final, final_blocking, waiting = readers(server.url, secret, job_id, final=True)
            assert list(await asyncio.gather(reading, waiting)) == [[None, None]] * 2
            job = await orc.get_job(job_id)
            later, later_blocking, after = readers(server.url, secret, job_id, offset=3)
            assert await after == [None, None]
    assert job.status is Status.COMPLETED
    stored = await orc.stores.output.read(job_id)
    assert "superseded" in [c.kind for c in stored]  # its first attempt's, then the second's
    assert live == live_blocking == stored
    assert final == final_blocking == await orc.stores.output.read(job_id, final=True)
    assert later == later_blocking == stored[3:]


async def test_a_reader_whose_server_is_killed_mid_stream_resumes_after_its_last_chunk(
    orc: Orchestrator, empty_dsn: str, worker: WorkerProcess
) -> None:
    # Killed twice, the second time once reconnect_seconds have passed since the first: each
    # run of failures gets its own reconnect_seconds.
    again = 8.0
    secret = await token(orc.stores.tokens, "reader", Scope.READ)
    job_id = await orc.submit("streamer", {"deltas": 500, "every": 0.04})
    server, killed_at = serve(empty_dsn), 0.0
    try:
        async with asyncio.timeout(90):
            read, read_blocking, reading = readers(
                server.url, secret, job_id, reconnect_seconds=again
            )
            for kill in range(2):
                seen = len(read), len(read_blocking)

                async def reading_on(seen: tuple[int, int] = seen) -> bool:
                    return len(read) > seen[0] and len(read_blocking) > seen[1]

                await wait_for(reading_on, timeout=30)
                if kill:
                    await asyncio.sleep(max(0.0, killed_at + again - time.monotonic()))
                assert (await orc.get_job(job_id)).finished_at is None  # killed mid-stream
                server.process.send_signal(signal.SIGKILL)
                server.__exit__()
                killed_at = time.monotonic()
                server = await asyncio.to_thread(serve, empty_dsn, server.port)
            job = await finished(orc, job_id, timeout=60)
            assert await reading == [None, None]
    finally:
        server.__exit__()
    assert job.status is Status.COMPLETED
    stored = await orc.stores.output.read(job_id)
    assert read == read_blocking == stored  # nothing missed, nothing repeated


async def test_a_reader_gives_up_once_its_server_stays_away_for_reconnect_seconds(
    orc: Orchestrator, empty_dsn: str, worker: WorkerProcess
) -> None:
    secret = await token(orc.stores.tokens, "reader", Scope.READ)
    job_id = await orc.submit("streamer", {"deltas": 3000, "every": 0.02})
    with serve(empty_dsn) as server:
        read, read_blocking, reading = readers(server.url, secret, job_id, reconnect_seconds=1)

        async def reading_on() -> bool:
            return bool(read and read_blocking)

        await wait_for(reading_on, timeout=30)
        server.process.send_signal(signal.SIGKILL)
        async with asyncio.timeout(AT_ONCE):
            ended = await reading
    assert [type(e) for e in ended] == [httpx.ConnectError] * 2, ended
    await orc.cancel(job_id, reason="the test is over", by="tests")


async def test_a_revoked_token_another_tenant_s_job_and_a_bad_offset_raise_at_once(
    orc: Orchestrator, empty_dsn: str, worker: WorkerProcess
) -> None:
    secret = await token(orc.stores.tokens, "reader", Scope.READ)
    outsider = await token(orc.stores.tokens, "outsider", Scope.READ, tenants=["tenant-b"])
    job_id = await orc.submit("streamer", {"deltas": 3000, "every": 0.02}, tenant_id="tenant-a")
    with serve(empty_dsn) as server:
        for who, options, status in ((outsider, {}, 404), (secret, {"offset": -1}, 422)):
            async with asyncio.timeout(AT_ONCE):
                ended = await readers(server.url, who, job_id, **options)[2]
            assert [(type(e), e.status) for e in ended] == [(ApiError, status)] * 2, ended
        read, read_blocking, reading = readers(server.url, secret, job_id)

        async def reading_on() -> bool:
            return bool(read and read_blocking)

        await wait_for(reading_on, timeout=30)
        await orc.stores.tokens.revoke("reader")
        async with asyncio.timeout(AT_ONCE):  # the server's 5 s recheck, then a 401
            ended = await reading
    assert [(e.status, e.code) for e in ended] == [(401, "UNAUTHORIZED")] * 2, ended
    assert (await orc.get_job(job_id)).finished_at is None  # it ended for the token, not the job
    await orc.cancel(job_id, reason="the test is over", by="tests")
