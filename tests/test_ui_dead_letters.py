"""The Dead letters page at scale, in a real Chromium (docs/ui.md): the open letters by default,
a filter by job type, tenant and error, one action on the letters ticked or on all matching the
filter (one confirmation), the two-person rule per letter, a tenant's session acting on none of
another's letters, and a page that holds at 390 px."""

from __future__ import annotations

import re
from typing import Any

import psycopg

from orchestrator import Orchestrator
from orchestrator.domain.principals import Scope
from tests.support.api_server import ApiServer, token
from tests.support.letters import error_of, plant
from tests.test_ui import accept, browser, orc, server, shot, signed_in

__all__ = ["browser", "orc", "server"]  # the dashboard tests' fixtures, shared

BAD = error_of("HTTP_400", "400 Bad Request", "PERMANENT")
SLOW = error_of("TIMEOUT", "the deadline passed", "TRANSIENT_INFRA")
OK = {"script": ["ok"]}


async def shown(page: Any) -> set[str]:
    """The letters the page lists."""
    found: list[str] = await page.locator("li.letter").evaluate_all(
        "cards => cards.map(card => card.dataset.letter)"
    )
    return set(found)


async def said(page: Any, role: str) -> str:
    await page.get_by_role(role).wait_for()
    return str(await page.get_by_role(role).inner_text())


async def test_the_page_filters_and_requeues_the_letters_ticked_or_all_matching(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any], server: ApiServer, browser: Any
) -> None:
    bad = [await plant(orc, db, "a", "scripted", BAD, OK) for _ in range(3)]
    slow = await plant(orc, db, "a", "agent", SLOW, {"service": "http://127.0.0.1:9"})
    theirs = await plant(orc, db, "b", "scripted", BAD, OK)
    secret = await token(orc.stores.tokens, "reviewer", Scope.READ, Scope.OPERATE)
    page = await signed_in(browser, server, secret)
    page.on("dialog", accept)
    await page.goto(f"{server.url}/ui/dead-letters")
    assert await shown(page) == {*bad, slow, theirs}
    await page.get_by_label("Job type").fill("scripted")
    await page.get_by_label("Tenant").fill("a")
    await page.get_by_label("Error").fill("bad request")
    await page.get_by_role("button", name="Filter").click()
    await page.wait_for_url(re.compile(r"type=scripted"))
    assert await shown(page) == set(bad)
    assert await page.get_by_role("alert").count() == 0  # a filter is no refusal

    # the one ticked
    await page.locator(f"li[data-letter='{bad[0]}'] input[type=checkbox]").check()
    await page.locator("#bulk").get_by_role("button", name="Requeue").click()
    assert "requeued: 1 of 1" in await said(page, "status")
    assert (await orc.dead_letter(bad[0])).state == "requeued"
    assert await shown(page) == set(bad[1:])  # the filter kept, the requeued one reviewed

    # all matching the filter, ticked or not
    await page.get_by_label(re.compile("all matching the filter")).check()
    await page.locator("#bulk").get_by_role("button", name="Requeue").click()
    assert "requeued: 2 of 2" in await said(page, "status")
    assert await page.get_by_role("alert").count() == 0
    assert {(await orc.dead_letter(i)).state for i in bad} == {"requeued"}
    assert {(await orc.dead_letter(i)).state for i in (slow, theirs)} == {"recorded"}
    assert (
        "No open dead letters matching the filter." in await page.locator(".letters").inner_text()
    )
    await shot(page, "dead-letters-filtered")
    await page.context.close()


async def test_a_discard_of_the_letters_ticked_takes_a_second_person(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any], server: ApiServer, browser: Any
) -> None:
    letters = [await plant(orc, db, "a", "scripted", BAD, OK) for _ in range(2)]
    alice = await signed_in(
        browser, server, await token(orc.stores.tokens, "alice", Scope.READ, Scope.OPERATE)
    )
    alice.on("dialog", accept)
    await alice.goto(f"{server.url}/ui/dead-letters")
    for letter in letters:
        await alice.locator(f"li[data-letter='{letter}'] input[type=checkbox]").check()
    await alice.locator("#bulk").get_by_label("Reason to discard").fill("orders cancelled")
    await alice.locator("#bulk").get_by_role("button", name="Request discard").click()
    assert "discard requested: 2 of 2" in await said(alice, "status")
    for letter in letters:  # nor can she confirm them herself, ticked or all matching
        await alice.locator(f"li[data-letter='{letter}'] input[type=checkbox]").check()
    await alice.locator("#bulk").get_by_role("button", name="Confirm discard").click()
    refusal = await said(alice, "alert")
    assert "discarded: 0 of 2, 2 refused" in refusal and "a second reviewer" in refusal
    assert {(await orc.dead_letter(i)).state for i in letters} == {"discard_requested"}

    bob = await signed_in(
        browser, server, await token(orc.stores.tokens, "bob", Scope.READ, Scope.OPERATE)
    )
    bob.on("dialog", accept)
    await bob.goto(f"{server.url}/ui/dead-letters?state=discard_requested")
    await bob.get_by_label(re.compile("all matching the filter")).check()
    await bob.locator("#bulk").get_by_role("button", name="Confirm discard").click()
    assert "discarded: 2 of 2" in await said(bob, "status")
    for letter in letters:
        done = await orc.dead_letter(letter)
        assert (done.state, done.discard_requested_by, done.discarded_by) == (
            "discarded", "token:alice", "token:bob",
        )  # fmt: skip
    await alice.context.close()
    await bob.context.close()


async def test_a_tenant_s_session_sees_and_acts_on_none_of_another_s_letters_at_390_px(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any], server: ApiServer, browser: Any
) -> None:
    mine = await plant(orc, db, "a", "scripted", BAD, OK)
    theirs = await plant(orc, db, "b", "scripted", BAD, OK)
    secret = await token(orc.stores.tokens, "of-a", Scope.READ, Scope.OPERATE, tenants=["a"])
    page = await signed_in(browser, server, secret)
    page.on("dialog", accept)
    await page.set_viewport_size({"width": 390, "height": 844})
    await page.goto(f"{server.url}/ui/dead-letters")
    assert await shown(page) == {mine}
    overflow = await page.evaluate(
        "document.documentElement.scrollWidth - document.documentElement.clientWidth"
    )
    assert overflow <= 0, f"the page scrolls sideways by {overflow} px at 390 px"
    await shot(page, "dead-letters-phone")
    await page.goto(f"{server.url}/ui/dead-letters?tenant=b")
    assert await shown(page) == set()
    await page.get_by_label(re.compile("all matching the filter")).check()
    await page.locator("#bulk").get_by_role("button", name="Requeue").click()
    assert "requeued: 0 of 0" in await said(page, "status")
    assert theirs not in await page.content()
    assert (await orc.dead_letter(theirs)).state == "recorded"
    await page.context.close()
