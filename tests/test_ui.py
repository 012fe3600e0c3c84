"""The dashboard in a real headless Chromium (Debian's, driven by Playwright), against a live
``orchestrator serve`` on a real database, with a worker running the jobs: sign in, a retry's
countdown and the job's live progress, a job's timeline, steps and ledger, a requeue, the
two-person discard, an approval, and a tenant's token that never sees another tenant's jobs.
Each page is photographed: into docs/ui/ (README.md links them) when ORCHESTRATOR_UI_SHOTS=docs
asks to refresh those, else into a temporary folder, so a run leaves the working tree as it
found it."""

from __future__ import annotations

import asyncio
import os
import re
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import psycopg
import pytest
from playwright.async_api import async_playwright

from orchestrator import Orchestrator, Status
from orchestrator.client import AsyncClient
from orchestrator.domain.principals import Scope
from orchestrator.interfaces.ui import pages
from tests.support import log_guard, ui_app
from tests.support.api_server import ApiServer, token, ui_session
from tests.support.external import MessageService, message_service
from tests.support.harness import ROOT, WorkerRun, wait_for
from tests.support.tools import find

SHOTS = (
    ROOT / "docs" / "ui"
    if os.environ.get("ORCHESTRATOR_UI_SHOTS") == "docs"
    else Path(tempfile.gettempdir()) / "orchestrator-ui-shots"
)
CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


@pytest.fixture(scope="module")
def server(dsn: str) -> Iterator[ApiServer]:
    with ApiServer(dsn, app="tests.support.ui_app:orc",
                   ORCHESTRATOR_RETRY_CONFIG=ui_app.CONFIG) as running:  # fmt: skip
        yield running


@pytest.fixture
async def orc(make_orc: Callable[..., Orchestrator]) -> Orchestrator:
    made = make_orc(retry_config=ui_app.CONFIG)
    ui_app.register(made)
    await made.open()
    return made


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Any]:
    executable = find("chromium")
    async with async_playwright() as p:
        launched = await p.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS)
        yield launched
        await launched.close()


@pytest.fixture
def service() -> Iterator[MessageService]:
    with message_service() as svc:
        yield svc


async def signed_in(browser: Any, server: ApiServer, secret: str, **options: Any) -> Any:
    """A page of a new browser context (its own cookies), signed in with ``secret``."""
    context = await browser.new_context(viewport={"width": 1280, "height": 900}, **options)
    page = await context.new_page()
    await page.goto(f"{server.url}/ui")
    assert "/ui/login" in page.url  # every page asks for a token first
    await page.get_by_label("API token").fill(secret)
    await page.get_by_role("button", name="Sign in").click()
    await page.wait_for_url(f"{server.url}/ui")
    return page


async def accept(dialog: Any) -> None:
    """Say yes to an action's confirmation."""
    await dialog.accept()


async def shot(page: Any, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


async def test_sign_in_needs_a_live_token_and_sets_a_strict_http_only_cookie(
    orc: Orchestrator, server: ApiServer, browser: Any
) -> None:
    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    page = await context.new_page()
    await page.goto(f"{server.url}/ui/jobs")
    await page.get_by_label("API token").fill("orc_not-a-token")
    await shot(page, "login")
    await page.get_by_role("button", name="Sign in").click()
    await page.get_by_role("alert").wait_for()
    assert "not an orchestrator API token" in await page.get_by_role("alert").inner_text()
    secret = await token(orc.stores.tokens, "viewer", Scope.READ)
    await page.get_by_label("API token").fill(secret)
    await page.get_by_role("button", name="Sign in").click()
    await page.wait_for_url(f"{server.url}/ui/jobs")  # back where it was going
    [cookie] = await context.cookies()
    assert (cookie["httpOnly"], cookie["sameSite"]) == (True, "Strict")
    assert await page.get_by_role("button", name="Cancel job").count() == 0  # read only
    # an action without the session's CSRF token is refused, cookie or not
    forged = await page.request.post(
        f"{server.url}/ui/jobs/{UUID(int=1)}/cancel", form={"csrf": "forged"}
    )
    assert forged.status == 401 and "CSRF" in (await forged.json())["detail"]
    await context.close()


#: What the dashboard's pages may load: their own script, style and data, nothing inline.
STRICT = ("default-src 'none'", "script-src 'self'", "style-src 'self'", "frame-ancestors 'none'")
#: Seen in the browser's console when the page breaks its policy (or something tries to).
REPORT_VIOLATIONS = """document.addEventListener("securitypolicyviolation",
    (e) => console.error("CSP violation: " + e.violatedDirective + " " + e.blockedURI));"""


def assert_secured(headers: dict[str, str], *, cached: bool = False) -> None:
    policy = headers["content-security-policy"]
    assert all(directive in policy for directive in STRICT) and "unsafe" not in policy, policy
    assert headers["x-frame-options"] == "DENY"
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["referrer-policy"] == "same-origin"
    assert (headers.get("cache-control") == "no-store") is not cached


async def test_every_page_works_under_a_strict_content_security_policy(
    orc: Orchestrator, server: ApiServer, browser: Any
) -> None:
    job_id = await orc.submit("scripted", {"script": ["ok"]})
    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    console: list[str] = []
    context.on("console", lambda message: console.append(message.text))
    await context.add_init_script(REPORT_VIOLATIONS)
    page = await context.new_page()
    login = await page.goto(f"{server.url}/ui/login")
    assert login is not None
    assert_secured(await login.all_headers())
    await page.get_by_label("API token").fill(await token(orc.stores.tokens, "csp"))
    await page.get_by_role("button", name="Sign in").click()
    await page.wait_for_url(f"{server.url}/ui")
    async with page.expect_response(lambda r: "/ui/fragments/overview" in r.url):
        pass  # the page's own script is live: its event stream says "changed", it re-reads
    for path in ("/ui", "/ui/jobs", f"/ui/jobs/{job_id}", "/ui/dead-letters", "/ui/approvals",
                 "/ui/schedules", "/ui/flow", "/ui/usage", "/ui/config"):  # fmt: skip
        shown = await page.goto(f"{server.url}{path}")
        assert shown is not None and shown.ok
        assert_secured(await shown.all_headers())
    assert await page.locator("[data-countdown], main").count() > 0
    assert not [m for m in console if "Content Security Policy" in m or "CSP" in m], console
    # and it holds: a script written into the page (say, by an injection) does not run
    await page.evaluate("""() => { const s = document.createElement("script");
        s.textContent = "window.injected = true"; document.head.appendChild(s); }""")
    assert await page.evaluate("window.injected === undefined")
    assert any("CSP violation: script-src" in m for m in console), console
    await context.close()


async def test_another_site_can_neither_frame_the_dashboard_nor_sign_a_browser_in(
    orc: Orchestrator, server: ApiServer, browser: Any
) -> None:
    """Login CSRF: a form on another site posting someone's token to /ui/login would sign the
    visitor in to that someone's session (and what they then do, they do as that someone)."""
    secret = await token(orc.stores.tokens, "mallory", Scope.READ, Scope.OPERATE)
    attacker = "http://attacker.test"
    trap = f"""<iframe src="{server.url}/ui/login"></iframe>
        <form id="trap" method="post" action="{server.url}/ui/login">
          <input name="token" value="{secret}"><input name="csrf" value="guessed"></form>"""
    context = await browser.new_context()
    await context.route(f"{attacker}/**", lambda route: route.fulfill(body=trap,
                                                                      content_type="text/html"))  # fmt: skip
    page = await context.new_page()
    await page.goto(f"{attacker}/")
    [framed] = page.frames[1:]
    assert await framed.locator("#token").count() == 0  # frame-ancestors 'none': not shown
    async with page.expect_navigation() as posted:
        await page.evaluate("document.getElementById('trap').submit()")
    refused = await posted.value
    assert refused is not None and refused.request.method == "POST" and refused.status == 401
    assert "orc_session" not in {c["name"] for c in await context.cookies()}
    await page.goto(f"{server.url}/ui")
    assert "/ui/login" in page.url  # not signed in as mallory
    await context.close()


async def test_every_answer_carries_the_security_headers(
    orc: Orchestrator, server: ApiServer
) -> None:
    secret = await token(orc.stores.tokens, "headers", Scope.READ)
    with ui_session(server, secret) as (client, _):
        for path in ("/ui/login", "/ui", "/ui/jobs", "/ui/fragments/jobs", "/ui/dead-letters",
                     "/ui/config", f"/ui/jobs/{UUID(int=1)}", "/api/v1/jobs", "/ui/nowhere"):  # fmt: skip
            answer = client.get(path, headers={"Authorization": f"Bearer {secret}"})
            assert answer.status_code in (200, 404), (path, answer.text)
            assert_secured(dict(answer.headers))
        static = client.get("/ui/static/app.js")
        assert_secured(dict(static.headers), cached=True)  # the only answer kept in a cache
        assert str(ui_app.CONFIG) not in client.get("/ui/config").text


async def test_every_dashboard_form_without_its_csrf_field_is_refused_with_401(
    orc: Orchestrator, server: ApiServer
) -> None:
    forms = [r.path for r in pages.router.routes if "POST" in getattr(r, "methods", ())]
    assert {"/ui/login", "/ui/logout", "/ui/jobs/{job_id}/cancel"} <= set(forms)
    secret = await token(orc.stores.tokens, "formless", Scope.READ, Scope.OPERATE)
    with ui_session(server, secret) as (client, _):
        for form in forms:
            path = re.sub(r"\{\w+\}", str(UUID(int=1)), form)
            for fields in ({"token": secret, "reason": "r"}, {"csrf": "forged", "reason": "r"}):
                refused = client.post(path, data=fields)
                assert refused.status_code == 401, (form, fields, refused.text)
                assert refused.json()["code"] == "UNAUTHORIZED"
                assert "CSRF" in refused.json()["detail"]
        assert client.get("/ui").status_code == 200  # still signed in: nothing was done


async def test_a_retry_counts_down_then_runs_and_completes_without_a_reload(
    orc: Orchestrator, server: ApiServer, browser: Any
) -> None:
    page = await signed_in(browser, server, await token(orc.stores.tokens, "ops"))
    job_id = await orc.submit("paced", None)
    async with WorkerRun(orc):
        await wait_for(lambda: _status(orc, job_id, Status.RETRY))
        await page.goto(f"{server.url}/ui/jobs?status=RETRY")
        row = page.locator(f"tr[data-job='{job_id}']")
        await row.wait_for()
        assert "app" in await row.locator(".layer").inner_text()
        assert "TRANSIENT_APP" in await row.locator(".class").inner_text()
        first = _seconds(await row.locator(".countdown").inner_text())
        await page.wait_for_timeout(1200)
        later = _seconds(await row.locator(".countdown").inner_text())
        assert 0 < later < first <= 4.5  # it ticks down in the browser
        await shot(page, "jobs")

        await page.goto(f"{server.url}/ui/jobs/{job_id}")
        await page.evaluate("window.notReloaded = true")
        status = page.locator("#job-status")
        assert await status.inner_text() == "RETRY"
        assert "in " in await page.locator("#job .countdown").inner_text()
        # (waits by locator: the page's policy refuses the eval of wait_for_function)
        await status.filter(has_text=re.compile("^RUNNING$")).wait_for(timeout=15_000)
        await status.filter(has_text=re.compile("^COMPLETED$")).wait_for(timeout=15_000)
        assert await page.evaluate("window.notReloaded") is True  # updated in place
    kinds = await page.locator(".timeline .event strong").all_inner_texts()
    assert kinds[-1] == "job.completed" and "job.retry_scheduled" in kinds
    await page.context.close()


async def test_a_job_page_shows_its_timeline_steps_and_ledger(
    orc: Orchestrator, server: ApiServer, browser: Any, service: MessageService
) -> None:
    job_id = await orc.submit("agent", {"service": service.url, "steps": 3, "send_at": [2]})
    async with WorkerRun(orc) as worker:
        await worker.until_finished(job_id)
    page = await signed_in(browser, server, await token(orc.stores.tokens, "reader", Scope.READ))
    await page.goto(f"{server.url}/ui/jobs/{job_id}")
    timeline = page.locator(".timeline .event")
    kinds = await timeline.locator("strong").all_inner_texts()
    assert kinds[0] == "job.created" and kinds.count("job.checkpointed") == 3
    checkpointed = timeline.filter(has=page.locator("strong", has_text="job.checkpointed")).first
    assert "step 1" in await checkpointed.locator(".what").inner_text()  # readable, not JSON
    steps = page.locator("ol.steps")
    assert await steps.locator("li.checkpoint").count() == 3
    effect = steps.locator("li.side_effect")
    assert await effect.count() == 1 and "committed" in await effect.inner_text()
    await shot(page, "job")
    await page.set_viewport_size({"width": 390, "height": 844})
    await shot(page, "job-phone")
    await page.context.close()


@log_guard.fails_jobs("HTTP_400")
async def test_dead_letters_are_requeued_and_discarded_by_two_people(
    orc: Orchestrator, server: ApiServer, browser: Any
) -> None:
    doomed = [await orc.submit("scripted", {"script": ["permanent"]}) for _ in range(2)]
    async with WorkerRun(orc) as worker:
        await worker.until_finished(*doomed)
    requeued_letter, discarded_letter = await orc.dead_letters()
    alice_secret = await token(orc.stores.tokens, "alice", Scope.READ, Scope.OPERATE)
    alice = await signed_in(browser, server, alice_secret)
    alice.on("dialog", accept)
    await alice.goto(f"{server.url}/ui/dead-letters")
    await shot(alice, "dead-letters")
    card = alice.locator(f"li[data-letter='{requeued_letter.id}']")
    await card.get_by_role("button", name="Requeue").click()
    await alice.get_by_role("status").wait_for()
    assert "requeued" in await alice.get_by_role("status").inner_text()
    assert (await orc.dead_letter(requeued_letter.id)).state == "requeued"

    card = alice.locator(f"li[data-letter='{discarded_letter.id}']")
    await card.get_by_label("Reason to discard").fill("a duplicate of an order already sent")
    await card.get_by_role("button", name="Request discard").click()
    card = alice.locator(f"li[data-letter='{discarded_letter.id}']")
    assert await card.get_by_role("button", name="Confirm discard").count() == 0
    assert "another reviewer must confirm" in await card.inner_text()
    async with httpx.AsyncClient(base_url=server.url) as api:  # nor can the API be used
        alone = await api.post(
            f"/api/v1/dead-letters/{discarded_letter.id}/discard-confirm",
            headers={"Authorization": f"Bearer {alice_secret}"},
        )
    assert alone.status_code == 409 and alone.json()["code"] == "DLQ_ACTION_INVALID"

    bob = await signed_in(browser, server, await token(orc.stores.tokens, "bob", Scope.OPERATE,
                                                       Scope.READ))  # fmt: skip
    bob.on("dialog", accept)
    await bob.goto(f"{server.url}/ui/dead-letters")
    card = bob.locator(f"li[data-letter='{discarded_letter.id}']")
    assert "a duplicate of an order already sent" in await card.locator(".request").inner_text()
    assert "token:alice" in await card.locator(".request").inner_text()
    await card.get_by_role("button", name="Confirm discard").click()
    await bob.get_by_role("status").wait_for()
    letter = await orc.dead_letter(discarded_letter.id)
    assert (letter.state, letter.discarded_by) == ("discarded", "token:bob")
    for tenant in ("acme", "acme", "globex", None):
        await orc.submit("scripted", {"script": ["ok"]}, tenant_id=tenant)
    await bob.goto(f"{server.url}/ui")
    pending = bob.locator("[data-count='PENDING']")  # the overview updates itself (a read
    await pending.filter(has_text=re.compile("^5$")).wait_for(timeout=10_000)  # serves 2 s)
    # with the requeued job
    await shot(bob, "overview")
    await alice.context.close()
    await bob.context.close()


async def test_an_approved_step_resumes_its_job(
    orc: Orchestrator, server: ApiServer, browser: Any, service: MessageService
) -> None:
    job_id = await orc.submit("agent", {"service": service.url, "approval_at": 2})
    page = await signed_in(browser, server, await token(orc.stores.tokens, "approver"))
    async with WorkerRun(orc) as worker:
        await wait_for(lambda: _status(orc, job_id, Status.WAITING_APPROVAL))
        await page.goto(f"{server.url}/ui/approvals")
        approval = page.locator("li.approval").first
        assert "in " in await approval.locator(".countdown").inner_text()  # its expiry
        await shot(page, "approvals")
        await approval.get_by_label("Reason").first.fill("looks right")
        await approval.get_by_role("button", name="Approve").click()
        await page.get_by_role("status").wait_for()
        await worker.until_finished(job_id)
    assert (await orc.get_job(job_id)).status is Status.COMPLETED
    await page.goto(f"{server.url}/ui/config")
    schedule = page.locator("#type-paced table.schedule").first
    assert "4 s" in await schedule.inner_text()  # its backoff, as drawn for the operator
    await shot(page, "config")
    await page.context.close()


async def test_a_tenant_s_token_never_sees_another_tenant_s_jobs(
    orc: Orchestrator, server: ApiServer, browser: Any
) -> None:
    mine = await orc.submit("scripted", {"script": ["ok"]}, tenant_id="a")
    theirs = await orc.submit("scripted", {"script": ["ok"]}, tenant_id="b")
    nobody_s = await orc.submit("scripted", {"script": ["ok"]})
    page = await signed_in(
        browser, server, await token(orc.stores.tokens, "tenant-a", Scope.READ, tenants=["a"])
    )
    await page.goto(f"{server.url}/ui/jobs")
    shown = {UUID(j) for j in await page.locator("tr[data-job]").evaluate_all(
        "rows => rows.map(r => r.dataset.job)")}  # fmt: skip
    assert shown == {mine}
    for job_id in (theirs, nobody_s):
        await page.goto(f"{server.url}/ui/jobs/{job_id}")
        assert "Not found" in await page.locator("h1").inner_text()
        assert "scripted" not in await page.locator("main").inner_text()
    overview = await page.goto(f"{server.url}/ui")
    assert overview is not None and overview.ok
    assert await page.locator("[data-count='PENDING']").inner_text() == "1"
    await page.context.close()


async def test_schedules_show_their_next_and_last_run_and_pause_and_resume(
    orc: Orchestrator, server: ApiServer, browser: Any, db: Any
) -> None:
    """The schedules page: each schedule's next run (counting down) and last run (its job);
    an operator pauses one (with a confirmation) and resumes it; a tenant's token sees only its
    tenant's schedules."""
    orc.schedule("digest", "scripted", cron="0 7 * * *", tz="Europe/Paris",
                 payload={"script": ["ok"]})  # fmt: skip
    orc.schedule("minutely", "scripted", cron="* * * * *", backfill_seconds=120,
                 payload={"script": ["ok"]}, tenant_id="a")  # fmt: skip
    await orc.stores.schedules.sync(orc.application, orc.schedules.values())
    await db.execute("UPDATE orc_schedules SET fire_after = now() - interval '10 minutes'")
    assert (await orc.scheduler().run_once()).fired >= 2  # the minutely's last two minutes
    [last] = [v.last_job_id for v in await orc.list_schedules() if v.name == "minutely"]
    page = await signed_in(browser, server, await token(orc.stores.tokens, "scheduler"))
    page.on("dialog", accept)
    await page.goto(f"{server.url}/ui/schedules")
    digest, minutely = (
        page.locator("tr[data-schedule='digest']"),
        page.locator("tr[data-schedule='minutely']"),
    )
    assert "0 7 * * * (Europe/Paris)" in await digest.inner_text()
    assert "never run" in await digest.locator(".last").inner_text()
    assert re.search(r"in \d", await digest.locator(".next").inner_text())  # its countdown
    assert await minutely.locator(".last a").get_attribute("href") == f"/ui/jobs/{last}"
    await shot(page, "schedules")
    await minutely.get_by_role("button", name="Pause").click()
    await page.get_by_role("status").filter(has_text="minutely paused").wait_for()
    assert await minutely.get_attribute("data-paused") == "yes"
    assert "paused by token:scheduler" in await minutely.locator(".next").inner_text()
    [view] = [v for v in await orc.list_schedules() if v.name == "minutely"]
    assert view.paused and view.paused_by == "token:scheduler"
    await minutely.get_by_role("button", name="Resume").click()
    await page.get_by_role("status").filter(has_text="minutely resumed").wait_for()
    assert await minutely.get_attribute("data-paused") == "no"
    await page.context.close()
    page = await signed_in(
        browser, server, await token(orc.stores.tokens, "tenant-a", Scope.READ, tenants=["a"])
    )
    await page.goto(f"{server.url}/ui/schedules")
    names = await page.locator("tr[data-schedule]").evaluate_all(
        "rows => rows.map(r => r.dataset.schedule)"
    )
    assert names == ["minutely"]  # not the schedule without a tenant
    assert await page.get_by_role("button", name="Pause").count() == 0  # read only
    await page.context.close()


async def test_the_flow_page_shows_a_paused_key_and_its_waiting_jobs_until_resumed(
    orc: Orchestrator, server: ApiServer, browser: Any
) -> None:
    """A paused key (its pause, who, why; its waiting jobs counted), a job that waits for it
    saying so in the jobs list and on its page, the operator's Resume, and a tenant's token,
    which sees no key (keys cover every tenant's jobs) but its own job's reason. The key holds a
    slash (it is rendered from the payload's model), which its Resume's address keeps."""
    first = await orc.submit("metered", {"model": "m/1"}, tenant_id="a")
    async with WorkerRun(orc):
        await wait_for(lambda: _status(orc, first, Status.COMPLETED))  # the key exists now
        await orc.pause_flow_key("provider:m/1", seconds=600, reason="provider incident", by="ops")
        held = await orc.submit("metered", {"model": "m/1"}, tenant_id="a")

        async def waiting() -> bool:
            return (await orc.get_job(held)).waiting_for is not None

        await wait_for(waiting)
        page = await signed_in(browser, server, await token(orc.stores.tokens, "flow-ops"))
        page.on("dialog", accept)
        await page.goto(f"{server.url}/ui/flow")
        key = page.locator("tr[data-key='provider:m/1']")
        assert await key.get_attribute("data-paused") == "yes"
        state = await key.locator(".key-state").inner_text()
        assert "paused" in state and "by ops: provider incident" in state
        assert await key.locator(".waiting").inner_text() == "1"
        await shot(page, "flow")
        await page.goto(f"{server.url}/ui/jobs/{held}")
        reason = await page.locator("#job-waiting-for").inner_text()
        assert reason.startswith("waiting for capacity on provider:m/1 (paused until ")
        await page.goto(f"{server.url}/ui/flow")
        await key.get_by_role("button", name="Resume").click()
        await page.get_by_role("status").filter(has_text="provider:m/1 resumed").wait_for()
        await wait_for(lambda: _status(orc, held, Status.COMPLETED))
        await page.context.close()
    page = await signed_in(
        browser, server, await token(orc.stores.tokens, "flow-a", Scope.READ, tenants=["a"])
    )
    await page.goto(f"{server.url}/ui/flow")
    assert await page.locator("tr[data-key]").count() == 0
    assert "fleet" in await page.locator("main").inner_text()
    await page.context.close()


#: Flow keys an attacker's payload may render (the limit's template holds ``{payload.model}``):
#: a way out of the key's address to another object's, a whole-segment ``..`` and ``.``,
#: characters an address gives a meaning, an encoding of a slash taken literally, unicode.
HOSTILE = ("provider:x/../../schedules/victim", "..", ".", "../..", "a/b/", "/lead",
           "a%2Fb", "what?is=this&x", "a#frag", "with space", "ünïcødé/键/😀", "x/resume")  # fmt: skip


async def _hostile_keys(orc: Orchestrator, db: Any) -> None:
    """The hostile keys, each paused for ten minutes; the first rendered from a payload (a job
    of it claimed), the others written as a claim writes a key; and a paused schedule named
    ``victim`` beside them, which none of their actions may reach."""
    first = await orc.submit("metered", {"model": "x/../../schedules/victim"})
    async with WorkerRun(orc):
        await wait_for(lambda: _status(orc, first, Status.COMPLETED))
    for key in HOSTILE[1:]:
        await db.execute(
            "INSERT INTO orc_flow_keys (key, limit_name, task_prefix) VALUES (%s, 'provider',"
            " 'orc.')",
            (key,),
        )
    for key in HOSTILE:
        await orc.pause_flow_key(key, seconds=600, reason="hostile", by="test")
    orc.schedule("victim", "scripted", cron="0 7 * * *", payload={"script": ["ok"]})
    await orc.stores.schedules.sync(orc.application, orc.schedules.values())
    await orc.pause_schedule("victim", by="test")


async def _paused(orc: Orchestrator, key: str) -> bool:
    return (await orc.stores.flow.get(key)).paused_until is not None


async def _victim_paused(orc: Orchestrator) -> bool:
    [victim] = [v for v in await orc.list_schedules() if v.name == "victim"]
    return victim.paused


async def test_the_flow_page_resumes_exactly_the_key_it_shows_whatever_it_holds(
    orc: Orchestrator, server: ApiServer, browser: Any, db: Any
) -> None:
    """Each hostile key's Resume, clicked in Chromium, resumes that key and nothing else: the
    key whose ``/`` and ``..`` made the button's address ``/ui/schedules/victim/resume`` (the
    browser resolving it) used to resume the schedule and leave the key paused."""
    await _hostile_keys(orc, db)
    page = await signed_in(browser, server, await token(orc.stores.tokens, "flow-hostile"))
    page.on("dialog", accept)
    await page.goto(f"{server.url}/ui/flow")
    for key in HOSTILE:
        row = page.locator("tr.flow-key").filter(
            has=page.locator("strong").get_by_text(key, exact=True)
        )
        assert await row.get_attribute("data-key") == key
        await row.get_by_role("button", name="Resume").click()
        await page.get_by_role("status").filter(has_text=f"{key} resumed").wait_for()
        assert not await _paused(orc, key), key
        assert await _victim_paused(orc), key
    await page.context.close()


async def test_the_api_and_its_client_take_any_key_as_one_path_segment(
    orc: Orchestrator, server: ApiServer, db: Any
) -> None:
    """Through a real ``orchestrator serve``, the Python client reads, pauses and resumes each
    hostile key as itself (a key is one percent-encoded path segment, its ``/`` and ``.``
    included: docs/api.md); a raw request with the key's slash encoded as ``%2F`` names the
    same key; and the schedule beside them stays paused."""
    await _hostile_keys(orc, db)
    secret = await token(orc.stores.tokens, "flow-api")
    async with AsyncClient(server.url, secret) as api:
        for key in HOSTILE:
            assert (await api.flow_key(key)).key == key
            resumed = await api.resume_flow_key(key)
            assert resumed.key == key and resumed.paused_until is None, key
            paused = await api.pause_flow_key(key, 60, "again")
            assert paused.key == key and paused.pause_reason == "again", key
            assert await _paused(orc, key) and await _victim_paused(orc), key
    async with httpx.AsyncClient(
        base_url=server.url, headers={"Authorization": f"Bearer {secret}"}
    ) as raw:
        answer = await raw.post("/api/v1/flow/keys/a%2Fb%2F/resume")
        assert answer.status_code == 200 and answer.json()["key"] == "a/b/"
        answer = await raw.get("/api/v1/flow/keys/a%252Fb")
        assert answer.status_code == 200 and answer.json()["key"] == "a%2Fb"
    assert await _victim_paused(orc)


async def _status(orc: Orchestrator, job_id: UUID, status: Status) -> bool:
    return (await orc.get_job(job_id)).status is status


def _seconds(text: str) -> float:
    found = re.search(r"([\d.]+) (ms|s)", text)
    assert found, text
    value = float(found.group(1))
    return value / 1000 if found.group(2) == "ms" else value


async def test_the_overview_charts_the_rollups_each_viewer_its_tenants_only(
    orc: Orchestrator, server: ApiServer, browser: Any, db: psycopg.AsyncConnection[Any]
) -> None:
    """Jobs that finished in the last minutes, of two tenants, rolled up: the overview's charts
    draw them (inline SVG, under the strict policy), each viewer's from its tenants' jobs."""
    for tenant, status, n in (("a", "COMPLETED", 4), ("a", "FAILED", 1), ("b", "COMPLETED", 6)):
        for i in range(n):
            await db.execute(
                "INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts,"
                " max_retries, trace_id, tenant_id, started_at, finished_at)"
                " VALUES (gen_random_uuid(), 'scripted', %s, 'null', 'default', 3, 3, 't', %s,"
                " now() - make_interval(mins => %s + 3), now() - make_interval(mins => %s + 3))",
                (status, tenant, i, i),
            )
    rollup = orc.maintenance.rollup
    rollup.settle_seconds = 0
    await rollup.run_once()  # (a worker's tick, had one run meanwhile, counts them the same)
    everyone = await signed_in(
        browser, server, await token(orc.stores.tokens, "charts", Scope.READ)
    )
    tenant_a = await signed_in(
        browser, server, await token(orc.stores.tokens, "charts-a", Scope.READ, tenants=["a"])
    )
    for page, completed, failed in ((everyone, 10, 1), (tenant_a, 4, 1)):
        for title in ("Finished, last hour", "Finished, last day"):
            chart = page.locator(f"figure[data-chart='{title}']")
            want = {"completed": completed, "failed": failed, "retried": 0}
            deadline = asyncio.get_running_loop().time() + pages.OVERVIEW_SECONDS + 10
            while True:  # an overview read before the rollup (another test's) is cached a while
                await chart.locator("[data-line='completed']").wait_for()
                totals = await chart.locator("[data-line]").evaluate_all(
                    "spans => Object.fromEntries("
                    "spans.map(s => [s.dataset.line, +s.dataset.total]))"
                )
                if totals == want or asyncio.get_running_loop().time() > deadline:
                    break
                await asyncio.sleep(0.5)
                await page.reload()
            assert totals == want, title
            line = chart.locator("polyline.chart-completed")
            assert len((await line.get_attribute("points") or "").split()) > 1
            box = None
            for _ in range(40):  # a live refresh may be replacing the chart at this moment
                box = await chart.locator("svg").bounding_box()
                if box is not None:
                    break
                await asyncio.sleep(0.25)
            assert box is not None and box["width"] > 200 and box["height"] > 50  # drawn
    await shot(everyone, "overview-charts")
    for page in (everyone, tenant_a):
        await page.context.close()
