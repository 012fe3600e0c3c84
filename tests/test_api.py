"""The HTTP API (``orchestrator serve``, a real process on 127.0.0.1) driven by httpx and the
project's own client, on a real PostgreSQL: auth and scopes, every endpoint, problem+json
errors, waits woken by the database, event streams, tenant isolation, the two-person discard,
and the dead-letter spec's replay endpoints (RP-001 to RP-004)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any
from uuid import UUID, uuid4

import httpx
import psycopg
import pytest

from orchestrator import Orchestrator, Status
from orchestrator.client import ApiError, AsyncClient
from orchestrator.domain.principals import Scope
from tests.support import api_app, log_guard
from tests.support.api_server import ApiServer, api_orchestrator, token
from tests.support.external import message_service
from tests.support.harness import WorkerRun, wait_for

PROBLEM = "application/problem+json"


@pytest.fixture(scope="module")
def server(dsn: str) -> Iterator[ApiServer]:
    with ApiServer(dsn) as running:
        yield running


@pytest.fixture(scope="module")
def replaying(dsn: str) -> Iterator[ApiServer]:
    with ApiServer(dsn, ORCHESTRATOR_API_REPLAY_ENDPOINTS="true") as running:
        yield running


@pytest.fixture
async def orc(make_orc: Callable[..., Orchestrator]) -> Orchestrator:
    return await api_orchestrator(make_orc)


@pytest.fixture
async def admin(orc: Orchestrator, server: ApiServer) -> AsyncIterator[httpx.AsyncClient]:
    secret = await token(orc.stores.tokens, "admin")
    async with _client(server, secret) as client:
        yield client


def _client(server: ApiServer, secret: str | None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    return httpx.AsyncClient(base_url=server.url, headers=headers, timeout=30)


def assert_problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith(PROBLEM)
    problem: dict[str, Any] = response.json()
    assert (problem["status"], problem["code"]) == (status, code)
    assert "Traceback" not in response.text and "SELECT" not in response.text
    return problem


# -- auth --------------------------------------------------------------------------------------


async def test_a_request_without_a_live_token_is_refused(
    orc: Orchestrator, server: ApiServer
) -> None:
    async with _client(server, None) as anonymous:
        assert_problem(await anonymous.get("/api/v1/jobs"), 401, "UNAUTHORIZED")
    async with _client(server, "orc_not-a-token") as wrong:
        assert_problem(await wrong.get("/api/v1/jobs"), 401, "UNAUTHORIZED")
    forged = f"orc_{uuid4().hex}_{'x' * 43}"
    async with _client(server, forged) as unknown:
        assert_problem(await unknown.get("/api/v1/jobs"), 401, "UNAUTHORIZED")
    secret = await token(orc.stores.tokens, "gone", Scope.READ)
    await orc.stores.tokens.revoke("gone")  # before its first use: nothing cached
    async with _client(server, secret) as revoked:
        assert_problem(await revoked.get("/api/v1/jobs"), 401, "UNAUTHORIZED")
    async with _client(server, None) as probes:  # probes and metrics stay open
        assert (await probes.get("/healthz")).status_code == 200
        assert (await probes.get("/readyz")).status_code == 200
        assert (await probes.get("/metrics")).status_code == 200


async def test_each_endpoint_needs_its_scope(orc: Orchestrator, server: ApiServer) -> None:
    reader = await token(orc.stores.tokens, "reader", Scope.READ)
    submitter = await token(orc.stores.tokens, "submitter", Scope.SUBMIT)
    async with _client(server, reader) as read, _client(server, submitter) as submit:
        job = {"job_type": "scripted", "payload": {"script": ["ok"]}}
        assert_problem(await read.post("/api/v1/jobs", json=job), 403, "FORBIDDEN")
        created = await submit.post("/api/v1/jobs", json=job)
        assert created.status_code == 201
        job_id = created.json()["job_id"]
        assert_problem(await submit.get(f"/api/v1/jobs/{job_id}"), 403, "FORBIDDEN")
        assert (await read.get(f"/api/v1/jobs/{job_id}")).json()["status"] == "PENDING"
        cancel = await read.post(f"/api/v1/jobs/{job_id}/cancel", json={})
        assert_problem(cancel, 403, "FORBIDDEN")
        claim = {"job_types": ["external_echo"], "worker": "w"}
        assert_problem(await read.post("/api/v1/internal/task-claim", json=claim), 403, "FORBIDDEN")


# -- jobs --------------------------------------------------------------------------------------


async def test_submit_read_list_and_cancel(orc: Orchestrator, admin: httpx.AsyncClient) -> None:
    spec = {"job_type": "scripted", "payload": {"script": ["ok"]}, "queue": "api",
            "priority": 5, "max_retries": 1, "agent_id": "a1", "tenant_id": "acme",
            "run_at": "2099-01-01T00:00:00Z", "timeout_seconds": 30,
            "trace_id": "0af7651916cd43dd8448eb211c80319c"}  # fmt: skip
    created = await admin.post("/api/v1/jobs", json=spec)
    assert created.status_code == 201 and created.json()["outcome"] == "created"
    job_id = created.json()["job_id"]
    job = (await admin.get(f"/api/v1/jobs/{job_id}")).json()
    assert job == (await orc.get_job(job_id)).model_dump(mode="json")
    assert (job["queue"], job["priority"], job["max_retries"], job["tenant_id"]) == (
        "api",
        5,
        1,
        "acme",
    )

    batch = await admin.post(
        "/api/v1/jobs/batch",
        json={"jobs": [{"job_type": "scripted", "payload": {"script": ["ok"]}, "agent_id": "b"}
                       for _ in range(3)]},
    )  # fmt: skip
    assert batch.status_code == 201 and len(batch.json()["jobs"]) == 3

    first = (await admin.get("/api/v1/jobs", params={"limit": 2})).json()
    second = (
        await admin.get("/api/v1/jobs", params={"limit": 2, "cursor": first["next_cursor"]})
    ).json()
    listed = [j["id"] for j in first["jobs"] + second["jobs"]]
    assert listed == sorted(listed, reverse=True) and len(set(listed)) == 4
    assert second["next_cursor"] is None
    agent_b = (await admin.get("/api/v1/jobs", params={"agent_id": "b"})).json()["jobs"]
    assert len(agent_b) == 3
    tenant = (await admin.get("/api/v1/jobs", params={"tenant_id": "acme"})).json()["jobs"]
    assert [j["id"] for j in tenant] == [job_id]
    by_status = [
        (await admin.get("/api/v1/jobs", params={"status": status})).json()
        for status in ("PENDING", "pending", "Pending")
    ]  # any case, as the CLI's --status
    assert by_status[0] == by_status[1] == by_status[2] and len(by_status[0]["jobs"]) == 4
    assert (await admin.get("/api/v1/jobs", params={"status": "done"})).status_code == 422

    cancelled = await admin.post(f"/api/v1/jobs/{job_id}/cancel", json={"reason": "done"})
    assert cancelled.json()["status"] == "CANCELLED"
    again = await admin.post(f"/api/v1/jobs/{job_id}/cancel", json={"reason": "again"})
    problem = assert_problem(again, 409, "WF_STATE_TRANSITION_INVALID")
    assert "CANCELLED" in problem["detail"]
    events = (await admin.get(f"/api/v1/jobs/{job_id}/events")).json()
    assert [e["kind"] for e in events["events"]] == ["job.created", "job.cancelled"]
    assert events["events"][1]["payload"]["by"] == "token:admin"
    later = await admin.get(
        f"/api/v1/jobs/{job_id}/events", params={"after": events["next_cursor"]}
    )
    assert later.json() == {"events": [], "next_cursor": events["next_cursor"]}


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"job_type": "no_such_type"}, 422, "JOB_TYPE_UNKNOWN"),
        ({"job_type": "scripted", "payload": {"script": "no"}}, 422, "PAYLOAD_INVALID"),
        ({"job_type": "scripted", "payload": {"script": ["ok"]}, "priority": 2**40}, 422,
         "REQUEST_INVALID"),
        ({"job_type": "scripted", "surprise": 1}, 422, "REQUEST_INVALID"),
        ({"job_type": "external_echo", "payload": {"x": float("inf")}}, 422, "PAYLOAD_INVALID"),
        ({"job_type": "external_echo", "queue": "elsewhere"}, 422, "SUBMIT_REJECTED"),
    ],
    ids=["unknown-type", "bad-payload", "huge-priority", "unknown-field", "not-json",
         "external-queue"],
)  # fmt: skip
async def test_a_bad_submit_is_refused_naming_the_problem_and_nothing_is_stored(
    orc: Orchestrator,
    admin: httpx.AsyncClient,
    db: psycopg.AsyncConnection[Any],
    body: dict[str, Any],
    status: int,
    code: str,
) -> None:
    content = json.dumps(body).replace("Infinity", "1e999")
    response = await admin.post(
        "/api/v1/jobs", content=content, headers={"content-type": "application/json"}
    )
    assert_problem(response, status, code)
    assert await (await db.execute("SELECT count(*) FROM orc_jobs")).fetchone() == (0,)


async def test_malformed_and_oversized_requests_are_refused(
    admin: httpx.AsyncClient, db: psycopg.AsyncConnection[Any]
) -> None:
    # A body that is no JSON document is 400 (docs/api.md), on every endpoint that takes one;
    # a JSON document the API cannot take is 422.
    as_json = {"content-type": "application/json"}
    for path in ("/api/v1/jobs", f"/api/v1/jobs/{uuid4()}/cancel", "/api/v1/internal/heartbeat"):
        malformed = await admin.post(path, content=b"{oops", headers=as_json)
        problem = assert_problem(malformed, 400, "REQUEST_INVALID")
        assert problem["detail"].startswith("body: not valid JSON (Expecting"), problem
    spec = json.dumps({"job_type": "scripted", "payload": {"script": ["ok"]}}).encode()
    as_text = await admin.post("/api/v1/jobs", content=spec, headers={"content-type": "text/plain"})
    assert "content-type text/plain" in assert_problem(as_text, 400, "REQUEST_INVALID")["detail"]
    assert_problem(await admin.post("/api/v1/jobs", json=[]), 422, "REQUEST_INVALID")
    huge = {"job_type": "scripted", "payload": {"script": ["x" * (5 * 1024 * 1024)]}}
    assert_problem(await admin.post("/api/v1/jobs", json=huge), 413, "REQUEST_TOO_LARGE")
    assert_problem(await admin.get(f"/api/v1/jobs/{uuid4()}"), 404, "JOB_NOT_FOUND")
    assert_problem(await admin.get("/api/v1/jobs/not-an-id"), 422, "REQUEST_INVALID")
    assert_problem(await admin.get("/api/v1/nothing-here"), 404, "NOT_FOUND")
    assert await (await db.execute("SELECT count(*) FROM orc_jobs")).fetchone() == (0,)


async def test_a_request_without_a_live_token_is_401_whatever_else_is_wrong_with_it(
    orc: Orchestrator, server: ApiServer, db: psycopg.AsyncConnection[Any]
) -> None:
    # docs/api.md, "Auth": the token is checked first, before the body's size, the URL's text or
    # the body itself are looked at; a caller without one learns nothing else.
    as_json = {"content-type": "application/json"}
    huge = {"job_type": "scripted", "payload": {"script": ["x" * (5 * 1024 * 1024)]}}
    for secret in (None, "orc_0_nonsense"):
        async with _client(server, secret) as anonymous:
            for answer in (
                await anonymous.post("/api/v1/jobs", content=b"{oops", headers=as_json),
                await anonymous.post("/api/v1/internal/heartbeat", content=b"{", headers=as_json),
                await anonymous.post("/api/v1/jobs", json=huge),
                await anonymous.get("/api/v1/jobs", params={"job_key": "a\x00b"}),
                await anonymous.get("/api/v1/jobs/not-an-id"),
                await anonymous.get("/api/v1/nothing-here"),
            ):
                assert_problem(answer, 401, "UNAUTHORIZED")
            assert (await anonymous.get("/api/v1/openapi.json")).status_code == 200
    assert await (await db.execute("SELECT count(*) FROM orc_jobs")).fetchone() == (0,)


async def test_an_idempotency_key_makes_a_submit_happen_once(admin: httpx.AsyncClient) -> None:
    spec = {"job_type": "scripted", "payload": {"script": ["ok"]}}
    key = {"Idempotency-Key": "order-17"}
    first = await admin.post("/api/v1/jobs", json=spec, headers=key)
    second = await admin.post("/api/v1/jobs", json=spec, headers=key)
    assert first.json()["job_id"] == second.json()["job_id"]
    assert (first.json()["outcome"], second.json()["outcome"]) == ("created", "deduplicated")
    job = (await admin.get(f"/api/v1/jobs/{first.json()['job_id']}")).json()
    assert job["job_key"] == "idempotency/-/order-17"  # docs/api.md: idempotency/<tenant>/K
    both = await admin.post("/api/v1/jobs", json={**spec, "job_key": "k"}, headers=key)
    assert_problem(both, 422, "SUBMIT_REJECTED")


async def test_a_wait_returns_the_moment_the_job_finishes(
    orc: Orchestrator, admin: httpx.AsyncClient, server: ApiServer
) -> None:
    job_id = (
        await admin.post("/api/v1/jobs", json={"job_type": "scripted",
                                               "payload": {"script": ["sleep:1", "ok"]}})
    ).json()["job_id"]  # fmt: skip
    quick = await admin.get(f"/api/v1/jobs/{job_id}/wait", params={"timeout": 0.2})
    assert quick.json()["finished"] is False and quick.json()["job"]["status"] == "PENDING"
    async with WorkerRun(orc):
        started = time.monotonic()
        waited = await admin.get(f"/api/v1/jobs/{job_id}/wait", params={"timeout": 20})
        took = time.monotonic() - started
    assert waited.json()["finished"] is True and waited.json()["job"]["status"] == "COMPLETED"
    assert took < 5  # woken by the completion, not at the end of the wait
    async with AsyncClient(server.url, await token(orc.stores.tokens, "py")) as api:
        outcome = await api.wait(job_id, seconds=1)
        assert outcome.finished and outcome.job.status is Status.COMPLETED
        with pytest.raises(ApiError) as missing:
            await api.get_job(uuid4())
        assert (missing.value.status, missing.value.code) == (404, "JOB_NOT_FOUND")


async def test_the_python_client_reads_and_steers_flow_keys_and_reads_usage(
    orc: Orchestrator, server: ApiServer, db: psycopg.AsyncConnection[Any]
) -> None:
    await db.execute(
        "INSERT INTO orc_flow_keys (key, limit_name, task_prefix) VALUES ('provider/m:1', 'l', 'orc.')"
    )  # a key with a slash: the client quotes it as one path segment
    async with AsyncClient(server.url, await token(orc.stores.tokens, "py")) as api:
        [key] = await api.flow_keys()
        assert (key.key, key.paused_until) == ("provider/m:1", None)
        paused = await api.pause_flow_key("provider/m:1", 60, reason="provider incident")
        assert paused.paused_until is not None and paused.pause_reason == "provider incident"
        assert (await api.flow_key("provider/m:1")).paused_by == paused.paused_by == "token:py"
        assert (await api.resume_flow_key("provider/m:1")).paused_until is None
        with pytest.raises(ApiError) as missing:
            await api.flow_key("no-such-key")
        assert (missing.value.status, missing.value.code) == (404, "FLOW_KEY_NOT_FOUND")
        assert (await api.usage(by="model"))["totals"] == []
        job_id = await api.submit("scripted", {"script": ["ok"]})
        assert (await api.job_usage(job_id))["calls"] == []


async def test_a_job_s_events_stream_live_until_it_finishes(
    orc: Orchestrator, admin: httpx.AsyncClient
) -> None:
    job_id = (
        await admin.post("/api/v1/jobs", json={"job_type": "scripted",
                                               "payload": {"script": ["app", "ok"]}})
    ).json()["job_id"]  # fmt: skip
    seen: list[tuple[int, str]] = []

    async def read() -> None:
        async with admin.stream("GET", f"/api/v1/jobs/{job_id}/stream") as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            event_id = kind = None
            async for line in response.aiter_lines():
                if line.startswith("id: "):
                    event_id = int(line[4:])
                elif line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    assert json.loads(line[6:])["kind"] == kind
                    assert event_id is not None and kind is not None
                    seen.append((event_id, kind))

    reader = asyncio.create_task(read())
    await asyncio.sleep(0.5)  # the stream is open, the job not yet run
    async with WorkerRun(orc):
        await asyncio.wait_for(reader, 20)  # it ends by itself once the job has finished
    assert [kind for _, kind in seen] == [
        "job.created",
        "job.running",
        "job.failed",
        "job.retry_scheduled",
        "job.running",
        "job.completed",
    ]
    assert [event_id for event_id, _ in seen] == sorted(event_id for event_id, _ in seen)
    resumed = await admin.get(
        f"/api/v1/jobs/{job_id}/stream", headers={"Last-Event-ID": str(seen[3][0])}
    )
    assert resumed.text.count("event: ") == 2  # only what came after


# -- tenants -----------------------------------------------------------------------------------


@log_guard.fails_jobs("HTTP_400")
async def test_a_tenant_s_token_never_reaches_another_tenant_s_jobs(
    orc: Orchestrator, server: ApiServer
) -> None:
    theirs = await orc.submit("scripted", {"script": ["permanent"]}, tenant_id="b")
    nobody_s = await orc.submit("scripted", {"script": ["ok"]})
    async with WorkerRun(orc) as worker:
        await worker.until_finished(theirs)
    [letter] = await orc.dead_letters()
    a = await token(orc.stores.tokens, "tenant-a", Scope.READ, Scope.SUBMIT, Scope.OPERATE,
                    tenants=["a"])  # fmt: skip
    async with _client(server, a) as client:
        mine = await client.post(
            "/api/v1/jobs", json={"job_type": "scripted", "payload": {"script": ["ok"]}}
        )
        assert mine.status_code == 201  # into its one tenant
        assert (await orc.get_job(mine.json()["job_id"])).tenant_id == "a"
        for job_id in (theirs, nobody_s):  # ids known or guessed: as if they did not exist
            assert_problem(await client.get(f"/api/v1/jobs/{job_id}"), 404, "JOB_NOT_FOUND")
            assert_problem(await client.get(f"/api/v1/jobs/{job_id}/events"), 404, "JOB_NOT_FOUND")
            assert_problem(
                await client.post(f"/api/v1/jobs/{job_id}/cancel", json={}), 404, "JOB_NOT_FOUND"
            )
        listed = (await client.get("/api/v1/jobs")).json()["jobs"]
        assert [j["id"] for j in listed] == [mine.json()["job_id"]]
        other = await client.post(
            "/api/v1/jobs", json={"job_type": "scripted", "payload": {"script": ["ok"]},
                                  "tenant_id": "b"},
        )  # fmt: skip
        assert_problem(other, 403, "FORBIDDEN")
        assert (await client.get("/api/v1/dead-letters")).json() == {"dead_letters": []}
        assert_problem(
            await client.get(f"/api/v1/dead-letters/{letter.id}"), 404, "DEAD_LETTER_NOT_FOUND"
        )
        requeue = await client.post(f"/api/v1/dead-letters/{letter.id}/requeue")
        assert_problem(requeue, 404, "DEAD_LETTER_NOT_FOUND")
        queues = (await client.get("/api/v1/queues")).json()["queues"]
        assert sum(q["pending"] for q in queues) == 1  # its own job only
    assert (await orc.dead_letter(letter.id)).state == "recorded"


# -- operator actions --------------------------------------------------------------------------


@log_guard.fails_jobs("HTTP_400")
async def test_dead_letters_are_requeued_and_discarded_by_two_principals(
    orc: Orchestrator, server: ApiServer
) -> None:
    doomed = [await orc.submit("scripted", {"script": ["permanent"]}) for _ in range(3)]
    async with WorkerRun(orc) as worker:
        await worker.until_finished(*doomed)
    first, second, first_again = await orc.dead_letters()
    alice = await token(orc.stores.tokens, "alice", Scope.READ, Scope.OPERATE)
    bob = await token(orc.stores.tokens, "bob", Scope.READ, Scope.OPERATE)
    async with _client(server, alice) as a, _client(server, bob) as b:
        listed = (await a.get("/api/v1/dead-letters", params={"state": "recorded"})).json()
        assert {d["id"] for d in listed["dead_letters"]} == {
            str(first.id),
            str(second.id),
            str(first_again.id),
        }
        requeued = (await a.post(f"/api/v1/dead-letters/{first.id}/requeue")).json()
        assert (await orc.get_job(requeued["job_id"])).status is Status.PENDING

        no_reason = await a.post(f"/api/v1/dead-letters/{second.id}/discard-request", json={})
        assert_problem(no_reason, 422, "REQUEST_INVALID")
        asked = await a.post(
            f"/api/v1/dead-letters/{second.id}/discard-request", json={"reason": "a test"}
        )
        assert asked.json()["discard_requested_by"] == "token:alice"
        alone = await a.post(f"/api/v1/dead-letters/{second.id}/discard-confirm")
        assert_problem(alone, 409, "DLQ_ACTION_INVALID")  # the same principal cannot confirm
        capital_i = await token(orc.stores.tokens, "Ik", Scope.OPERATE)  # looks like lk
        await orc.request_discard(first_again.id, by="lk (cli:root)", reason="stale")
        async with _client(server, capital_i) as i:
            look_alike = await i.post(f"/api/v1/dead-letters/{first_again.id}/discard-confirm")
        assert_problem(look_alike, 409, "DLQ_ACTION_INVALID")  # issue 43: lk's person
        assert "and token:Ik is the same person" in look_alike.text
        confirmed = await b.post(f"/api/v1/dead-letters/{second.id}/discard-confirm")
        assert confirmed.json()["state"] == "discarded"
        assert confirmed.json()["discarded_by"] == "token:bob"


async def test_approvals_are_listed_approved_and_rejected(
    orc: Orchestrator, admin: httpx.AsyncClient
) -> None:
    with message_service() as service:
        plan: dict[str, Any] = {"service": service.url, "approval_at": 1}
        approved, rejected = [await orc.submit("agent", plan) for _ in range(2)]
        async with WorkerRun(orc) as worker:

            async def both_waiting() -> bool:
                jobs = [await orc.get_job(j) for j in (approved, rejected)]
                return all(j.status is Status.WAITING_APPROVAL for j in jobs)

            await wait_for(both_waiting)
            pending = (await admin.get("/api/v1/approvals")).json()["approvals"]
            by_job = {UUID(a["job_id"]): a for a in pending}
            yes = await admin.post(
                f"/api/v1/approvals/{by_job[approved]['id']}/approve", json={"reason": "fine"}
            )
            assert yes.json()["status"] == "approved"
            assert yes.json()["decided_by"] == "token:admin"
            no = await admin.post(
                f"/api/v1/approvals/{by_job[rejected]['id']}/reject", json={"reason": "no"}
            )
            assert no.json()["status"] == "rejected"
            await worker.until_finished(approved, rejected)
        twice = await admin.post(
            f"/api/v1/approvals/{by_job[approved]['id']}/approve", json={"reason": "again"}
        )
        assert_problem(twice, 409, "APPROVAL_INVALID")

        async def listed(query: str) -> dict[UUID, str]:
            answer = (await admin.get(f"/api/v1/approvals{query}")).json()["approvals"]
            return {UUID(a["job_id"]): a["status"] for a in answer}

        assert await listed("") == {}  # pending only, by default
        assert await listed("?status=approved") == {approved: "approved"}
        assert await listed("?status=all") == {approved: "approved", rejected: "rejected"}
    assert (await orc.get_job(approved)).status is Status.COMPLETED
    assert (await orc.get_job(rejected)).status is Status.FAILED
    assert_problem(await admin.get(f"/api/v1/approvals/{uuid4()}"), 404, "APPROVAL_NOT_FOUND")


async def test_the_config_queues_and_steps_are_readable(
    orc: Orchestrator, admin: httpx.AsyncClient
) -> None:
    answer = await admin.get("/api/v1/config")
    config = answer.json()
    assert config["job_types"]["external_echo"]["external"] is True
    # not where the server read it: its file system is its own
    assert "path" not in config and str(api_app.CONFIG) not in answer.text
    assert config["job_types"]["scripted"]["worker_max_attempts"] == 4
    await orc.submit("scripted", {"script": ["ok"]}, queue="stats")
    [stats] = (await admin.get("/api/v1/queues")).json()["queues"]
    assert (stats["queue"], stats["pending"], stats["due"]) == ("stats", 1, 1)
    with message_service() as service:
        job_id = await orc.submit("agent", {"service": service.url, "steps": 2, "send_at": [1]})
        async with WorkerRun(orc) as worker:
            await worker.until_finished(job_id)
    steps = (await admin.get(f"/api/v1/jobs/{job_id}/steps")).json()["steps"]
    assert [s["kind"] for s in steps].count("checkpoint") == 2
    assert [s["status"] for s in steps if s["kind"] == "side_effect"] == ["committed"]


async def test_the_openapi_document_is_served_and_checked_in(
    admin: httpx.AsyncClient,
) -> None:
    from tests.support.harness import ROOT

    served = (await admin.get("/api/v1/openapi.json")).json()
    checked_in = json.loads((ROOT / "docs" / "openapi.json").read_text())
    assert served == checked_in, "docs/openapi.json is stale: ./dev orchestrator openapi"


async def test_the_openapi_document_is_the_one_api_path_served_without_a_token(
    server: ApiServer,
) -> None:
    """The decision of docs/api.md ("Auth"), held: the document is open (it describes the API
    and holds no data), and it says so; every operation in it declares the bearer token and
    refuses a request without one."""
    async with _client(server, None) as anonymous:
        served = await anonymous.get("/api/v1/openapi.json")
        assert served.status_code == 200
        document = served.json()
        assert "this document itself is served without one" in document["info"]["description"]
        operations = [(m, p, op) for p, ops in document["paths"].items() for m, op in ops.items()]
        assert len(operations) > 20
        for method, path, operation in operations:
            assert operation["security"] == [{"HTTPBearer": []}], (method, path)
            assert "401" in operation["responses"], (method, path)
            concrete = re.sub(r"\{[^}]+\}", str(uuid4()), path)
            answer = await anonymous.request(method.upper(), concrete)
            assert_problem(answer, 401, "UNAUTHORIZED")


# -- the dead-letter spec's replay endpoints ---------------------------------------------------


async def test_the_replay_endpoints_are_off_by_default(
    orc: Orchestrator, admin: httpx.AsyncClient
) -> None:
    job_id = await orc.submit("scripted", {"script": ["ok"]})
    assert_problem(await admin.post(f"/api/v1/internal/jobs/{job_id}/run"), 404, "NOT_FOUND")


@log_guard.fails_jobs("REPLAY_FORCE_FAIL", "REPLAY_TRANSIENT_FAIL")
async def test_the_replay_endpoints_reproduce_rp_001_to_rp_004(
    orc: Orchestrator, replaying: ApiServer
) -> None:
    admin_secret = await token(orc.stores.tokens, "replayer", Scope.ADMIN)
    operator = await token(orc.stores.tokens, "op", Scope.READ, Scope.OPERATE)
    async with _client(replaying, admin_secret) as api, _client(replaying, operator) as op:
        ok, forced, transient, once = [
            await orc.submit("scripted", {"script": ["ok"]}) for _ in range(4)
        ]
        assert_problem(await op.post(f"/api/v1/internal/jobs/{ok}/run"), 403, "FORBIDDEN")
        # RP-001: queued -> running -> succeeded
        run = (await api.post(f"/api/v1/internal/jobs/{ok}/run")).json()
        assert (run["outcome"], run["job"]["status"]) == ("completed", "COMPLETED")
        # force_fail: straight to the dead-letter terminal path
        run = (await api.post(f"/api/v1/internal/jobs/{forced}/run",
                              params={"force_fail": "true"})).json()  # fmt: skip
        assert (run["outcome"], run["job"]["status"]) == ("failed", "FAILED")
        # RP-002: one transient failure, then success: retry_count = 1
        await api.post(f"/api/v1/internal/jobs/{once}/run", params={"transient_fail": "true"})
        run = (await api.post(f"/api/v1/internal/jobs/{once}/run")).json()
        assert (run["job"]["status"], run["job"]["retry_count"]) == ("COMPLETED", 1)
        # RP-003 / RP-004: failures 1-3 retry and count; the 4th goes to the dead letter
        for n in range(1, 5):
            run = (await api.post(f"/api/v1/internal/jobs/{transient}/run",
                                  params={"transient_fail": "true"})).json()  # fmt: skip
            expected = ("retried", "RETRY", n) if n <= 3 else ("failed", "FAILED", 3)
            assert (run["outcome"], run["job"]["status"], run["job"]["retry_count"]) == expected
        # RP-005: a finished job is not run again
        again = await api.post(f"/api/v1/internal/jobs/{ok}/run")
        assert_problem(again, 409, "WF_STATE_TRANSITION_INVALID")
    events = [e.kind for e in await orc.job_events(transient)]
    assert events[-3:] == ["job.dead_lettered", "job.failed", "job.degraded"]
    assert events.count("job.retry_scheduled") == 3
    letter_of = {letter.job_id: letter for letter in await orc.dead_letters()}
    assert set(letter_of) == {forced, transient}
