"""Every error code of docs/api.md that the other API tests do not provoke, each answered by a
real ``orchestrator serve`` for a real reason: its database server stopped
(``DATABASE_UNAVAILABLE``), its database emptied or restored to an older schema under it
(``SCHEMA_OUTDATED``), a cancel that loses every deadlock it runs into (``DATABASE_CONFLICT``),
a database function gone while the schema says it is whole (``INTERNAL``, with nothing of the
server's insides in the answer); and the documented limits: ``/metrics`` behind a token with
``ORCHESTRATOR_API_OPEN_METRICS=false``, the wait cap, the stream's keep-alive ping, and an
approval that expires (its record's final state, and the person told)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import psycopg
import pytest
from psycopg import conninfo

import tasks
from orchestrator import Orchestrator, Status
from orchestrator.domain.principals import Scope
from orchestrator.storage.database import drop_database, ensure_database, with_database
from orchestrator.storage.migrate import migrate
from orchestrator.storage.runner import CONFLICT_TRIES
from tests.support import agent_app, http_peers
from tests.support.api_server import ApiServer, token
from tests.support.cluster import Cluster
from tests.support.external import message_service
from tests.support.harness import WorkerRun, config_with, settings_for_tests, wait_for

PROBLEM = "application/problem+json"
SCRIPTED = {"job_type": "scripted", "payload": {"script": ["ok"]}}


def assert_problem(answer: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"].startswith(PROBLEM), answer.headers
    problem: dict[str, Any] = answer.json()
    assert (problem["status"], problem["code"]) == (status, code), problem
    return problem


def client(server: ApiServer, secret: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    return httpx.AsyncClient(base_url=server.url, headers=headers, timeout=60)


async def migrated(dsn: str, folder: Path | None = None) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await migrate(conn, folder=folder)  # type: ignore[arg-type]


async def make_token(dsn: str, name: str, *scopes: Scope) -> str:
    orc = Orchestrator(settings=settings_for_tests(), dsn=dsn)
    async with orc:
        return await token(orc.stores.tokens, name, *scopes)


@pytest.fixture
def own_database(server_dsn: str) -> Iterator[str]:
    """A database of the test's own (it breaks it), migrated; dropped at the end."""
    name = f"orc_errors_{uuid.uuid4().hex[:8]}"
    ensure_database(server_dsn, name)
    dsn = with_database(server_dsn, name)
    asyncio.run(migrated(dsn))
    try:
        yield dsn
    finally:
        drop_database(server_dsn, name)


# -- 503 DATABASE_UNAVAILABLE ------------------------------------------------------------------

POOL_TIMEOUT = 2  # seconds a request waits for a connection (ORCHESTRATOR_POOL_TIMEOUT)


async def test_a_stopped_database_server_is_503_database_unavailable_until_it_is_back(
    tmp_path: Path,
) -> None:
    cluster = Cluster(tmp_path)
    dsn = cluster.start()
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE errors")
        dsn = dsn.replace("/postgres?", "/errors?")
        await migrated(dsn)
        used = await make_token(dsn, "used", Scope.SUBMIT, Scope.READ)
        fresh = await make_token(dsn, "fresh", Scope.READ)  # never checked before the outage
        with ApiServer(dsn, ORCHESTRATOR_POOL_TIMEOUT=POOL_TIMEOUT) as server:
            async with client(server, used) as api, client(server, fresh) as other:
                created = await api.post("/api/v1/jobs", json=SCRIPTED)
                assert created.status_code == 201, created.text
                job = f"/api/v1/jobs/{created.json()['job_id']}"
                assert (await api.get(job)).status_code == 200
                cluster.stop()
                # The job's read (its token checked a moment ago) and a token's check alike.
                for reader in (api, other):
                    started = time.monotonic()
                    answer = await reader.get(job)
                    assert time.monotonic() - started < POOL_TIMEOUT + 5  # not hung
                    problem = assert_problem(answer, 503, "DATABASE_UNAVAILABLE")
                    assert problem["detail"].startswith("cannot reach the database: "), problem
                    assert "Traceback" not in answer.text
                assert (await api.get("/readyz")).status_code == 503
                assert (await api.get("/healthz")).status_code == 200
                cluster.start()

                async def back() -> bool:  # the same server, not restarted: within its probe's
                    answer = await api.get(job)  # second (it asks once a second while away)
                    return answer.status_code == 200 and answer.json()["status"] == "PENDING"

                await wait_for(back, timeout=15)
                assert (await other.get(job)).status_code == 200
            assert "Traceback" not in server.output(), server.output()[-3000:]
    finally:
        cluster.stop()


# -- 503 SCHEMA_OUTDATED -----------------------------------------------------------------------


def first_migrations(tmp_path: Path, last: str) -> Path:
    """A folder with this version's migrations up to ``last``: a database migrated with it is
    one restored from a backup taken at that migration."""
    folder = tmp_path / f"migrations-{last}"
    folder.mkdir()
    packaged = resources.files("orchestrator.storage") / "sql" / "migrations"
    for entry in packaged.iterdir():
        if entry.name.endswith(".sql") and entry.name[:4] <= last:
            (folder / entry.name).write_text(entry.read_text("utf-8"))
    return folder


async def test_a_database_without_this_versions_schema_is_503_schema_outdated(
    own_database: str, tmp_path: Path
) -> None:
    dsn = own_database
    secret = await make_token(dsn, "reader", Scope.READ)
    unknown = f"orc_{uuid.uuid4().hex}_{'x' * 43}"  # a token's check reads the tokens' table
    with ApiServer(dsn) as server:
        async with client(server, secret) as api, client(server, unknown) as stranger:
            assert (await api.get("/api/v1/jobs")).status_code == 200
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                await conn.execute("DROP SCHEMA public CASCADE")  # emptied under the server
                await conn.execute("CREATE SCHEMA public")
            for answer in (await api.get("/api/v1/jobs"), await stranger.get("/api/v1/jobs")):
                problem = assert_problem(answer, 503, "SCHEMA_OUTDATED")
                assert problem["detail"] == (
                    "the database has no orchestrator schema: run `orchestrator migrate` first"
                )
            # Restored from a backup taken at migration 0018, before the API's tokens existed.
            await migrated(dsn, first_migrations(tmp_path, "0018"))
            problem = assert_problem(await stranger.get("/api/v1/jobs"), 503, "SCHEMA_OUTDATED")
            assert problem["detail"].startswith(
                "the database schema is at 0018; this version needs "
            ), problem
            assert problem["detail"].endswith(": run `orchestrator migrate`"), problem
            await migrated(dsn)  # migrated again: the same server answers
            assert_problem(await stranger.get("/api/v1/jobs"), 401, "UNAUTHORIZED")
            again = await make_token(dsn, "again", Scope.READ)
            async with client(server, again) as restored:
                listed = await restored.get("/api/v1/jobs")
                assert listed.status_code == 200 and listed.json()["jobs"] == [], listed.text
        assert "Traceback" not in server.output(), server.output()[-3000:]


# -- 409 DATABASE_CONFLICT ---------------------------------------------------------------------


async def blocked_by(monitor: psycopg.AsyncConnection[Any], pid: int) -> bool:
    cur = await monitor.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY (pg_blocking_pids(pid))", (pid,)
    )
    row = await cur.fetchone()
    return row == (1,)


async def test_a_cancel_that_loses_every_deadlock_is_409_database_conflict_and_changes_nothing(
    dsn: str, db: psycopg.AsyncConnection[Any]
) -> None:
    # The server's connections look for deadlocks after 0.3 s (PostgreSQL's default is 1 s),
    # the other side only after 10 s: the server's cancel is the victim of each.
    quick = conninfo.make_conninfo(dsn, options="-c deadlock_timeout=300ms")
    operator = await make_token(dsn, "operator", Scope.SUBMIT, Scope.READ, Scope.OPERATE)
    with ApiServer(quick) as server:
        async with client(server, operator) as api:
            created = await api.post("/api/v1/jobs", json=SCRIPTED)
            job_id = UUID(created.json()["job_id"])
            job = f"/api/v1/jobs/{job_id}"
            async with await psycopg.AsyncConnection.connect(dsn) as other:
                cur = await other.execute("SELECT pg_backend_pid()")
                row = await cur.fetchone()
                assert row is not None
                pid = row[0]
                await other.execute("SET LOCAL deadlock_timeout = '10s'")
                # A cancel locks the job, then its dispatch; this side holds the dispatch...
                await other.execute(
                    "SELECT FROM procrastinate_jobs AS p JOIN orc_jobs AS j"
                    " ON p.id = j.procrastinate_job_id WHERE j.id = %s FOR UPDATE OF p",
                    (job_id,),
                )
                cancel = asyncio.ensure_future(api.post(f"{job}/cancel", json={"reason": "x"}))
                deadlocks = 0
                while True:
                    await wait_for(lambda: _blocked_or_done(db, pid, cancel), 30, interval=0.01)
                    if cancel.done():
                        break
                    # ... and asks for the job, which the cancel holds: a deadlock. Its lock
                    # is let go again (a savepoint), so the cancel's next try meets the same.
                    await other.execute("SAVEPOINT again")
                    await other.execute("SELECT FROM orc_jobs WHERE id = %s FOR UPDATE", (job_id,))
                    await other.execute("ROLLBACK TO SAVEPOINT again")
                    deadlocks += 1
                await other.rollback()
            answer = await cancel
            problem = assert_problem(answer, 409, "DATABASE_CONFLICT")
            assert "nothing of it was kept: run it again" in problem["detail"], problem
            assert "Traceback" not in answer.text and "SELECT" not in answer.text
            assert deadlocks == CONFLICT_TRIES > 1, deadlocks  # it was run again, each time
            after = (await api.get(job)).json()
            assert after["status"] == "PENDING", after
            events = (await api.get(f"{job}/events")).json()["events"]
            assert [e["kind"] for e in events] == ["job.created"]
            cancelled = await api.post(f"{job}/cancel", json={"reason": "x"})  # unhindered
            assert cancelled.status_code == 200 and cancelled.json()["status"] == "CANCELLED"


async def _blocked_or_done(
    db: psycopg.AsyncConnection[Any], pid: int, task: asyncio.Future[Any]
) -> bool:
    return task.done() or await blocked_by(db, pid)


# -- 500 INTERNAL ------------------------------------------------------------------------------


@pytest.mark.logs_errors(r"orchestrator\.api: POST /api/v1/jobs failed")
async def test_an_unexpected_error_is_500_internal_with_nothing_of_the_servers_insides(
    own_database: str,
) -> None:
    dsn = own_database
    secret = await make_token(dsn, "submitter", Scope.SUBMIT, Scope.READ)
    with ApiServer(dsn) as server:
        async with client(server, secret) as api:
            assert (await api.post("/api/v1/jobs", json=SCRIPTED)).status_code == 201
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                # Gone, while the schema's record says it is whole: not an outdated schema.
                await conn.execute("DROP FUNCTION orc_submit_jobs_v2")
            answer = await api.post(
                "/api/v1/jobs",
                json={"job_type": "scripted", "payload": {"script": ["ok"], "key": "sk-hush"}},
            )
            problem = assert_problem(answer, 500, "INTERNAL")
            assert problem == {
                "type": "about:blank", "title": "Internal Server Error", "status": 500,
                "code": "INTERNAL",
                "detail": "the server could not answer this request; see its log",
            }  # fmt: skip
            for inside in ("orc_submit_jobs_v2", "Traceback", "psycopg", "SELECT", "sk-hush",
                           secret, dsn, "does not exist"):  # fmt: skip
                assert inside not in answer.text, inside
            listed = (await api.get("/api/v1/jobs")).json()["jobs"]
            assert len(listed) == 1  # the first job; the refused one wrote nothing
        log = server.output()  # the log has the rest
        assert "POST /api/v1/jobs failed" in log and "orc_submit_jobs_v2" in log, log[-3000:]


# -- the documented limits: one server with metrics closed, a short wait cap and ping ------------

WAIT_MAX = 0.5
PING = 0.2


@pytest.fixture(scope="module")
def limited(dsn: str) -> Iterator[ApiServer]:
    with ApiServer(
        dsn, ORCHESTRATOR_API_OPEN_METRICS="false", ORCHESTRATOR_API_WAIT_MAX_SECONDS=WAIT_MAX,
        ORCHESTRATOR_API_STREAM_PING_SECONDS=PING,
    ) as running:  # fmt: skip
        yield running


@pytest.fixture
async def tokens(dsn: str, db: psycopg.AsyncConnection[Any]) -> dict[str, str]:
    return {
        "read": await make_token(dsn, "reader", Scope.READ),
        "submit": await make_token(dsn, "submitter", Scope.SUBMIT),
        "admin": await make_token(dsn, "admin", *Scope),
    }


async def test_closed_metrics_need_a_read_token_and_the_probes_stay_open(
    limited: ApiServer, tokens: dict[str, str]
) -> None:
    async with client(limited) as anonymous:
        answer = await anonymous.get("/metrics")
        assert_problem(answer, 401, "UNAUTHORIZED")
        assert answer.headers["www-authenticate"] == "Bearer"
        assert "orchestrator_" not in answer.text
        assert (await anonymous.get("/healthz")).status_code == 200
        assert (await anonymous.get("/readyz")).status_code == 200
    forged = f"orc_{uuid.uuid4().hex}_{'x' * 43}"
    for secret, status, code in ((forged, 401, "UNAUTHORIZED"), ("orc_bad", 401, "UNAUTHORIZED"),
                                 (tokens["submit"], 403, "FORBIDDEN")):  # fmt: skip
        async with client(limited, secret) as refused:
            assert_problem(await refused.get("/metrics"), status, code)
    async with client(limited, tokens["read"]) as reader:
        answer = await reader.get("/metrics")
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/plain")
    assert "# TYPE orchestrator_" in answer.text


async def test_a_wait_is_capped_at_the_configured_maximum(
    limited: ApiServer, tokens: dict[str, str]
) -> None:
    async with client(limited, tokens["admin"]) as api:
        job = f"/api/v1/jobs/{(await api.post('/api/v1/jobs', json=SCRIPTED)).json()['job_id']}"
        started = time.monotonic()
        answer = await api.get(f"{job}/wait", params={"timeout": 30})
        waited = time.monotonic() - started
        assert answer.status_code == 200, answer.text
        assert answer.json()["finished"] is False and answer.json()["job"]["status"] == "PENDING"
        assert WAIT_MAX <= waited < WAIT_MAX + 3, waited  # the cap, not the 30 s asked for
        started = time.monotonic()
        claim = {"job_types": ["external_echo"], "worker": "w", "wait_seconds": 30}
        answer = await api.post("/api/v1/internal/task-claim", json=claim)
        waited = time.monotonic() - started
        assert answer.status_code == 200 and answer.json() == {"tasks": []}, answer.text
        assert WAIT_MAX <= waited < WAIT_MAX + 3, waited  # an external worker's claim too
        refused = assert_problem(
            await api.get(f"{job}/wait", params={"timeout": 3601}), 422, "REQUEST_INVALID"
        )
        assert "timeout" in refused["detail"], refused


async def test_an_idle_stream_sends_a_ping_at_the_configured_interval(
    limited: ApiServer, tokens: dict[str, str]
) -> None:
    async with client(limited, tokens["admin"]) as api:
        job = f"/api/v1/jobs/{(await api.post('/api/v1/jobs', json=SCRIPTED)).json()['job_id']}"
        lines: list[tuple[float, str]] = []
        quiet = httpx.Timeout(10, read=3 * PING + 1)  # a stream without its pings fails here
        async with api.stream("GET", f"{job}/stream", timeout=quiet) as stream:
            assert stream.status_code == 200
            started = time.monotonic()
            async for line in stream.aiter_lines():
                lines.append((time.monotonic() - started, line))
                if sum(text == ": ping" for _, text in lines) == 3:
                    break
    texts = [text for _, text in lines if text]
    assert texts[0].startswith("id: ") and texts[1] == "event: job.created", texts
    assert texts[2].startswith("data: "), texts
    assert texts[3:] == [": ping"] * 3, texts  # nothing but pings while the job waits
    pings = [at for at, text in lines if text == ": ping"]
    assert pings[-1] < 3 * PING + 2, pings  # every 0.2 s, not PostgreSQL-slow nor 15 s
    assert all(b - a >= PING * 0.8 for a, b in itertools.pairwise(pings)), pings


# -- an approval that expires ------------------------------------------------------------------


@pytest.fixture
def peers() -> Iterator[http_peers.Peers]:
    with http_peers.serve() as p:
        yield p


@pytest.fixture
async def expiring(
    make_orc: Callable[..., Orchestrator], peers: http_peers.Peers
) -> AsyncIterator[Orchestrator]:
    """A worker expiring approvals every second, escalating failures to the peers' webhook."""
    orc = make_orc(
        retry_config=config_with(agent_app.TABLE), approvals_cron="* * * * * *",
        escalation_target={"channel": "webhook", "url": f"{peers.url}/hooks/oncall"},
    )  # fmt: skip
    tasks.register_all(orc)
    agent_app.register(orc)
    async with WorkerRun(orc):
        yield orc


async def test_an_expired_approval_is_final_and_escalated_to_a_person(
    limited: ApiServer,
    tokens: dict[str, str],
    expiring: Orchestrator,
    peers: http_peers.Peers,
) -> None:
    with message_service() as service:
        plan = {"service": service.url, "approval_at": 2, "approval_expires_in": 1}
        async with client(limited, tokens["admin"]) as api:
            created = await api.post("/api/v1/jobs", json={"job_type": "agent", "payload": plan})
            job_id = created.json()["job_id"]
            job = f"/api/v1/jobs/{job_id}"

            async def failed() -> bool:
                return (await api.get(job)).json()["status"] == "FAILED"

            await wait_for(failed, timeout=30)
            [approval] = (await api.get("/api/v1/approvals", params={"status": "all"})).json()[
                "approvals"
            ]
            record = (await api.get(f"/api/v1/approvals/{approval['id']}")).json()
            assert record == approval
            assert (record["job_id"], record["status"], record["job_status"]) == (
                job_id, "expired", "FAILED",
            )  # fmt: skip
            assert record["decided_by"] == "expire_approvals" and record["decided_at"] is not None
            assert record["reason"] == "no decision before the approval expired"
            assert record["decided_at"] >= record["expires_at"]
            pending = (await api.get("/api/v1/approvals")).json()["approvals"]
            assert pending == []
            late = await api.post(f"/api/v1/approvals/{approval['id']}/approve", json={})
            assert_problem(late, 409, "APPROVAL_INVALID")
            late = await api.post(
                f"/api/v1/approvals/{approval['id']}/reject", json={"reason": "too late"}
            )
            assert_problem(late, 409, "APPROVAL_INVALID")
            assert (await api.get(f"/api/v1/approvals/{approval['id']}")).json() == record

            failure = (await api.get(job)).json()
            assert failure["last_error"]["code"] == "APPROVAL_EXPIRED"
            events = (await api.get(f"{job}/events")).json()["events"]
            kinds = [e["kind"] for e in events]
            expired_at = kinds.index("job.approval_expired")
            assert kinds[expired_at:] == [
                "job.approval_expired", "job.dead_lettered", "job.failed", "job.degraded",
            ]  # fmt: skip
            escalation = events[-1]["payload"]["escalation_job_id"]
            assert escalation is not None, events[-1]
            notice = (await api.get(f"/api/v1/jobs/{escalation}")).json()
            assert notice["job_type"] == "send_notification", notice

            async def told() -> bool:
                return len(peers.received["oncall"]) == 2  # asked, then told it expired

            await wait_for(told, timeout=30)
    asked, told_ = (json.loads(r["body"]) for r in peers.received["oncall"])
    assert asked["text"].startswith("Approval needed: go on with step 2?"), asked
    assert (told_["notification_id"], told_["about_job_id"]) == (escalation, job_id), told_
    assert "APPROVAL_EXPIRED: approval expired" in told_["text"], told_

    async def notice_completed() -> bool:  # its COMPLETED is written after the peer answered
        return (await expiring.get_job(UUID(escalation))).status is Status.COMPLETED

    await wait_for(notice_completed, timeout=30)
