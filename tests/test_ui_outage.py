"""``orchestrator serve`` through a database outage (a server of the module's own, stopped and
started for real): ``/readyz`` and the API answer 503 within a Kubernetes probe's 2 s, the
dashboard shows its outage page (not JSON) and its live pages a "disconnected" notice in a real
Chromium, both gone once the database is back, and a job's page shows the rest of its live
output after the outage, from where it was (nothing shown twice); the log says the database went
away once, with no traceback, and not a line per pool attempt. Also what ``serve`` logs when all
is well: where it listens, and one access line per request, with no secret in it."""

from __future__ import annotations

import asyncio
import contextlib
import re
import tempfile
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from playwright.async_api import async_playwright

from orchestrator import JobContext, Orchestrator, Status
from orchestrator.domain.principals import Scope
from orchestrator.storage.migrate import migrate
from tests.support.api_server import ApiServer, token, ui_session
from tests.support.cluster import Cluster
from tests.support.harness import WorkerRun, settings_for_tests, wait_for
from tests.support.tools import find
from tests.test_ui import CHROMIUM_FLAGS, signed_in

#: A Kubernetes probe's timeoutSeconds (k8s/api): an answer after it is no answer.
PROBE_SECONDS = 2.0
ACCESS_LINE = re.compile(
    r'orchestrator\.api\.access: 127\.0\.0\.1:\d+ "(?P<method>[A-Z]+) (?P<target>\S+)" '
    r"(?P<status>\d{3}) \d+ B [\d.]+ ms(?: by (?P<who>\S+))?$",
    re.MULTILINE,
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Cluster, str]]:
    with tempfile.TemporaryDirectory(prefix="serve-outage-") as directory:
        server = Cluster(Path(directory))
        dsn = server.start()
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("CREATE DATABASE outage")
            dsn = dsn.replace("/postgres?", "/outage?")

            async def apply() -> None:
                async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                    await migrate(conn)

            asyncio.run(apply())
            yield server, dsn
        finally:
            server.stop()


@pytest.fixture(scope="module")
def serve(cluster: tuple[Cluster, str]) -> Iterator[ApiServer]:
    with ApiServer(cluster[1]) as running:
        yield running


@pytest.fixture(scope="module")
async def secret(cluster: tuple[Cluster, str]) -> str:
    async with Orchestrator(settings=settings_for_tests(), dsn=cluster[1]) as orc:
        return await token(orc.stores.tokens, "operator", Scope.READ, Scope.OPERATE)


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Any]:
    async with async_playwright() as p:
        launched = await p.chromium.launch(executable_path=find("chromium"), args=CHROMIUM_FLAGS)
        yield launched
        await launched.close()


@contextlib.contextmanager
def database_stopped(cluster: tuple[Cluster, str]) -> Iterator[None]:
    """The database away for the block (started again however it ends)."""
    server, _ = cluster
    server.stop()
    try:
        yield
    finally:
        server.start()


async def ready(serve: ApiServer) -> bool:
    async with httpx.AsyncClient(base_url=serve.url, timeout=PROBE_SECONDS) as client:
        return (await client.get("/readyz")).status_code == 200


async def logged(serve: ApiServer, text: str) -> bool:
    return text in serve.output()


def access_lines(log: str) -> list[dict[str, str | Any]]:
    return [match.groupdict() for match in ACCESS_LINE.finditer(log)]


async def test_serve_says_where_it_listens_and_logs_each_request_without_a_secret(
    serve: ApiServer, secret: str
) -> None:
    assert f"serving the API on http://127.0.0.1:{serve.port} " in serve.output()
    bearer = {"Authorization": f"Bearer {secret}"}
    async with httpx.AsyncClient(base_url=serve.url, timeout=10) as client:
        assert (await client.get("/api/v1/jobs?limit=1", headers=bearer)).status_code == 200
        # a token where none belongs (a query parameter), under any name: redacted too
        await client.get(f"/api/v1/jobs?limit=2&access_token={secret}&q={secret}")
    with ui_session(serve, secret) as (browser, csrf):  # the sign-in form carries the token
        assert browser.get("/ui/jobs").status_code == 200

    async def all_logged() -> bool:
        targets = {line["target"] for line in access_lines(serve.output())}
        return {"/api/v1/jobs?limit=1", "/ui/login", "/ui/jobs"} <= targets

    await wait_for(all_logged)
    log = serve.output()
    lines = access_lines(log)
    assert {"method": "GET", "target": "/api/v1/jobs?limit=1", "status": "200",
            "who": "operator"} in lines  # fmt: skip
    assert {"method": "GET", "target": "/api/v1/jobs?limit=2&access_token=%5Bredacted%5D"
            "&q=%5Bredacted%5D", "status": "401", "who": None} in lines  # fmt: skip
    assert {"method": "POST", "target": "/ui/login", "status": "303", "who": None} in lines
    secret_part = secret.rsplit("_", 1)[1]
    assert secret_part not in log and csrf not in log


async def test_an_outage_is_answered_503_within_a_probe_s_timeout_and_logged_once(
    cluster: tuple[Cluster, str], serve: ApiServer, secret: str
) -> None:
    bearer = {"Authorization": f"Bearer {secret}"}
    before = len(serve.output().splitlines())
    with ui_session(serve, secret) as (dashboard, _), database_stopped(cluster):
        async with httpx.AsyncClient(base_url=serve.url, timeout=PROBE_SECONDS) as client:
            for _ in range(10):  # the first as the database goes, then those that follow
                probe = await client.get("/readyz")
                assert (probe.status_code, probe.text) == (503, "database unreachable")
                read = await client.get("/api/v1/jobs", headers=bearer)
                assert read.status_code == 503, read.text
                assert read.headers["content-type"] == "application/problem+json"
                assert read.json()["code"] == "DATABASE_UNAVAILABLE"
                await asyncio.sleep(0.3)
        dashboard.timeout = httpx.Timeout(PROBE_SECONDS)
        for path in ("/ui", "/ui/jobs", "/ui/dead-letters"):  # a page, and the next one
            page = dashboard.get(path)
            assert page.status_code == 503 and page.headers["content-type"].startswith(
                "text/html"
            ), page.text
            assert "The database is unreachable" in page.text and "tries again" in page.text
        await wait_for(lambda: logged(serve, "database unreachable ("))
        outage = serve.output().splitlines()[before:]
    await wait_for(lambda: ready(serve), timeout=30)
    await wait_for(lambda: logged(serve, "database reachable again"))
    said = [line for line in outage if "database unreachable (" in line]
    assert len(said) == 1, "\n".join(outage)
    others = [line for line in outage if not ACCESS_LINE.search(line) and line.strip()]
    pool = [line for line in others if "psycopg.pool" in line]
    assert len(pool) <= 4 and len(others) <= 12, "\n".join(others)
    assert "Traceback" not in serve.output()


async def test_the_dashboard_shows_the_outage_and_reconnects_once_the_database_is_back(
    cluster: tuple[Cluster, str], serve: ApiServer, secret: str, browser: Any
) -> None:
    live = await signed_in(browser, serve, secret)
    await live.goto(f"{serve.url}/ui/jobs")
    notice = live.locator("#disconnected")
    assert not await notice.is_visible()
    other = await live.context.new_page()
    with database_stopped(cluster):
        await notice.wait_for(state="visible", timeout=20_000)
        assert "Reconnecting" in await notice.inner_text()
        answer = await other.goto(f"{serve.url}/ui/approvals", timeout=PROBE_SECONDS * 1000)
        assert answer is not None and answer.status == 503
        heading = other.get_by_role("heading", level=1)
        assert await heading.inner_text() == "The database is unreachable"
        assert await other.get_by_role("link", name="Try again now").count() == 1
    # back: the live page clears its notice, the outage page shows the page asked for
    await notice.wait_for(state="hidden", timeout=30_000)
    await other.get_by_role("heading", name="Approvals").wait_for(timeout=30_000)
    await live.context.close()


def asking(dsn: str) -> Orchestrator:
    """An application whose job writes output in its one step, then asks for an approval."""
    orc = Orchestrator(settings=settings_for_tests(), dsn=dsn)

    @orc.job_type("asks")
    async def asks(ctx: JobContext, payload: None) -> str:
        steps = ctx.steps(int, initial=0, max_steps=1)
        async for step in steps:
            ctx.output.text(f"asked in attempt {ctx.attempt}. ")
            await step.approval("go on?", expires_in=timedelta(hours=1))
            ctx.output.text(f"went on in attempt {ctx.attempt}.")
            await step.checkpoint(1, final=True)
        return "done"

    return orc


async def test_a_job_s_page_shows_the_rest_of_its_output_after_the_outage_nothing_twice(
    cluster: tuple[Cluster, str], serve: ApiServer, secret: str, browser: Any
) -> None:
    _, dsn = cluster
    async with asking(dsn) as orc:
        job_id = await orc.submit("asks", None)
        async with WorkerRun(orc):

            async def waiting() -> bool:
                return (await orc.get_job(job_id)).status is Status.WAITING_APPROVAL

            await wait_for(waiting, timeout=30)
    page = await signed_in(browser, serve, secret)
    await page.goto(f"{serve.url}/ui/jobs/{job_id}")
    first = page.locator("#job-output section[data-attempt='1']")
    await first.locator(".marker").wait_for(timeout=15_000)  # its output, superseded: it waits
    refused = re.compile(rf'"GET /ui/live/jobs/{job_id}/output\S*" 503')
    with database_stopped(cluster):  # until the page's output stream was refused
        await wait_for(lambda: logged_like(serve, refused), timeout=30)
    async with asking(dsn) as orc:
        [approval] = await orc.approvals()
        await orc.approve(approval["id"], by="tests")
        async with WorkerRun(orc) as worker:
            await worker.until_finished(job_id, timeout=60)
        assert (await orc.get_job(job_id)).status is Status.COMPLETED
    output = page.locator("#job-output")
    await output.locator(".output-state").filter(has_text="COMPLETED").wait_for(timeout=30_000)
    assert await first.locator(".said").text_content() == "asked in attempt 1. "  # once
    second = output.locator("section[data-attempt='2']")
    assert await second.locator(".said").text_content() == (
        "asked in attempt 2. went on in attempt 2."
    )
    await page.context.close()


async def logged_like(serve: ApiServer, pattern: re.Pattern[str]) -> bool:
    return pattern.search(serve.output()) is not None
