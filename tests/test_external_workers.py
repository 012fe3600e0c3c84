"""External workers (the lease contract over HTTP): a real Node.js worker runs jobs of an
external job type through a real ``orchestrator serve``, with the same state machine, budgets,
dead letters and sweeps as in-process jobs, its live output written under its lease and
superseded when its attempt fails; it is SIGKILLed mid-job and the sweep hands its job to
another; a stale report is refused with 409 and changes nothing."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from uuid import UUID, uuid4

import httpx
import pytest

from orchestrator import Orchestrator, Status
from orchestrator.domain.principals import Scope
from tests.support import log_guard
from tests.support.api_server import ApiServer, api_orchestrator, token
from tests.support.harness import WorkerRun, finished, wait_for
from tests.support.node_worker import NodeWorker
from tests.support.workers import WorkerProcess


@pytest.fixture
def server(dsn: str) -> Iterator[ApiServer]:
    with ApiServer(dsn) as running:
        yield running


@pytest.fixture
async def orc(make_orc: Callable[..., Orchestrator]) -> Orchestrator:
    return await api_orchestrator(make_orc)


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[NodeWorker]]:
    started: list[NodeWorker] = []
    yield started
    for node in started:
        node.stop(signal.SIGKILL)


@log_guard.fails_jobs("HTTP_400", "RETRY_LATER")
async def test_a_node_worker_runs_external_jobs_end_to_end(
    orc: Orchestrator, server: ApiServer, nodes: list[NodeWorker], tmp_path: Path
) -> None:
    secret = await token(orc.stores.tokens, "node", Scope.WORKER)
    nodes.append(NodeWorker(server, secret, "node-1", tmp_path))
    ok = await orc.submit("external_echo", {"output": "hi"})
    flaky = await orc.submit("external_echo", {"fail_until": 2, "output": "third time"})
    later = await orc.submit("external_echo", {"retry_after": 0.2})
    broken = await orc.submit("external_echo", {"fail": "permanent"})
    done = {job_id: await finished(orc, job_id) for job_id in (ok, flaky, later, broken)}
    assert done[ok].status is Status.COMPLETED
    assert done[ok].result == {"echo": "hi", "by": "node-1"}
    assert (done[flaky].status, done[flaky].retry_count) == (Status.COMPLETED, 2)
    assert done[flaky].result == {"echo": "third time", "by": "node-1"}
    # "retry later" every time: the type's three application retries, then the dead letter
    assert (done[later].status, done[later].retry_count) == (Status.FAILED, 3)
    assert done[later].last_error is not None and done[later].last_error.code == "RETRY_LATER"
    assert done[broken].status is Status.FAILED and done[broken].retry_count == 0
    letters = {letter.job_id for letter in await orc.dead_letters()}
    assert letters == {later, broken}
    running = [e for e in await orc.job_events(ok) if e.kind == "job.running"]
    assert running[0].payload["worker"].startswith("node-1/w")


async def test_a_node_worker_s_output_is_superseded_when_its_attempt_fails_then_written_again(
    orc: Orchestrator, server: ApiServer, nodes: list[NodeWorker], tmp_path: Path
) -> None:
    secret = await token(orc.stores.tokens, "node", Scope.WORKER)
    nodes.append(NodeWorker(server, secret, "node-1", tmp_path))
    stream = ["Tides ", "follow ", "the moon."]
    job_id = await orc.submit("external_echo", {"stream": stream, "fail_until": 1, "output": 1})
    job = await finished(orc, job_id)
    assert job.status is Status.COMPLETED and job.attempt == 2
    chunks = await orc.stores.output.read(job_id)
    final = await orc.stores.output.read(job_id, final=True)
    each = [("text", text) for text in stream]
    assert [(c.attempt, c.kind, c.body) for c in chunks] == [
        *[(1, kind, body) for kind, body in each],
        (1, "progress", {"attempt": 1, "texts": 3}),
        (1, "superseded", {"attempt": 1, "step": 1}),
        *[(2, kind, body) for kind, body in each],
        (2, "progress", {"attempt": 2, "texts": 3}),
    ]
    assert [c.offset for c in final] == [c.offset for c in chunks[5:]]


async def test_a_killed_node_worker_s_job_is_swept_and_run_by_another(
    orc: Orchestrator, server: ApiServer, nodes: list[NodeWorker], tmp_path: Path, dsn: str
) -> None:
    secret = await token(orc.stores.tokens, "node", Scope.WORKER)
    first = NodeWorker(server, secret, "node-1", tmp_path)
    nodes.append(first)
    job_id = await orc.submit("external_echo", {"sleep_ms": 60_000, "output": "x"})
    await wait_for(lambda: _true(first.claimed(job_id)), timeout=20)
    first.stop(signal.SIGKILL)
    second = NodeWorker(server, secret, "node-2", tmp_path)
    nodes.append(second)
    # An in-process worker runs the sweep (1.5 s threshold); it never takes external jobs.
    with WorkerProcess(dsn, "tests.support.api_app:orc"):
        await wait_for(lambda: _true(second.claimed(job_id)), timeout=30)
        # node-2 runs it for the full minute: cancel instead, and see node-2 stop
        await orc.cancel(job_id, reason="test over", by="tests")
    kinds = [e.kind for e in await orc.job_events(job_id)]
    assert kinds.count("job.zombie_detected") == 1
    running = [e for e in await orc.job_events(job_id) if e.kind == "job.running"]
    assert [r.payload["worker"].split("/")[0] for r in running] == ["node-1", "node-2"]
    assert (await orc.get_job(job_id)).status is Status.CANCELLED


async def test_a_stale_report_is_refused_and_changes_nothing(
    orc: Orchestrator, server: ApiServer
) -> None:
    secret = await token(orc.stores.tokens, "py-worker", Scope.WORKER)
    job_id = await orc.submit("external_echo", {"output": 1})
    async with httpx.AsyncClient(
        base_url=server.url, headers={"Authorization": f"Bearer {secret}"}, timeout=30
    ) as api:
        claim = {"job_types": ["external_echo"], "worker": "py", "wait_seconds": 5}
        [task] = (await api.post("/api/v1/internal/task-claim", json=claim)).json()["tasks"]
        assert (task["job_id"], task["attempt"]) == (str(job_id), 1)
        # the worker contract's cap, as job.running tells it: 1 run, then 3 retries of 1 run
        [running] = [e for e in await orc.job_events(job_id) if e.kind == "job.running"]
        assert task["max_attempts"] == running.payload["max_attempts"] == 4
        assert task["payload"] == {"output": 1} and task["heartbeat_interval"] > 0
        lease = {"job_id": task["job_id"], "attempt": 1, "lease_token": task["lease_token"]}
        before = await orc.get_job(job_id)
        wrong_token = {**lease, "lease_token": str(UUID(int=7))}
        wrong_attempt = {**lease, "attempt": 2}
        for stale in (wrong_token, wrong_attempt):
            response = await api.post("/api/v1/internal/heartbeat", json=stale)
            assert (response.status_code, response.json()["code"]) == (409, "WF_LEASE_STALE")
            report = {**stale, "status": "success", "output": "not mine"}
            response = await api.post("/api/v1/internal/task-complete", json=report)
            assert (response.status_code, response.json()["code"]) == (409, "WF_LEASE_STALE")
        assert await orc.get_job(job_id) == before
        beat = await api.post("/api/v1/internal/heartbeat", json=lease)
        assert beat.status_code == 200
        done = await api.post(
            "/api/v1/internal/task-complete", json={**lease, "status": "success", "output": 2}
        )
        assert done.json() == {"outcome": "completed"}
        again = await api.post(
            "/api/v1/internal/task-complete", json={**lease, "status": "success", "output": 3}
        )
        assert again.status_code == 409
        assert again.json()["code"] == "WF_LEASE_STALE"  # the lease ended with the job
        empty = await api.post("/api/v1/internal/task-claim", json={**claim, "wait_seconds": 0})
        assert empty.json() == {"tasks": []}
        not_external = await api.post(
            "/api/v1/internal/task-claim", json={**claim, "job_types": ["scripted"]}
        )
        assert not_external.json()["code"] == "JOB_TYPE_NOT_EXTERNAL"
    job = await orc.get_job(job_id)
    assert (job.status, job.result) == (Status.COMPLETED, 2)


async def test_every_report_without_the_lease_gets_the_same_409(
    orc: Orchestrator, server: ApiServer
) -> None:
    """One rule for heartbeat, completion, failure and output alike: an unknown job, one never
    claimed, one finished, a wrong token: 409 WF_LEASE_STALE, the same words, nothing changed."""
    secret = await token(orc.stores.tokens, "py-worker", Scope.WORKER)
    async with httpx.AsyncClient(
        base_url=server.url, headers={"Authorization": f"Bearer {secret}"}, timeout=30
    ) as api:
        claim = {"job_types": ["external_echo"], "worker": "py", "wait_seconds": 5}
        finished = await orc.submit("external_echo", {"output": 1})
        [task] = (await api.post("/api/v1/internal/task-claim", json=claim)).json()["tasks"]
        old = {"job_id": task["job_id"], "attempt": 1, "lease_token": task["lease_token"]}
        done = {**old, "status": "success", "output": 1}
        assert (await api.post("/api/v1/internal/task-complete", json=done)).is_success
        never_claimed = await orc.submit("external_echo", {"output": 2}, run_at=_later())
        running = await orc.submit("external_echo", {"output": 3})
        [task] = (await api.post("/api/v1/internal/task-claim", json=claim)).json()["tasks"]
        assert task["job_id"] == str(running)
        token_of = {finished: task["lease_token"], never_claimed: task["lease_token"]}
        before = {
            job_id: await orc.get_job(job_id) for job_id in (finished, never_claimed, running)
        }
        cases = {
            "unknown job": {"job_id": str(uuid4()), "attempt": 1, "lease_token": str(uuid4())},
            "never claimed": {"job_id": str(never_claimed), "attempt": 1,
                              "lease_token": token_of[never_claimed]},
            "finished": old,
            "another's token": {"job_id": str(running), "attempt": 1, "lease_token": str(uuid4())},
            "another attempt": {"job_id": str(running), "attempt": 2,
                                "lease_token": task["lease_token"]},
        }  # fmt: skip
        reports = {
            "heartbeat": ("/api/v1/internal/heartbeat", {}),
            "success": ("/api/v1/internal/task-complete", {"status": "success", "output": 9}),
            "failure": ("/api/v1/internal/task-complete", {"status": "failure", "error": {
                "message": "no", "code": "X", "classification": "PERMANENT"}}),
            "retry later": ("/api/v1/internal/task-complete",
                            {"status": "retry_later", "retry_after_seconds": 1}),
            "output": ("/api/v1/internal/task-output",
                       {"batch": 1, "chunks": [{"kind": "text", "body": "not mine"}]}),
        }  # fmt: skip
        for case, lease in cases.items():
            for kind, (path, body) in reports.items():
                answer = await api.post(path, json={**lease, **body})
                problem = answer.json()
                assert (answer.status_code, problem["code"]) == (409, "WF_LEASE_STALE"), (
                    case, kind, answer.text,
                )  # fmt: skip
                assert problem["detail"] == (
                    f"WF_LEASE_STALE: job {lease['job_id']} is not leased by this attempt; "
                    "write rejected"
                )
        for job_id, was in before.items():
            assert await orc.get_job(job_id) == was
            assert await orc.stores.output.read(job_id) == []
        document = (await api.get("/api/v1/openapi.json")).json()
        internal = ("heartbeat", "task-complete", "task-output")
        for path in (f"/api/v1/internal/{name}" for name in internal):
            declared = document["paths"][path]["post"]["responses"]
            assert "404" not in declared and "WF_LEASE_STALE" in declared["409"]["description"]


async def test_in_process_workers_never_take_an_external_job(
    orc: Orchestrator, server: ApiServer
) -> None:
    job_id = await orc.submit("external_echo", {"output": 1})
    local = await orc.submit("scripted", {"script": ["ok"]})
    async with WorkerRun(orc) as worker:  # every queue, but the external ones
        await worker.until_finished(local)
    assert (await orc.get_job(job_id)).status is Status.PENDING
    secret = await token(orc.stores.tokens, "w", Scope.WORKER)
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as api:
        claimed = await api.post(
            "/api/v1/internal/task-claim",
            json={"job_types": ["external_echo"], "worker": "w"},
            headers={"Authorization": f"Bearer {secret}"},
        )
    assert [t["job_id"] for t in claimed.json()["tasks"]] == [str(job_id)]


async def _true(value: bool) -> bool:
    return value


def _later() -> datetime:
    return datetime.now(UTC) + timedelta(hours=1)
