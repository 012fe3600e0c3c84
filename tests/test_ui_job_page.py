"""A job's own page in a real Chromium (the fixtures of test_ui): its summary first (why it
failed, what happens next, who was told), approve and reject on the page of a job waiting for
a decision, its steps in order, an agent job's transcript with its answer in full, its output
live attempt by attempt (the superseded part struck out), and the page at a phone's width
without sideways scroll; another tenant's session can neither see the approval nor decide it,
nor read the output."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any
from uuid import UUID

import pytest

from demo import llm_server as llm
from orchestrator import Orchestrator, Status
from orchestrator.domain.principals import Scope
from tests import test_ui
from tests.support import job_types_app, log_guard, output_app
from tests.support.api_server import ApiServer, token, ui_session
from tests.support.external import MessageService
from tests.support.harness import ROOT, WorkerRun, wait_for
from tests.test_ui import accept, shot, signed_in

# test_ui's fixtures: its server (with its job types), browser, orchestrator, message service
browser, orc, server, service = test_ui.browser, test_ui.orc, test_ui.server, test_ui.service

KEY = "sk-test-0123456789abcdef"
PHONE = {"width": 390, "height": 844}
#: Every fold opened, so that what a click shows is measured too.
OPEN_ALL = "document.querySelectorAll('details').forEach(d => { d.open = true; })"
NO_SIDEWAYS = "document.documentElement.scrollWidth <= document.documentElement.clientWidth"


@pytest.fixture
def model_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[llm.LocalLLM]:
    with llm.serve(api_key=KEY) as running:
        monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
        monkeypatch.setenv("ANTHROPIC_BASE_URL", running.url)
        yield running


async def _status(orc: Orchestrator, job_id: UUID, status: Status) -> bool:
    return (await orc.get_job(job_id)).status is status


async def _holds_at_a_phone_s_width(page: Any) -> bool:
    await page.set_viewport_size(PHONE)
    await page.evaluate(OPEN_ALL)
    return bool(await page.evaluate(NO_SIDEWAYS))


async def _waiting(orc: Orchestrator, service: MessageService, **plan: Any) -> tuple[UUID, UUID]:
    """An agent job waiting for approval at step 2, and that approval's id."""
    job_id = await orc.submit("agent", {"service": service.url, "approval_at": 2, **plan})
    await wait_for(lambda: _status(orc, job_id, Status.WAITING_APPROVAL))
    [approval] = [a for a in await orc.approvals() if a["job_id"] == job_id]
    return job_id, approval["id"]


async def test_a_job_is_approved_from_its_own_page_and_resumes(
    orc: Orchestrator, server: ApiServer, browser: Any, service: MessageService
) -> None:
    page = await signed_in(browser, server, await token(orc.stores.tokens, "approver"))
    async with WorkerRun(orc) as worker:
        job_id, approval_id = await _waiting(orc, service)
        await page.goto(f"{server.url}/ui/jobs/{job_id}")
        assert "waits for approval" in await page.locator("#job-next").inner_text()
        asked = page.locator("#job-approval")
        assert "approve" in (await asked.inner_text()).lower()
        await shot(page, "job-approval")
        await asked.get_by_label("Reason", exact=True).fill("looks right")
        await asked.get_by_role("button", name="Approve").click()
        await page.get_by_role("status").wait_for()
        assert page.url.startswith(f"{server.url}/ui/jobs/{job_id}")  # back to the job's page
        assert "approved" in await page.get_by_role("status").inner_text()
        await worker.until_finished(job_id, timeout=60)
    assert (await orc.get_job(job_id)).status is Status.COMPLETED
    decided = await orc.stores.approvals.get(approval_id)
    assert (decided["status"], decided["decided_by"]) == ("approved", "token:approver")
    assert decided["reason"] == "looks right"
    await page.context.close()


@log_guard.fails_jobs("APPROVAL_REJECTED")
async def test_a_job_is_rejected_from_its_own_page_and_fails(
    orc: Orchestrator, server: ApiServer, browser: Any, service: MessageService
) -> None:
    page = await signed_in(browser, server, await token(orc.stores.tokens, "rejecter"))
    page.on("dialog", accept)
    async with WorkerRun(orc) as worker:
        job_id, approval_id = await _waiting(orc, service)
        await page.goto(f"{server.url}/ui/jobs/{job_id}")
        asked = page.locator("#job-approval")
        await asked.get_by_label("Reason to reject").fill("wrong recipient")
        await asked.get_by_role("button", name="Reject").click()
        await page.get_by_role("status").wait_for()
        assert "rejected" in await page.get_by_role("status").inner_text()
        await worker.until_finished(job_id, timeout=60)
    assert (await orc.get_job(job_id)).status is Status.FAILED  # on_reject: fail
    decided = await orc.stores.approvals.get(approval_id)
    assert (decided["status"], decided["decided_by"]) == ("rejected", "token:rejecter")
    await page.reload()
    assert await page.locator("#job-approval").count() == 0  # nothing left to decide
    await page.context.close()


async def test_another_tenant_s_session_can_neither_see_nor_decide_a_job_s_approval(
    orc: Orchestrator, server: ApiServer, browser: Any, service: MessageService
) -> None:
    async with WorkerRun(orc):
        job_id = await orc.submit(
            "agent", {"service": service.url, "approval_at": 1}, tenant_id="acme"
        )
        await wait_for(lambda: _status(orc, job_id, Status.WAITING_APPROVAL))
    [approval] = [a for a in await orc.approvals() if a["job_id"] == job_id]
    other = await token(orc.stores.tokens, "globex-ops", Scope.READ, Scope.OPERATE,
                        tenants=["globex"])  # fmt: skip
    with ui_session(server, other) as (client, csrf):
        assert client.get(f"/ui/jobs/{job_id}").status_code == 404
        assert approval["question"] not in client.get(f"/ui/jobs/{job_id}").text
        for decision in ("approve", "reject"):
            answer = client.post(
                f"/ui/approvals/{approval['id']}/{decision}",
                data={"csrf": csrf, "reason": "not mine", "back": f"/ui/jobs/{job_id}"},
            )
            assert answer.status_code == 404, answer.text
    still = await orc.stores.approvals.get(approval["id"])
    assert (still["status"], still["decided_by"]) == ("pending", None)
    assert (await orc.get_job(job_id)).status is Status.WAITING_APPROVAL
    own = await token(orc.stores.tokens, "acme-ops", Scope.READ, Scope.OPERATE, tenants=["acme"])
    with ui_session(server, own) as (client, csrf):  # the same form, the job's own tenant
        answer = client.post(
            f"/ui/approvals/{approval['id']}/reject",
            data={"csrf": csrf, "reason": "not now", "back": f"/ui/jobs/{job_id}"},
        )
        assert answer.status_code == 303
        assert answer.headers["location"].startswith(f"/ui/jobs/{job_id}?note=rejected")
    assert (await orc.stores.approvals.get(approval["id"]))["decided_by"] == "token:acme-ops"


@log_guard.fails_jobs("HTTP_400")
async def test_a_failed_job_s_summary_says_why_that_nobody_was_told_and_what_to_do(
    orc: Orchestrator, server: ApiServer, browser: Any
) -> None:
    async with WorkerRun(orc) as worker:
        job_id = await orc.submit("scripted", {"script": ["permanent"]})
        await worker.until_finished(job_id, timeout=60)
    page = await signed_in(browser, server, await token(orc.stores.tokens, "ops"))
    await page.goto(f"{server.url}/ui/jobs/{job_id}")
    assert await page.locator("#job-status").inner_text() == "FAILED"
    why = await page.locator("#job-why").inner_text()
    assert "permanent failure" in why and "HTTP_400" in why
    assert "dead-lettered: review it" in await page.locator("#job-next").inner_text()
    told = await page.locator("#job-notified").inner_text()
    assert told.startswith("nobody notified (ORCHESTRATOR_ESCALATION_TARGET is unset)")
    degraded = page.locator(".timeline .event[data-kind='job.degraded'] .what")
    assert "nobody notified" in await degraded.inner_text()  # the event says so too
    await page.get_by_role("button", name="Requeue dead letter").wait_for()
    running = page.locator(".timeline .event[data-kind='job.running'] .what")
    ceiling = re.search(r"at most (\d+) attempts from here", await running.first.inner_text())
    assert ceiling and int(ceiling.group(1)) >= 1  # labelled: the ceiling from there
    assert await _holds_at_a_phone_s_width(page)
    await page.context.close()


async def test_a_job_s_steps_are_listed_in_order(
    orc: Orchestrator, server: ApiServer, browser: Any, service: MessageService
) -> None:
    job_id = await orc.submit("agent", {"service": service.url, "steps": 4, "send_at": [2, 3]})
    async with WorkerRun(orc) as worker:
        await worker.until_finished(job_id, timeout=60)
    page = await signed_in(browser, server, await token(orc.stores.tokens, "reader", Scope.READ))
    await page.goto(f"{server.url}/ui/jobs/{job_id}")
    rows = page.locator("ol.steps > li")
    shown = [(int(await r.get_attribute("data-step")), await r.get_attribute("class"))
             for r in await rows.all()]  # fmt: skip
    # step by step, each step's side effect before the checkpoint that commits it
    assert shown == [(1, "checkpoint"), (2, "side_effect"), (2, "checkpoint"),
                     (3, "side_effect"), (3, "checkpoint"), (4, "checkpoint")]  # fmt: skip
    assert await _holds_at_a_phone_s_width(page)
    await page.context.close()


@pytest.fixture
def agents(make_orc: Callable[..., Orchestrator]) -> Orchestrator:
    """An orchestrator running the built-in job types (run_agent) on the test's database."""
    made = make_orc(retry_config=ROOT / "tests" / "support" / "job_types.toml")
    job_types_app.register(made)
    return made


async def test_an_agent_job_reads_as_a_transcript_with_its_answer_in_full(
    orc: Orchestrator, agents: Orchestrator, server: ApiServer, browser: Any,
    model_server: llm.LocalLLM, service: MessageService, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("TEST_MESSAGE_SERVICE_URL", service.url)
    async with WorkerRun(agents) as worker:
        job_id = await agents.submit(
            "run_agent", {"prompt": "tell the team", "model": "agent", "tools": ["send_message"]}
        )
        await worker.until_finished(job_id, timeout=60)
    job = await agents.get_job(job_id)
    assert job.status is Status.COMPLETED
    page = await signed_in(browser, server, await token(orc.stores.tokens, "reader", Scope.READ))
    await page.goto(f"{server.url}/ui/jobs/{job_id}")
    transcript = page.locator("#job-transcript")
    assert await transcript.locator(".tool-call").count() == 3
    first_call = transcript.locator(".tool-call").first
    assert "send_message" in await first_call.locator("summary").inner_text()
    assert await page.locator("#job-answer").inner_text() == job.result["answer"]  # in full
    # measured in one step: a live re-read may replace the element between two
    height, box = await page.locator("#job-answer").evaluate(
        "e => [e.scrollHeight, e.getBoundingClientRect().height]"
    )
    assert height <= box + 1  # no box to scroll: all of it is shown
    await shot(page, "job-agent")
    await page.set_viewport_size(PHONE)
    await shot(page, "job-agent-phone")
    assert await _holds_at_a_phone_s_width(page)
    await page.context.close()


async def test_a_retrying_job_says_when_and_keeps_an_opened_fold_open_as_it_updates(
    orc: Orchestrator, server: ApiServer, browser: Any
) -> None:
    page = await signed_in(browser, server, await token(orc.stores.tokens, "ops"))
    job_id = await orc.submit("paced", None)
    async with WorkerRun(orc):
        await wait_for(lambda: _status(orc, job_id, Status.RETRY))
        await page.goto(f"{server.url}/ui/jobs/{job_id}")
        assert await page.locator("#job-status").inner_text() == "RETRY"
        nxt = await page.locator("#job-next").inner_text()
        assert re.search(
            r"retries at \d\d:\d\d:\d\d UTC, attempt 2 of at most \d+ \(app layer\)", nxt
        )
        assert "transient failure" in await page.locator("#job-why").inner_text()
        scheduled = page.locator(".timeline .event[data-kind='job.retry_scheduled'] details")
        await scheduled.locator("summary").click()
        status = page.locator("#job-status")  # the page re-reads itself as the job moves on
        await status.filter(has_text=re.compile("^COMPLETED$")).wait_for(timeout=30_000)
    assert await scheduled.get_attribute("open") is not None  # still open after the updates
    assert "backoff" in await scheduled.locator("dl.payload").inner_text()
    await page.context.close()


async def test_a_job_s_page_draws_its_graph_each_node_a_link_its_status_live(
    orc: Orchestrator, server: ApiServer, browser: Any
) -> None:
    # A parent with a child that depends on it and two children it spawned (recorded as a
    # step's spawn records them); the page lists them, links each, and shows a child's end
    # as it happens (woken by the child's events, not by polling).
    far = "2099-01-01T00:00:00Z"
    parent = await orc.submit("scripted", {"script": ["ok"]}, run_at=far)
    dependant = await orc.submit("scripted", {"script": ["ok"]}, depends_on=[parent])
    spawned = [await orc.submit("scripted", {"script": ["ok"]}, run_at=far) for _ in range(2)]
    async with orc.stores.queries.connection() as conn:
        await conn.execute(
            "INSERT INTO orc_job_children (parent_id, step, key, n, child_id,"
            " cancel_with_parent) SELECT %s, 1, 'spawn1', n, c, true"
            " FROM unnest(%s::uuid[]) WITH ORDINALITY AS u (c, n)",
            (parent, spawned),
        )
    page = await signed_in(browser, server, await token(orc.stores.tokens, "grapher"))
    await page.goto(f"{server.url}/ui/jobs/{dependant}")
    parents = page.locator("#job-parents li")
    assert await parents.count() == 1
    assert "PENDING" in await parents.first.inner_text()
    assert "waiting for 1 job to end" in await page.locator("#job-next").inner_text()
    await parents.first.get_by_role("link").click()
    await page.wait_for_url(f"{server.url}/ui/jobs/{parent}")
    children = page.locator("#job-children li")
    assert [await c.get_attribute("data-job") for c in await children.all()] == [
        str(s) for s in spawned
    ]
    await shot(page, "job-graph")
    await orc.cancel(spawned[0], reason="not needed")
    first = page.locator(f"#job-children li[data-job='{spawned[0]}'] .status")
    await first.filter(has_text="CANCELLED").wait_for(timeout=15_000)
    assert await _holds_at_a_phone_s_width(page)


@pytest.fixture
async def streaming(make_orc: Callable[..., Orchestrator]) -> Orchestrator:
    """An open orchestrator running the output tests' streamer (tests/support/output_app.py)."""
    made = make_orc(retry_config=output_app.CONFIG)
    output_app.register(made)
    await made.open()
    return made


async def test_a_job_s_output_shows_live_attempt_by_attempt_its_superseded_part_struck_out(
    orc: Orchestrator, streaming: Orchestrator, server: ApiServer, browser: Any
) -> None:
    deltas = 40
    job_id = await streaming.submit(
        "streamer", {"deltas": deltas, "every": 0.05, "fail_first": True}, tenant_id="acme"
    )
    page = await signed_in(browser, server, await token(orc.stores.tokens, "reader", Scope.READ))
    await page.goto(f"{server.url}/ui/jobs/{job_id}")  # before it runs: nothing to show yet
    output = page.locator("#job-output")
    assert await output.is_hidden()
    first, second = (output.locator(f"section[data-attempt='{n}']") for n in (1, 2))
    async with WorkerRun(streaming) as worker:
        await first.filter(has_text="a1d0 ").wait_for(timeout=30_000)
        assert (await streaming.get_job(job_id)).finished_at is None  # shown as it is written
        await worker.until_finished(job_id, timeout=60)
    await output.locator(".output-state").filter(has_text="COMPLETED").wait_for(timeout=15_000)
    # The page re-read itself as the job moved on (its status), and kept the output as it was.
    await page.locator("#job-status").filter(has_text=re.compile("^COMPLETED$")).wait_for()
    assert (await streaming.get_job(job_id)).status is Status.COMPLETED
    texts = ["".join(f"a{a}d{n} " for n in range(deltas)) for a in (1, 2)]
    for attempt, section in ((1, first), (2, second)):
        assert await section.locator(".said").text_content() == texts[attempt - 1]
        record = f'progress {{"deltas":{deltas},"attempt":{attempt}}}'
        assert await section.locator(".progress").text_content() == record
    # Attempt 1 wrote outside any step: the marker covers all of it, struck out and said so.
    struck = first.locator(".superseded")
    assert await struck.count() == await first.locator("[data-step]").count() > 1
    marker = await first.locator(".marker").text_content()
    assert marker == "Superseded from step 1 on: the next attempt makes this output again"
    assert await second.locator(".superseded, .marker").count() == 0
    assert await output.locator("section.attempt").count() == 2
    await shot(page, "job-output")
    assert await _holds_at_a_phone_s_width(page)
    # Another tenant's session: as if the job did not exist.
    other = await token(orc.stores.tokens, "globex", Scope.READ, tenants=["globex"])
    with ui_session(server, other) as (client, _):
        assert client.get(f"/ui/live/jobs/{job_id}/output").status_code == 404
    await page.context.close()
