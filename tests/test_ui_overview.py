"""The overview says what is wrong, in a real headless Chromium against a live ``orchestrator
serve``: a banner for jobs due that no live worker runs (a real worker process started, then
stopped), a paused flow key (who, why), dead letters to review, and failures that notify
nobody; each linking to where it is fixed, each tenant's own, and gone once the cause is.
The "Now" chart counts a retry and a failure in the minute they happen, with its scale."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from playwright.async_api import async_playwright

from orchestrator import Orchestrator, Status
from orchestrator.domain.principals import Scope
from tests.support import log_guard, ui_app
from tests.support.api_server import ApiServer, token
from tests.support.harness import WorkerRun, wait_for
from tests.support.tools import find
from tests.support.workers import WorkerProcess
from tests.test_ui import CHROMIUM_FLAGS, shot, signed_in

APP = "tests.support.ui_app:orc"
SECONDS = 45_000  # ms a banner may take to show or go on a loaded machine (the overview is
# read at most every 2 s, and re-read by the page every 2 s)


@pytest.fixture(scope="module")
def server(dsn: str) -> Iterator[ApiServer]:
    with ApiServer(dsn, app=APP, ORCHESTRATOR_RETRY_CONFIG=ui_app.CONFIG) as running:
        yield running


@pytest.fixture
async def orc(make_orc: Callable[..., Orchestrator]) -> AsyncIterator[Orchestrator]:
    made = make_orc(retry_config=ui_app.CONFIG)
    ui_app.register(made)
    await made.open()
    yield made


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Any]:
    async with async_playwright() as p:
        launched = await p.chromium.launch(executable_path=find("chromium"), args=CHROMIUM_FLAGS)
        yield launched
        await launched.close()


def banner(page: Any, kind: str) -> Any:
    return page.locator(f"[data-problem='{kind}']")


async def shown(page: Any) -> None:
    """Until the overview's live part is there (a banner's absence is then what it says)."""
    await page.locator("[data-runners]").wait_for(timeout=SECONDS)


async def test_jobs_due_that_no_worker_runs_are_a_banner_until_a_worker_is_back(
    orc: Orchestrator, server: ApiServer, browser: Any, dsn: str
) -> None:
    page = await signed_in(browser, server, await token(orc.stores.tokens, "ops", Scope.READ))

    async def serve_is_a_server() -> bool:
        """``serve`` back in the registry as a server (the test emptied it, ids restarting from
        1: it registers anew at its next heartbeat), before a worker comes to be counted."""
        found = await orc.summary(tenants=None)
        return found.runners == [] and [p.runs for p in found.servers] == ["external"]

    await wait_for(serve_is_a_server, 30)
    with WorkerProcess(dsn, app=APP, ORCHESTRATOR_RETRY_CONFIG=ui_app.CONFIG) as worker:
        ran = await orc.submit("scripted", {"script": ["ok"]})

        async def completed() -> bool:
            return (await orc.get_job(ran)).status is Status.COMPLETED

        await wait_for(completed, 60)
        await page.locator("[data-runners='1']").wait_for(timeout=SECONDS)
        assert await banner(page, "unserved").count() == 0
        worker.signal(signal.SIGTERM)  # stopped as an operator stops it: it leaves the registry
        assert worker.wait(timeout=60) == 0
    due = [await orc.submit("scripted", {"script": ["ok"]}) for _ in range(2)]
    await banner(page, "unserved").wait_for(timeout=SECONDS)
    said = await banner(page, "unserved").inner_text()
    assert "2 scripted job(s) due on queue scripted, and no live worker runs this type" in said
    assert "Start a worker of an application that runs it" in said
    assert await page.locator("[data-runners]").get_attribute("data-runners") == "0"
    await banner(page, "unserved").get_by_role("link", name="Fix it").click()
    await page.wait_for_url(f"{server.url}/ui/applications")
    await page.go_back()
    async with WorkerRun(orc) as back:  # a worker back: they run, and the banner goes
        await back.until_finished(*due, timeout=60)
        await banner(page, "unserved").wait_for(state="detached", timeout=SECONDS)
    await page.context.close()


async def test_a_paused_flow_key_is_a_banner_for_those_whose_jobs_it_holds(
    orc: Orchestrator, server: ApiServer, browser: Any
) -> None:
    async with WorkerRun(orc) as worker:
        first = await orc.submit("metered", {"model": "m"}, tenant_id="a")
        await worker.until_finished(first)
        await orc.pause_flow_key("provider:m", seconds=600, reason="provider outage", by="alice")
        for tenant in ("a", "b"):
            await orc.submit("metered", {"model": "m"}, tenant_id=tenant)

        async def held() -> bool:
            (key,) = await orc.flow_keys("provider:m")
            return key.waiting == 2

        await wait_for(held, 30)
    fleet = await signed_in(browser, server, await token(orc.stores.tokens, "f", Scope.READ))
    mine = await signed_in(
        browser, server, await token(orc.stores.tokens, "a", Scope.READ, tenants=["a"])
    )
    stranger = await signed_in(
        browser, server, await token(orc.stores.tokens, "c", Scope.READ, tenants=["c"])
    )
    for page, waiting in ((fleet, 2), (mine, 1)):
        await banner(page, "flow_key").wait_for(timeout=SECONDS)
        said = await banner(page, "flow_key").inner_text()
        assert f"Flow key provider:m ({waiting} waiting) is paused by alice until" in said, said
        assert "provider outage" in said and "Resume it on Flow" in said
        link = banner(page, "flow_key").get_by_role("link", name="Fix it")
        assert await link.get_attribute("href") == "/ui/flow"
    await shown(stranger)  # none of its jobs waits on the key: nothing of it
    assert await banner(stranger, "flow_key").count() == 0
    assert "provider:m" not in await stranger.content()
    await orc.resume_flow_key("provider:m")
    await banner(fleet, "flow_key").wait_for(state="detached", timeout=SECONDS)
    for page in (fleet, mine, stranger):
        await page.context.close()


@log_guard.fails_jobs("HTTP_400")
async def test_letters_to_review_and_the_last_minutes_failures_show_at_once(
    orc: Orchestrator, server: ApiServer, browser: Any
) -> None:
    """Right after a job dead-letters, before any rollup: a banner, the failed count and the
    "Now" chart say so (never "0 % failed of 0"), for its tenant only."""
    async with WorkerRun(orc) as worker:
        doomed = await orc.submit("scripted", {"script": ["permanent"]}, tenant_id="a")
        retried = await orc.submit("scripted", {"script": ["infra", "ok"]}, tenant_id="a")
        await worker.until_finished(doomed, retried, timeout=60)
    mine = await signed_in(
        browser, server, await token(orc.stores.tokens, "a", Scope.READ, tenants=["a"])
    )
    theirs = await signed_in(
        browser, server, await token(orc.stores.tokens, "b", Scope.READ, tenants=["b"])
    )
    await banner(mine, "dead_letters").wait_for(timeout=SECONDS)
    assert "1 dead letter(s) to review" in await banner(mine, "dead_letters").inner_text()
    assert await mine.locator("[data-count='failed-now']").inner_text() == "1"
    assert "0 % failed of 0" not in await mine.content()
    now = mine.locator("figure[data-chart^='Now']")
    totals = await now.locator("[data-line]").evaluate_all(
        "spans => Object.fromEntries(spans.map(s => [s.dataset.line, +s.dataset.total]))"
    )
    assert totals == {"retried": 1, "failed": 1}, totals
    assert await now.locator(".yaxis span").all_inner_texts() == ["1", "0.5", "0"]
    assert "per minute, in the minute they happened" in await now.inner_text()
    await shot(mine, "overview-banners")
    await banner(mine, "dead_letters").get_by_role("link", name="Fix it").click()
    await mine.wait_for_url(f"{server.url}/ui/dead-letters")
    await shown(theirs)  # another tenant: none of the letters, none of the failures
    assert await banner(theirs, "dead_letters").count() == 0
    assert await theirs.locator("[data-count='failed-now']").inner_text() == "0"
    for page in (mine, theirs):
        await page.context.close()


async def test_failures_that_notify_nobody_are_a_banner_until_a_target_is_set(
    orc: Orchestrator, server: ApiServer, browser: Any, dsn: str
) -> None:
    secret = await token(orc.stores.tokens, "ops", Scope.READ)
    page = await signed_in(browser, server, secret)
    await banner(page, "notifications").wait_for(timeout=SECONDS)
    said = await banner(page, "notifications").inner_text()
    assert "Nobody is notified of failures or approvals: no target is set" in said
    assert "ORCHESTRATOR_ESCALATION_TARGET" in said
    await page.context.close()
    target = '{"channel": "webhook", "url": "https://hooks.example/secret-path"}'
    with ApiServer(dsn, app=APP, ORCHESTRATOR_RETRY_CONFIG=ui_app.CONFIG,
                   ORCHESTRATOR_ESCALATION_TARGET=target,
                   ORCHESTRATOR_ESCALATION_JOB_TYPE="shaped",
                   ORCHESTRATOR_APPROVAL_JOB_TYPE="shaped") as told:  # fmt: skip
        page = await signed_in(browser, told, secret)
        await shown(page)
        assert await banner(page, "notifications").count() == 0
        assert "secret-path" not in await page.content()
        await page.context.close()
