"""A lease token is a capability: whoever holds it can heartbeat and report for the attempt. Only
the claim's answer hands it out (to the attempt that claimed). Through a real ``orchestrator
serve``: a read token never sees it in a job, a list, the events, a wait or a stream; nor do the
dashboard's pages, ``orchestrator status`` and ``jobs``, or the server's log. Events name the
attempt by a digest of it instead (``run_id``)."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any
from uuid import UUID, uuid5

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator import Orchestrator, Status
from orchestrator.domain import events
from orchestrator.domain.principals import Scope
from tests.support import api_app
from tests.support.api_server import ApiServer, api_orchestrator, token
from tests.support.harness import ROOT


@pytest.fixture(scope="module")
def server(dsn: str) -> Iterator[ApiServer]:
    with ApiServer(dsn) as running:
        yield running


@pytest.fixture
async def orc(make_orc: Callable[..., Orchestrator]) -> Orchestrator:
    return await api_orchestrator(make_orc)


@pytest.fixture
async def claimed(orc: Orchestrator, server: ApiServer) -> AsyncIterator[dict[str, Any]]:
    """A running external job, as its worker's claim answered: with its lease token."""
    secret = await token(orc.stores.tokens, "node", Scope.WORKER)
    await orc.submit("external_echo", {"output": 1})
    async with httpx.AsyncClient(
        base_url=server.url, headers={"Authorization": f"Bearer {secret}"}, timeout=30
    ) as worker:
        claim = {"job_types": ["external_echo"], "worker": "node-1", "wait_seconds": 5}
        [task] = (await worker.post("/api/v1/internal/task-claim", json=claim)).json()["tasks"]
        yield {**task, "client": worker}


async def test_a_read_token_never_sees_a_running_job_s_lease_token(
    orc: Orchestrator, server: ApiServer, claimed: dict[str, Any]
) -> None:
    job_id, lease = claimed["job_id"], claimed["lease_token"]
    assert (await orc.get_job(job_id)).lease_token == UUID(lease)  # the claim's, and held
    reader = await token(orc.stores.tokens, "reader", Scope.READ)
    async with httpx.AsyncClient(
        base_url=server.url, headers={"Authorization": f"Bearer {reader}"}, timeout=30
    ) as api:
        job = await api.get(f"/api/v1/jobs/{job_id}")
        assert job.json()["status"] == "RUNNING" and "lease_token" not in job.json()
        listed = await api.get("/api/v1/jobs", params={"status": "RUNNING"})
        assert [j["id"] for j in listed.json()["jobs"]] == [job_id]
        waited = await api.get(f"/api/v1/jobs/{job_id}/wait", params={"timeout": 0})
        assert waited.json()["finished"] is False
        history = await api.get(f"/api/v1/jobs/{job_id}/events")
        [running] = [e for e in history.json()["events"] if e["kind"] == "job.running"]
        assert running["payload"]["run_id"] == str(uuid5(events.RUN_ID_NAMESPACE, lease))
        streamed = await _stream_until(api, f"/api/v1/jobs/{job_id}/stream", "event: job.running")
        for answer in (job.text, listed.text, waited.text, history.text, streamed):
            assert lease not in answer
        # the attempt that holds it still reports with it
        report = {"job_id": job_id, "attempt": claimed["attempt"], "lease_token": lease}
        assert (await claimed["client"].post("/api/v1/internal/heartbeat", json=report)).is_success
        done = await claimed["client"].post(
            "/api/v1/internal/task-complete", json={**report, "status": "success", "output": 2}
        )
        assert done.json() == {"outcome": "completed"}
        finished = await api.get(f"/api/v1/jobs/{job_id}/events")
        assert lease not in finished.text and lease not in server.output()


async def test_the_dashboard_never_shows_a_lease_token(
    orc: Orchestrator, server: ApiServer, claimed: dict[str, Any]
) -> None:
    job_id, lease = claimed["job_id"], claimed["lease_token"]
    reader = await token(orc.stores.tokens, "viewer", Scope.READ)
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as browser:
        await _sign_in(browser, reader)
        for path in (f"/ui/jobs/{job_id}", f"/ui/fragments/jobs/{job_id}", "/ui/jobs",
                     "/ui/fragments/jobs?status=RUNNING"):  # fmt: skip
            page = await browser.get(path)
            assert page.status_code == 200 and "external_echo" in page.text, path
            assert lease not in page.text, path
        page = await browser.get(f"/ui/jobs/{job_id}")
        assert job_id in page.text and "job.running" in page.text  # its timeline, its run_id


async def test_status_and_jobs_on_the_command_line_never_print_it(
    orc: Orchestrator, dsn: str, claimed: dict[str, Any]
) -> None:
    job_id, lease = claimed["job_id"], claimed["lease_token"]
    env = {**os.environ, "DATABASE_URL": dsn, "ORCHESTRATOR_RETRY_CONFIG": str(api_app.CONFIG)}
    for argv in (["status", job_id], ["jobs", "--status", "RUNNING"]):
        done = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "orchestrator", "--app",
                             "tests.support.api_app:orc", *argv],
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0 and job_id in done.stdout, done.stderr
        assert lease not in done.stdout + done.stderr
    assert (await orc.get_job(job_id)).status is Status.RUNNING


async def test_a_job_serialized_anywhere_leaves_its_lease_token_out(
    orc: Orchestrator, claimed: dict[str, Any]
) -> None:
    lease = claimed["lease_token"]
    job = await orc.get_job(claimed["job_id"])
    assert job.lease_token == UUID(lease)  # in the process, for its fence
    assert "lease_token" not in job.model_dump() and lease not in job.model_dump_json()
    [running] = [e for e in await orc.job_events(job.id) if e.kind == "job.running"]
    assert running.payload["run_id"] == str(uuid5(events.RUN_ID_NAMESPACE, lease))


@given(st.uuids(), st.uuids())
def test_an_event_names_its_attempt_by_a_digest_of_the_lease(first: UUID, second: UUID) -> None:
    shown = events.shown({"run_id": str(first), "worker": "w"})
    assert shown["run_id"] != str(first) and shown["worker"] == "w"
    assert shown == events.shown({"run_id": str(first), "worker": "w"})  # stable
    assert (shown == events.shown({"run_id": str(second), "worker": "w"})) == (first == second)
    assert events.shown({"run_id": None}) == {"run_id": None}  # a failure no attempt held


async def _stream_until(api: httpx.AsyncClient, path: str, marker: str) -> str:
    """The event stream's text up to ``marker`` (it would run until the job finished)."""
    seen = ""
    async with api.stream("GET", path) as response:
        assert response.status_code == 200
        async for chunk in response.aiter_text():
            seen += chunk
            if marker in seen and seen.endswith("\n\n"):
                return seen
    return seen


async def _sign_in(browser: httpx.AsyncClient, secret: str) -> None:
    """Sign in as the login form does (with its CSRF field, when the form has one)."""
    form = (await browser.get("/ui/login")).text
    fields = {"token": secret, "next": "/ui"}
    found = re.search(r'name="csrf"\s+value="([^"]+)"', form)
    if found is not None:
        fields["csrf"] = found.group(1)
    signed = await browser.post("/ui/login", data=fields)
    assert signed.status_code == 303 and signed.headers["location"] == "/ui", signed.text
