"""What the external workers' endpoints promise, read back from what they wrote (the survivors of
the mutation run of docs/testing.md): a claim's lease and deadline, a heartbeat that moves the
job's heartbeat and the lease forward, a failure's stack and a retry-later's delay as stored, a
worker token limited to tenants refused by every endpoint, a claim after the registry forgot
the server and its one registry entry kept alive, a long-poll's wait, a replay's result, the
422s of a report that lacks what its status needs, and an attempt's output batches: written once,
held to the type's size cap, refused without the lease or in a shape they cannot have."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import psycopg
import pytest

from orchestrator import Orchestrator, Status
from orchestrator.domain.principals import Scope
from tests.support.api_server import ApiServer, api_orchestrator, token
from tests.support.workers import FAST

CLAIM = {"job_types": ["external_echo"], "worker": "py", "limit": 2}
HEARTBEAT_INTERVAL = float(FAST["ORCHESTRATOR_HEARTBEAT_INTERVAL"])
ZOMBIE_THRESHOLD = float(FAST["ORCHESTRATOR_ZOMBIE_THRESHOLD"])
JOB_TIMEOUT = 60  # external_echo's job_timeout_seconds (tests/support/api_app.py)
SLACK = timedelta(seconds=0.5)  # the server's clock read a moment before or after the test's


STALLED_WORKER = 3.0  # the server beats its registry entry every second
TEXT = {"kind": "text", "body": "hello "}
OUTPUT_MAX_BYTES = 200  # external_echo's output_max_bytes (tests/support/api_app.py)


@pytest.fixture(scope="module")
def server(dsn: str) -> Iterator[ApiServer]:
    with ApiServer(
        dsn, ORCHESTRATOR_STALLED_WORKER_SECONDS=STALLED_WORKER,
        ORCHESTRATOR_API_REPLAY_ENDPOINTS="true",
    ) as running:  # fmt: skip
        yield running


@pytest.fixture
async def orc(make_orc: Callable[..., Orchestrator]) -> Orchestrator:
    return await api_orchestrator(make_orc)


@pytest.fixture
async def api(orc: Orchestrator, server: ApiServer) -> AsyncIterator[httpx.AsyncClient]:
    secret = await token(orc.stores.tokens, "fleet", Scope.WORKER)
    async with _client(server, secret) as client:
        yield client


def _client(server: ApiServer, secret: str) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {secret}"}
    return httpx.AsyncClient(base_url=server.url, headers=headers, timeout=30)


def _around(value: str, start: datetime, end: datetime, seconds: float) -> bool:
    """``value`` is ``seconds`` after a moment between ``start`` and ``end``."""
    moment = datetime.fromisoformat(value)
    after = timedelta(seconds=seconds)
    return start + after - SLACK <= moment <= end + after + SLACK


async def test_a_claim_names_its_lease_and_a_heartbeat_moves_it_and_the_job_s_forward(
    orc: Orchestrator, api: httpx.AsyncClient
) -> None:
    job_id = await orc.submit("external_echo", {"output": 1})
    before = datetime.now(UTC)
    [task] = (await api.post("/api/v1/internal/task-claim", json=CLAIM)).json()["tasks"]
    after = datetime.now(UTC)
    assert task["heartbeat_interval"] == HEARTBEAT_INTERVAL
    assert _around(task["lease_expires_at"], before, after, ZOMBIE_THRESHOLD), task
    assert _around(task["deadline_at"], before, after, JOB_TIMEOUT), task
    claimed = (await orc.get_job(job_id)).heartbeat_at
    assert claimed is not None
    await asyncio.sleep(0.3)
    lease = {"job_id": task["job_id"], "attempt": 1, "lease_token": task["lease_token"]}
    before = datetime.now(UTC)
    beat = await api.post("/api/v1/internal/heartbeat", json=lease)
    after = datetime.now(UTC)
    assert beat.status_code == 200, beat.text
    assert _around(beat.json()["lease_expires_at"], before, after, ZOMBIE_THRESHOLD)
    beaten = await orc.get_job(job_id)
    assert beaten.status is Status.RUNNING and beaten.heartbeat_at is not None
    assert claimed + timedelta(seconds=0.3) <= beaten.heartbeat_at <= after + SLACK


async def test_a_failure_keeps_its_stack_and_a_retry_later_its_delay(
    orc: Orchestrator, api: httpx.AsyncClient
) -> None:
    failing = await orc.submit("external_echo", {"output": 1})
    later = await orc.submit("external_echo", {"output": 2})
    tasks = {
        t["job_id"]: t
        for t in (await api.post("/api/v1/internal/task-claim", json=CLAIM)).json()["tasks"]
    }
    assert set(tasks) == {str(failing), str(later)}

    def lease(job_id: Any) -> dict[str, Any]:
        task = tasks[str(job_id)]
        return {"job_id": task["job_id"], "attempt": 1, "lease_token": task["lease_token"]}

    error = {"message": "upstream said no", "code": "UPSTREAM_503",
             "classification": "TRANSIENT_APP", "stack": "Traceback: in call_upstream"}  # fmt: skip
    failure = {**lease(failing), "status": "failure", "error": error}
    answer = await api.post("/api/v1/internal/task-complete", json=failure)
    assert answer.json() == {"outcome": "retried"}, answer.text
    job = await orc.get_job(failing)
    assert job.status is Status.RETRY and job.last_error is not None
    stored = job.last_error.model_dump(include={"message", "code", "classification", "stack"})
    assert stored == {**error, "classification": "TRANSIENT_APP"}

    # the delay asked for, not the backoff's 50 ms (within the config's cap of 400 ms)
    report = {**lease(later), "status": "retry_later", "retry_after_seconds": 0.3,
              "message": "rate limited"}  # fmt: skip
    answer = await api.post("/api/v1/internal/task-complete", json=report)
    assert answer.json() == {"outcome": "retried"}, answer.text
    job = await orc.get_job(later)
    assert job.status is Status.RETRY and job.last_error is not None
    assert (job.last_error.code, job.last_error.message) == ("RETRY_LATER", "rate limited")
    [scheduled] = [e for e in await orc.job_events(later) if e.kind == "job.retry_scheduled"]
    assert scheduled.payload["backoff_ms"] == 300


async def test_a_report_without_what_its_status_needs_is_refused_naming_it(
    orc: Orchestrator, api: httpx.AsyncClient
) -> None:
    job_id = await orc.submit("external_echo", {"output": 1})
    [task] = (await api.post("/api/v1/internal/task-claim", json=CLAIM)).json()["tasks"]
    lease = {"job_id": task["job_id"], "attempt": 1, "lease_token": task["lease_token"]}
    before = await orc.get_job(job_id)
    for status, field in (("failure", "error"), ("retry_later", "retry_after_seconds")):
        answer = await api.post("/api/v1/internal/task-complete", json={**lease, "status": status})
        assert answer.status_code == 422, answer.text
        assert answer.json()["detail"].startswith(f"{field}:"), answer.text
    assert await orc.get_job(job_id) == before


async def test_a_worker_token_limited_to_tenants_is_refused_everywhere_and_changes_nothing(
    orc: Orchestrator, server: ApiServer, api: httpx.AsyncClient, db: psycopg.AsyncConnection[Any]
) -> None:
    """``orchestrator tokens create`` refuses such a token; one stored otherwise (by hand, or
    before that rule) is refused by the API at every use."""
    job_id = await orc.submit("external_echo", {"output": 1}, tenant_id="acme")
    [task] = (await api.post("/api/v1/internal/task-claim", json=CLAIM)).json()["tasks"]
    lease = {"job_id": task["job_id"], "attempt": 1, "lease_token": task["lease_token"]}
    waiting = await orc.submit("external_echo", {"output": 2}, tenant_id="acme")
    before = {j: await orc.get_job(j) for j in (job_id, waiting)}
    secret = await token(orc.stores.tokens, "acme-worker", Scope.WORKER)
    await db.execute("UPDATE orc_api_tokens SET tenants = '{acme}' WHERE name = 'acme-worker'")
    async with _client(server, secret) as limited:
        for path, body in (
            ("/api/v1/internal/task-claim", {**CLAIM, "wait_seconds": 0}),
            ("/api/v1/internal/heartbeat", lease),
            ("/api/v1/internal/task-complete", {**lease, "status": "success", "output": 9}),
            ("/api/v1/internal/task-output", {**lease, "batch": 1, "chunks": [TEXT]}),
        ):
            answer = await limited.post(path, json=body)
            assert (answer.status_code, answer.json()["code"]) == (403, "FORBIDDEN"), path
            assert "limited to tenants" in answer.json()["detail"]
    assert {j: await orc.get_job(j) for j in (job_id, waiting)} == before
    assert await orc.stores.output.read(job_id) == []


async def test_output_batches_are_written_once_under_the_lease_and_held_to_the_types_cap(
    orc: Orchestrator, api: httpx.AsyncClient
) -> None:
    job_id = await orc.submit("external_echo", {"output": 1})
    [task] = (await api.post("/api/v1/internal/task-claim", json=CLAIM)).json()["tasks"]
    lease = {"job_id": task["job_id"], "attempt": 1, "lease_token": task["lease_token"]}

    async def write(batch: int, *chunks: Any) -> httpx.Response:
        body = {**lease, "batch": batch, "chunks": list(chunks)}
        return await api.post("/api/v1/internal/task-output", json=body)

    progress = {"kind": "progress", "body": {"tool": "search"}}
    first = await write(1, TEXT, progress)
    assert first.json() == {"written": 2, "next_offset": 2, "cut": False}, first.text
    again = await write(1, TEXT, progress)  # its answer lost on the way: sent again
    assert again.json() == {"written": 0, "next_offset": 2, "cut": False}, again.text
    too_much = {"kind": "text", "body": "x" * OUTPUT_MAX_BYTES}
    cut = await write(2, {"kind": "text", "body": "fits"}, too_much, TEXT)
    assert cut.json() == {"written": 1, "next_offset": 4, "cut": True}, cut.text
    chunks = await orc.stores.output.read(job_id)
    assert [(c.offset, c.attempt, c.step, c.kind, c.body) for c in chunks] == [
        (0, 1, None, "text", "hello "),
        (1, 1, None, "progress", {"tool": "search"}),
        (2, 1, None, "text", "fits"),
        (3, 1, None, "cut", {"max_bytes": OUTPUT_MAX_BYTES}),
    ]
    # A shape no chunk can have: refused, naming the problem, and nothing written.
    for bad, named in (
        ({"kind": "superseded", "body": {"attempt": 1, "step": 1}}, "kind"),
        ({"kind": "text", "body": {"not": "text"}}, "body"),
        ({"kind": "text", "body": ""}, "body"),
        ({"kind": "progress", "body": ["not", "an", "object"]}, "body"),
        ({"kind": "progress", "body": {"nul": "a\u0000b"}}, "NUL"),
        ({"kind": "text", "body": "x", "step": 2}, "step"),
    ):
        answer = await write(3, bad)
        assert answer.status_code == 422, (bad, answer.text)
        assert named in answer.json()["detail"], (bad, answer.text)
    empty = await write(3)
    assert empty.status_code == 422 and "chunks" in empty.json()["detail"], empty.text
    # The attempt over, its lease is gone: refused as every report without it, nothing written.
    done = {**lease, "status": "success", "output": 1}
    assert (await api.post("/api/v1/internal/task-complete", json=done)).is_success
    stale = await write(3, TEXT)
    assert (stale.status_code, stale.json()["code"]) == (409, "WF_LEASE_STALE"), stale.text
    assert await orc.stores.output.read(job_id) == chunks


async def test_a_claim_after_the_registry_forgot_the_server_registers_it_again(
    orc: Orchestrator, api: httpx.AsyncClient, db: psycopg.AsyncConnection[Any]
) -> None:
    """The database was away long enough for the registry to prune the server's entry: the
    next claim registers it anew (as a worker does) and gets its job."""
    await orc.submit("external_echo", {"output": 1})
    await api.post("/api/v1/internal/task-claim", json={**CLAIM, "wait_seconds": 0})
    await db.execute("DELETE FROM procrastinate_workers")
    job_id = await orc.submit("external_echo", {"output": 2})
    answer = await api.post("/api/v1/internal/task-claim", json=CLAIM)
    assert answer.status_code == 200, answer.text
    assert [t["job_id"] for t in answer.json()["tasks"]] == [str(job_id)]
    assert (await orc.get_job(job_id)).status is Status.RUNNING


async def _settled_registry(api: httpx.AsyncClient, db: psycopg.AsyncConnection[Any]) -> set[int]:
    """The registry's entries once the server has found its own gone (each test starts from an
    empty table) and made a new one: a claim and a registry beat may both make one, and the
    one left behind stays until a registration prunes it."""
    await api.post("/api/v1/internal/task-claim", json={**CLAIM, "wait_seconds": 0})
    await asyncio.sleep(STALLED_WORKER / 3 + 0.2)
    return {row[0] for row in await (await db.execute(REGISTRY)).fetchall()}


REGISTRY = "SELECT id, now() - last_heartbeat FROM procrastinate_workers ORDER BY 2"


async def test_a_claim_waits_for_work_as_long_as_asked_and_no_longer(
    orc: Orchestrator, api: httpx.AsyncClient, db: psycopg.AsyncConnection[Any]
) -> None:
    """A long-poll: a job submitted while the claim waits is handed out at once; with none, the
    claim answers [] after ``wait_seconds``. No claim makes a new registry entry."""
    loop = asyncio.get_running_loop()
    entries = await _settled_registry(api, db)

    async def submit_soon() -> Any:
        await asyncio.sleep(0.3)
        return await orc.submit("external_echo", {"output": 1})

    start = loop.time()
    answer, job_id = await asyncio.gather(
        api.post("/api/v1/internal/task-claim", json={**CLAIM, "wait_seconds": 1}), submit_soon()
    )
    assert [t["job_id"] for t in answer.json()["tasks"]] == [str(job_id)]
    assert loop.time() - start < 1
    start = loop.time()
    empty = await api.post("/api/v1/internal/task-claim", json={**CLAIM, "wait_seconds": 1})
    waited = loop.time() - start
    assert empty.json() == {"tasks": []}
    assert 1 <= waited < 1.9, waited
    assert {row[0] for row in await (await db.execute(REGISTRY)).fetchall()} == entries


async def test_the_server_keeps_its_registry_entry_alive(
    orc: Orchestrator, api: httpx.AsyncClient, db: psycopg.AsyncConnection[Any]
) -> None:
    """The dispatches an external worker holds stay ``doing`` under the server's registry
    entry: the server beats that entry (a new one would leave them under a silent worker)."""
    await _settled_registry(api, db)
    [(entry, _), *_] = await (await db.execute(REGISTRY)).fetchall()  # the freshest
    await asyncio.sleep(2.5 * STALLED_WORKER / 3)  # two beats or more
    [(still, silent), *_] = await (await db.execute(REGISTRY)).fetchall()
    assert still == entry
    assert silent < timedelta(seconds=STALLED_WORKER / 3 + 1)


async def test_a_replayed_job_s_result_says_it_was_replayed(
    orc: Orchestrator, server: ApiServer
) -> None:
    job_id = await orc.submit("scripted", {"script": ["ok"]})
    secret = await token(orc.stores.tokens, "replayer", Scope.ADMIN)
    async with _client(server, secret) as admin:
        run = await admin.post(f"/api/v1/internal/jobs/{job_id}/run")
    assert run.json()["outcome"] == "completed", run.text
    job = await orc.get_job(job_id)
    assert (job.status, job.result) == (Status.COMPLETED, {"replayed": True})
