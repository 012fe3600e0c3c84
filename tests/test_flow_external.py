"""Every LLM call of an external job is admitted in its flow key's window too (docs/api.md, "An
external worker's LLM calls"): a real ``orchestrator serve``, a real database, the Node.js
worker and the local LLM server. The worker admits each call over the API before it sends it
(go, once a room a moment off has come, or park: the attempt ends as an in-process park does) and records its usage
after; the same rule and writers as ``ctx.admit_call`` and ``ctx.record_llm_usage``. Every report
is taken only from the attempt that holds the lease, and only from a fleet worker's token:
stale leases and other tenants' tokens are refused, and nothing is recorded."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import psycopg
import pytest

from demo import llm_server as llm
from orchestrator import Orchestrator, Status
from orchestrator.domain.principals import Scope
from tests.support.api_server import ApiServer, api_orchestrator, token
from tests.support.harness import wait_for
from tests.support.node_worker import NodeWorker

ADMIT, USAGE = "/api/v1/internal/call-admit", "/api/v1/internal/call-usage"
HOURLY = "external-hourly:m"  # external_agent's key: 2 requests an hour (tests/support/api_app.py)
QUICK = "external-quick:m"  # external_quick's: 1 request each 1.5 s
QUICK_INTERVAL = 1.5


@pytest.fixture
async def orc(make_orc: Callable[..., Orchestrator]) -> Orchestrator:
    return await api_orchestrator(make_orc)


@pytest.fixture
async def server(dsn: str, orc: Orchestrator) -> AsyncIterator[ApiServer]:
    """Started on the test's empty tables: it writes the limits as it starts."""
    with ApiServer(dsn) as running:
        yield running


@pytest.fixture
async def api(orc: Orchestrator, server: ApiServer) -> AsyncIterator[httpx.AsyncClient]:
    secret = await token(orc.stores.tokens, "fleet", Scope.WORKER)
    async with _client(server, secret) as client:
        yield client


@pytest.fixture
def model_server() -> Iterator[llm.LocalLLM]:
    with llm.serve() as running:
        yield running


@pytest.fixture
def nodes() -> Iterator[list[NodeWorker]]:
    started: list[NodeWorker] = []
    yield started
    for node in started:
        node.stop(signal.SIGKILL)


def _client(server: ApiServer, secret: str) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {secret}"}
    return httpx.AsyncClient(base_url=server.url, headers=headers, timeout=30)


async def _claim(api: httpx.AsyncClient, job_type: str) -> dict[str, Any]:
    """The lease of the one job of ``job_type`` due (waiting for it to come due)."""
    claim = {"job_types": [job_type], "worker": "py", "wait_seconds": 10}
    answer = await api.post("/api/v1/internal/task-claim", json=claim)
    [task] = answer.json()["tasks"]
    return {
        "job_id": task["job_id"],
        "attempt": task["attempt"],
        "lease_token": task["lease_token"],
    }


async def _spends(db: psycopg.AsyncConnection[Any], job_id: Any) -> list[tuple[int, float, int]]:
    """The job's spends in its key's window: (id, at in epoch seconds, units), by id."""
    cur = await db.execute(
        "SELECT id, extract(epoch FROM at)::float8, units FROM orc_flow_spends"
        " WHERE job_id = %s ORDER BY id",
        (job_id,),
    )
    return [(int(i), float(at), int(u)) for i, at, u in await cur.fetchall()]


#: What a call's admission or usage writes: read back after each refused report.
RECORDS = ("orc_jobs", "orc_job_events", "orc_flow_spends", "orc_flow_spent_calls",
           "orc_flow_waiters", "orc_llm_usage", "orc_flow_keys")  # fmt: skip
SNAPSHOT = " UNION ALL ".join(
    f"SELECT '{table}', md5(coalesce(string_agg(t::text, '|' ORDER BY t::text), ''))"
    f" FROM {table} AS t"
    for table in RECORDS
)


async def _records(db: psycopg.AsyncConnection[Any]) -> dict[str, str]:
    return dict(await (await db.execute(SNAPSHOT)).fetchall())


async def test_an_external_job_of_five_calls_gets_two_admitted_and_parks_at_the_third(
    orc: Orchestrator, server: ApiServer, nodes: list[NodeWorker], tmp_path: Path,
    model_server: llm.LocalLLM, db: psycopg.AsyncConnection[Any],
) -> None:  # fmt: skip
    """The reproduction: under ``requests = 2`` an hour, the Node.js worker's job of five calls
    sends two (the claim's admission is the first's), and its third call parks it: the attempt
    ends with the job PENDING in its key's line, no budget used, and the worker stops without
    completing it. Before, an external job's calls after its claim were never admitted: all
    five reached the provider."""
    secret = await token(orc.stores.tokens, "node", Scope.WORKER)
    node = NodeWorker(server, secret, "node-1", tmp_path, job_type="external_agent")
    nodes.append(node)
    payload = {"model": "m", "calls": 5, "llm_url": model_server.url}
    job_id = await orc.submit("external_agent", payload)

    async def parked() -> bool:
        return any(e["event"] == "parked" for e in node.events(job_id))

    await wait_for(parked, timeout=30)
    events = [(e["event"], e.get("call")) for e in node.events(job_id)]
    assert events == [
        ("claimed", None), ("call_admitted", 1), ("call_recorded", 1), ("call_admitted", 2),
        ("call_recorded", 2), ("parked", 3),
    ]  # fmt: skip
    [stop] = [e for e in node.events(job_id) if e["event"] == "parked"]
    assert (stop["key"], stop["waiting_on"]) == (HOURLY, "requests")
    assert model_server.requests["m"] == 2
    job = await orc.get_job(job_id)
    assert (job.status, job.attempt, job.retry_count) == (Status.PENDING, 1, 0)
    assert job.waiting_for is not None and "its requests per interval are spent" in job.waiting_for
    kinds = [e.kind for e in await orc.job_events(job_id)]
    assert kinds[-1] == "job.waiting_for_capacity" and "job.completed" not in kinds
    # each call's spend reconciled to its reply's usage, and the key's window holds two
    spends = await _spends(db, job_id)
    assert len(spends) == 2
    cur = await db.execute(
        "SELECT count(*), sum(input_tokens + output_tokens) FROM orc_llm_usage WHERE job_id = %s",
        (job_id,),
    )
    calls, tokens = await cur.fetchone() or (0, 0)
    assert calls == 2 and sum(units for _, _, units in spends) == tokens
    [key] = await orc.flow_keys(HOURLY)
    assert (key.requests_used, key.waiting) == (2, 1)
    await asyncio.sleep(0.5)  # the worker has stopped the attempt: nothing more reached anyone
    assert model_server.requests["m"] == 2 and len(await _spends(db, job_id)) == 2


async def test_calls_admitted_before_any_usage_is_recorded_each_count_once(
    orc: Orchestrator, api: httpx.AsyncClient, db: psycopg.AsyncConnection[Any]
) -> None:
    """Calls sent together (no usage recorded between them): the first takes the claim's
    reservation (no spend more), the second is a request more, the third parks the job, which
    gives the reservation nothing back (a call used it)."""
    job_id = await orc.submit("external_agent", {"model": "m"})
    lease = await _claim(api, "external_agent")
    [(reserved, _, _)] = await _spends(db, job_id)
    answers = [(await api.post(ADMIT, json={**lease, "units": 30})).json() for _ in range(3)]
    assert [a["decision"] for a in answers] == ["go", "go", "park"], answers
    spends = await _spends(db, job_id)
    assert len(spends) == 2 and spends[0][::2] == (reserved, 30)  # the reservation, moved
    job = await orc.get_job(job_id)
    assert job.status is Status.PENDING and job.waiting_for is not None
    again = await api.post(ADMIT, json={**lease, "units": 30})  # the attempt is over
    assert (again.status_code, again.json()["code"]) == (409, "WF_LEASE_STALE")


async def test_a_call_asked_again_under_its_call_id_is_answered_as_it_was_and_counted_once(
    orc: Orchestrator, api: httpx.AsyncClient, db: psycopg.AsyncConnection[Any]
) -> None:
    """An answer lost on the way: the worker asks again under the same call id and is answered
    ``go`` as before, the window counting the call once (under two requests an hour, the second
    call asked again would otherwise park the job); a new call id is a new call (the third
    parks). A stale lease is refused even for a call id admitted before."""
    job_id = await orc.submit("external_agent", {"model": "m"})
    lease = await _claim(api, "external_agent")

    async def ask(call_id: str) -> dict[str, Any]:
        answer = await api.post(ADMIT, json={**lease, "units": 30, "call_id": call_id})
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    assert (await ask("c1"))["decision"] == "go"
    assert (await ask("c1"))["decision"] == "go"  # its answer lost: asked again
    [key] = await orc.flow_keys(HOURLY)
    assert key.requests_used == 1  # the claim's reservation, taken by the first call
    assert (await ask("c2"))["decision"] == "go"
    assert (await ask("c2"))["decision"] == "go"
    [key] = await orc.flow_keys(HOURLY)
    assert key.requests_used == 2 and len(await _spends(db, job_id)) == 2
    third = await ask("c3")
    assert (third["decision"], third["key"], third["waiting_on"]) == ("park", HOURLY, "requests")
    again = await api.post(ADMIT, json={**lease, "units": 30, "call_id": "c1"})
    assert (again.status_code, again.json()["code"]) == (409, "WF_LEASE_STALE")


async def test_a_call_whose_room_comes_soon_waits_in_place_and_one_further_off_parks(
    orc: Orchestrator, api: httpx.AsyncClient, db: psycopg.AsyncConnection[Any]
) -> None:
    """One call each 1.5 s: the second call, asked a moment before the first's request leaves
    the window, is answered "go" once it has (the request waits for it in place, the room
    reserved); the third, asked at once, would wait 1.5 s: its job parks. Handed its room, the
    job's next claim is a new attempt, whose first call takes that claim's reservation."""
    job_id = await orc.submit("external_quick", {"model": "m"})
    lease = await _claim(api, "external_quick")
    first = (await api.post(ADMIT, json=lease)).json()
    went = time.monotonic()
    assert first == {"decision": "go", "key": None, "waiting_on": None}
    [(_, one, _)] = await _spends(db, job_id)
    await asyncio.sleep(QUICK_INTERVAL - (time.monotonic() - went) - 0.15)
    second = (await api.post(ADMIT, json=lease)).json()
    assert second["decision"] == "go", second  # its room was a moment off: it waited for it
    two = (await _spends(db, job_id))[-1][1]  # (the first's left the window: it is gone)
    assert two - one >= QUICK_INTERVAL  # the window held: never two calls in 1.5 s
    third = (await api.post(ADMIT, json=lease)).json()
    assert (third["decision"], third["key"], third["waiting_on"]) == ("park", QUICK, "requests")
    assert (await orc.get_job(job_id)).status is Status.PENDING
    resumed = await _claim(api, "external_quick")  # its room handed to it
    assert resumed["attempt"] == 2 and resumed["lease_token"] != lease["lease_token"]
    reserved = (await _spends(db, job_id))[-1]
    assert (await api.post(ADMIT, json=resumed)).json()["decision"] == "go"
    assert (await _spends(db, job_id))[-1][0] == reserved[0]  # the claim's reservation, taken


async def test_usage_is_dated_on_the_database_s_clock_and_recorded_once(
    orc: Orchestrator, api: httpx.AsyncClient, db: psycopg.AsyncConnection[Any]
) -> None:
    """A call's usage reconciles its admission's estimate, dated ``sent_seconds_ago`` before the
    report by the database's clock (the worker's clock is never read); reported again under its
    call id, nothing changes."""
    job_id = await orc.submit("external_agent", {"model": "m"}, tenant_id="acme")
    lease = await _claim(api, "external_agent")
    assert (await api.post(ADMIT, json={**lease, "units": 500})).json()["decision"] == "go"
    [(_, admitted, units)] = await _spends(db, job_id)
    assert units == 500
    await asyncio.sleep(0.5)
    usage = {**lease, "model": "m", "input_tokens": 40, "output_tokens": 12,
             "cache_read_tokens": 7, "cache_creation_tokens": 3, "call_id": "msg_1",
             "sent_seconds_ago": 0.2}  # fmt: skip
    answer = await api.post(USAGE, json=usage)
    assert answer.json() == {"recorded": True}, answer.text
    now = (await (await db.execute("SELECT extract(epoch FROM clock_timestamp())")).fetchone())[0]
    [(_, at, units)] = await _spends(db, job_id)
    assert units == 40 + 3 + 12  # as providers count: cache reads are not
    assert admitted + 0.3 - 0.01 <= at <= float(now) - 0.2
    [row] = await (
        await db.execute(
            "SELECT tenant_id, job_type, model, attempt, input_tokens, output_tokens,"
            " cache_read_tokens, cache_creation_tokens FROM orc_llm_usage WHERE call_id = 'msg_1'"
        )
    ).fetchall()
    assert row == ("acme", "external_agent", "m", 1, 40, 12, 7, 3)
    before = await _records(db)
    assert (await api.post(USAGE, json=usage)).json() == {"recorded": False}
    assert await _records(db) == before


async def test_a_report_without_the_lease_or_from_another_tenant_s_token_records_nothing(
    orc: Orchestrator, server: ApiServer, api: httpx.AsyncClient,
    db: psycopg.AsyncConnection[Any],
) -> None:  # fmt: skip
    """The attacker: with a stale lease (a wrong token or attempt, an unknown job, a finished
    one) both reports get 409 WF_LEASE_STALE; with another tenant's token, even one holding the
    right lease, and with a worker token limited to the job's own tenant, 403. Nothing is
    recorded, and the lease's holder is admitted afterwards."""
    done_id = await orc.submit("external_echo", {"output": 1}, tenant_id="acme")
    done = await _claim(api, "external_echo")
    complete = {**done, "status": "success", "output": 1}
    assert (await api.post("/api/v1/internal/task-complete", json=complete)).is_success
    job_id = await orc.submit("external_agent", {"model": "m"}, tenant_id="acme")
    lease = await _claim(api, "external_agent")
    assert (done["job_id"], lease["job_id"]) == (str(done_id), str(job_id))
    stale = {
        "another's token": {**lease, "lease_token": str(uuid4())},
        "another attempt": {**lease, "attempt": 2},
        "unknown job": {**lease, "job_id": str(uuid4())},
        "finished": done,
    }
    reports = {ADMIT: {"units": 10}, USAGE: {"model": "m", "input_tokens": 9, "call_id": "x"}}
    before = await _records(db)
    for case, held in stale.items():
        for path, body in reports.items():
            answer = await api.post(path, json={**held, **body})
            assert (answer.status_code, answer.json()["code"]) == (409, "WF_LEASE_STALE"), (
                case, path, answer.text,
            )  # fmt: skip
            assert answer.json()["detail"] == (
                f"WF_LEASE_STALE: job {held['job_id']} is not leased by this attempt; "
                "write rejected"
            )
    assert await _records(db) == before
    theirs = await token(orc.stores.tokens, "globex", Scope.ADMIN, tenants=["globex"])
    own = await token(orc.stores.tokens, "acme-worker", Scope.WORKER)
    await db.execute("UPDATE orc_api_tokens SET tenants = '{acme}' WHERE name = 'acme-worker'")
    for secret in (theirs, own):
        async with _client(server, secret) as attacker:
            for path, body in reports.items():
                answer = await attacker.post(path, json={**lease, **body})
                assert (answer.status_code, answer.json()["code"]) == (403, "FORBIDDEN"), path
                assert str(job_id) not in answer.text
    assert await _records(db) == before
    # the lease's holder, with a fleet worker's token: admitted, and its usage recorded
    assert (await api.post(ADMIT, json={**lease, "units": 10})).json()["decision"] == "go"
    assert (await api.post(USAGE, json={**lease, **reports[USAGE]})).json() == {"recorded": True}
    document = (await api.get("/api/v1/openapi.json")).json()
    for path in reports:
        declared = document["paths"][path]["post"]["responses"]
        assert "404" not in declared and "WF_LEASE_STALE" in declared["409"]["description"]
