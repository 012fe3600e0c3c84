"""The dashboard's layout in a real Chromium (test_ui's fixtures), every page filled as a fleet
fills it (tenants, long keys, ids and names, a paused flow key, a schedule, usage rows, a dead
letter, a waiting approval, an agent job's long answer): at 390 px (a phone) no page scrolls
sideways, and at 1280 px no table's header cell is clipped."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from orchestrator import JobContext, Orchestrator, Status
from tests.support import log_guard
from tests.support.api_server import ApiServer, token
from tests.support.external import MessageService
from tests.support.harness import WorkerRun, wait_for
from tests.test_ui import browser, orc, server, service, signed_in  # noqa: F401  (fixtures)

TENANT = "acme-corporation-international-holdings-emea"
MODEL = "claude-opus-with-a-rather-long-model-identifier-2026-11-29"
#: An agent's answer as models write them: long words (a URL, a hash) that do not break.
ANSWER = "See https://example.com/" + "a-very-long-path-segment-" * 12 + " and " + "f" * 120

#: The elements that stick out of the page, to name the culprit when one does.
OVERFLOWING = """() => [...document.querySelectorAll("body *")]
    .filter(e => e.getBoundingClientRect().right > document.documentElement.clientWidth + 1)
    .map(e => e.tagName.toLowerCase() + (e.className ? "." + e.className : "")
              + " " + Math.round(e.getBoundingClientRect().right) + "px")
    .slice(0, 8)"""
#: Header cells cut short: their text wider than the cell, or the cell past the edge of a box
#: that scrolls (seen only by scrolling it) or of the page.
CLIPPED_HEADERS = """() => [...document.querySelectorAll("th")].filter(th => {
      if (th.scrollWidth > th.clientWidth + 1) return true;
      const right = th.getBoundingClientRect().right;
      for (let box = th.parentElement; box; box = box.parentElement) {
        const overflow = getComputedStyle(box).overflowX;
        if ((overflow !== "visible" || box === document.documentElement)
            && right > box.getBoundingClientRect().left + box.clientWidth + 1) return true;
      }
      return false;
    }).map(th => th.textContent.trim())"""


async def _status(orc: Orchestrator, job_id: Any, status: Status) -> bool:  # noqa: F811  (orc: the fixture's name)
    return (await orc.get_job(job_id)).status is status


@pytest.fixture
async def filled(
    orc: Orchestrator,  # noqa: F811
    service: MessageService,  # noqa: F811
    db: psycopg.AsyncConnection[Any],
) -> dict[str, str]:
    """A fleet's worth of content; the pages to visit, by name."""
    orc.schedule(
        "nightly-digest-of-every-tenant-s-open-invoices", "scripted", cron="0 7 * * 1-5",
        tz="America/Argentina/Buenos_Aires", payload={"script": ["ok"]}, tenant_id=TENANT,
    )  # fmt: skip
    await orc.stores.schedules.sync(orc.application, orc.schedules.values())
    key = f"invoice/{TENANT}/2026-11-29/" + "x" * 60
    done = await orc.submit("scripted", {"script": ["ok"]}, tenant_id=TENANT, job_key=key,
                            agent_id="billing-reconciliation-agent-eu-west")  # fmt: skip
    failed = await orc.submit("scripted", {"script": ["permanent"]}, tenant_id="globex")
    agent = await orc.submit("agent", {"service": service.url, "steps": 4, "send_at": [2, 3]},
                             tenant_id=TENANT)  # fmt: skip
    waiting = await orc.submit("agent", {"service": service.url, "approval_at": 1})
    metered = await orc.submit("metered", {"model": MODEL}, tenant_id=TENANT)

    @orc.job_type("answer")
    async def answer(ctx: JobContext, payload: None) -> dict[str, Any]:
        return {"answer": ANSWER, "turns": [{"role": "assistant", "text": ANSWER}] * 3}

    answered = await orc.submit("answer", None, tenant_id=TENANT)
    async with WorkerRun(orc) as worker:
        await worker.until_finished(done, failed, agent, metered, answered)
        await wait_for(lambda: _status(orc, waiting, Status.WAITING_APPROVAL))
    await orc.pause_flow_key(
        f"provider:{MODEL}", seconds=600, by="oncall-engineer@example.com",
        reason="the provider's status page reports elevated 529s in eu-west; holding until fixed",
    )  # fmt: skip
    await orc.submit("metered", {"model": MODEL}, tenant_id=TENANT)  # waits on the paused key
    for n, (tenant, model) in enumerate([(TENANT, MODEL), ("globex", MODEL), (None, "m")]):
        await db.execute(
            "INSERT INTO orc_llm_usage (job_id, call_id, attempt, tenant_id, agent_id, job_type,"
            " model, input_tokens, output_tokens, cache_read_tokens, cache_creation_tokens)"
            " VALUES (%s, %s, 1, %s, 'billing-reconciliation-agent-eu-west', 'agent', %s,"
            " 123456789, 98765432, 1234567, 7654321)",
            (agent, f"call-{n}", tenant, model),
        )
    return {
        "overview": "/ui", "jobs": "/ui/jobs", "a job": f"/ui/jobs/{done}",
        "a failed job": f"/ui/jobs/{failed}", "an agent job": f"/ui/jobs/{agent}",
        "a long answer": f"/ui/jobs/{answered}",
        "a job waiting for approval": f"/ui/jobs/{waiting}", "dead letters": "/ui/dead-letters",
        "approvals": "/ui/approvals", "schedules": "/ui/schedules", "flow": "/ui/flow",
        "usage": "/ui/usage", "usage by agent": "/ui/usage?by=tenant,agent",
        "usage by job": "/ui/usage?by=job", "applications": "/ui/applications",
        "config": "/ui/config",
    }  # fmt: skip


@log_guard.fails_jobs("HTTP_400")
async def test_every_page_holds_on_a_phone_and_no_header_is_clipped_at_1280(
    orc: Orchestrator,  # noqa: F811
    server: ApiServer,  # noqa: F811
    browser: Any,  # noqa: F811
    filled: dict[str, str],
) -> None:
    page = await signed_in(browser, server, await token(orc.stores.tokens, "layout"))
    sideways: dict[str, list[str]] = {}
    clipped: dict[str, list[str]] = {}
    for name, path in filled.items():
        await page.set_viewport_size({"width": 1280, "height": 900})
        shown = await page.goto(f"{server.url}{path}")
        assert shown is not None and shown.ok, name
        if found := await page.evaluate(CLIPPED_HEADERS):
            clipped[name] = found
        await page.set_viewport_size({"width": 390, "height": 844})
        width = await page.evaluate(
            "document.documentElement.scrollWidth - document.documentElement.clientWidth"
        )
        if width > 0:
            sideways[name] = await page.evaluate(OVERFLOWING)
    assert (sideways, clipped) == ({}, {})
    await page.goto(f"{server.url}/ui/approvals")  # its countdown, ticked by the page's script
    expiry = page.locator("li.approval .countdown").first
    await page.wait_for_function("document.querySelector('li.approval .countdown').textContent"
                                 ".startsWith('in ')")  # fmt: skip
    line = await expiry.locator("xpath=..").inner_text()
    assert "expires in " in line and "in in" not in line
    await page.context.close()
