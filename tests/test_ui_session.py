"""The dashboard's session and CSRF rules at the HTTP level (orchestrator/interfaces/ui/pages.py),
what the mutation run of docs/testing.md found no test for: a form is taken only from this
origin (Sec-Fetch-Site, else Origin), sign-out ends the session for good, the sign-in form keeps
a well-formed login cookie and replaces any other, and a sign-in goes back only to a page of the
dashboard, and its fields' lengths. A real ``orchestrator serve``, driven by httpx as an old or a new browser would."""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterator

import httpx
import pytest

from orchestrator import Orchestrator
from orchestrator.domain.principals import Scope
from tests.support import ui_app
from tests.support.api_server import ApiServer, page_csrf, token, ui_session


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


async def test_a_form_is_taken_only_from_this_origin_and_sign_out_ends_the_session(
    orc: Orchestrator, server: ApiServer
) -> None:
    secret = await token(orc.stores.tokens, "origin", Scope.READ)
    host = server.url.removeprefix("http://")
    with ui_session(server, secret) as (browser, csrf):
        cookie = browser.cookies["orc_session"]
        for foreign in (
            {"Sec-Fetch-Site": "same-site"},  # a sibling subdomain is another site
            {"Sec-Fetch-Site": "cross-site"},
            {"Sec-Fetch-Site": "none"},
            {"Origin": "http://attacker.test"},  # an older browser says where it comes from
            {"Origin": f"http://{host}.attacker.test"},
        ):
            refused = browser.post("/ui/logout", data={"csrf": csrf}, headers=foreign)
            assert refused.status_code == 401, (foreign, refused.text)
            assert "CSRF" in refused.json()["detail"]
        assert browser.get("/ui").status_code == 200  # still signed in
        out = browser.post(
            "/ui/logout", data={"csrf": csrf},
            headers={"Sec-Fetch-Site": "same-origin", "Origin": f"http://{host}"},
        )  # fmt: skip
        assert (out.status_code, out.headers["location"]) == (303, "/ui/login")
        assert "orc_session" not in browser.cookies
    gone = _visit(server, "/ui/jobs", {"orc_session": cookie})  # a cookie naming no session
    assert (gone.status_code, gone.headers["location"]) == (303, "/ui/login?next=%2Fui%2Fjobs")
    with ui_session(server, secret) as (browser, csrf):  # Origin alone, naming this host
        out = browser.post("/ui/logout", data={"csrf": csrf}, headers={"Origin": server.url})
        assert out.status_code == 303


def test_the_sign_in_form_keeps_a_well_formed_login_cookie_and_replaces_any_other(
    server: ApiServer,
) -> None:
    """A second tab's sign-in page must not spoil the first's form (the same cookie, the same
    token), but a cookie that is not one this server made is never echoed into a form."""
    kept = secrets.token_urlsafe(32)
    assert len(kept) == 43
    for cookie, reused in ((kept, True), (kept[:42], False), (kept + "x", False), ("", False)):
        with httpx.Client(base_url=server.url, cookies={"orc_login": cookie}) as browser:
            page = browser.get("/ui/login")
            [given] = re.findall(r'name="csrf" value="([^"]+)"', page.text)
            assert (given == cookie) is reused, cookie
            assert len(given) == 43 and given.isascii()
            assert page.cookies["orc_login"] == given
            attributes = page.headers["set-cookie"].lower().split("; ")
            assert {"httponly", "samesite=strict", "path=/ui/login"} <= set(attributes)


async def test_a_sign_in_goes_back_only_to_a_page_of_the_dashboard(
    orc: Orchestrator, server: ApiServer
) -> None:
    secret = await token(orc.stores.tokens, "next", Scope.READ)
    for asked, sent in (
        ("/ui/jobs?status=FAILED", "/ui/jobs?status=FAILED"),
        ("//attacker.test/ui", "/ui"),
        ("https://attacker.test/ui", "/ui"),
        ("/api/v1/jobs", "/ui"),
    ):
        signed, refused = _sign_in(server, secret, asked), _sign_in(server, "orc_bad", asked)
        assert (signed.status_code, signed.headers["location"]) == (303, sent), asked
        assert refused.status_code == 303
        assert httpx.URL(refused.headers["location"]).params["next"] == sent, asked


def _visit(server: ApiServer, path: str, cookies: dict[str, str]) -> httpx.Response:
    with httpx.Client(base_url=server.url, cookies=cookies) as browser:
        return browser.get(path)


def _sign_in(
    server: ApiServer, secret: str, next: str, fields: dict[str, str] | None = None
) -> httpx.Response:
    """A sign-in from the form's page (``fields``: in place of the form's own)."""
    with httpx.Client(base_url=server.url) as browser:
        csrf = page_csrf(browser, "/ui/login")
        form = {"token": secret, "csrf": csrf, "next": next, **(fields or {})}
        return browser.post("/ui/login", data=form)


async def test_the_sign_in_form_takes_fields_up_to_their_documented_lengths(
    orc: Orchestrator, server: ApiServer
) -> None:
    """The token field takes 200 characters and the page to go back to 2,000 (the form's
    limits): one more is refused, naming the field, before anything is looked up."""
    for fields in ({"token": "orc_" + "x" * 196}, {"next": "/ui/" + "x" * 1996}):
        [(name, longest)] = fields.items()
        taken = _sign_in(server, "orc_bad", "/ui", fields)
        assert taken.status_code == 303, (name, taken.text)  # read, then refused: not a token
        assert "error" in taken.headers["location"]
        refused = _sign_in(server, "orc_bad", "/ui", {name: longest + "x"})
        assert refused.status_code == 422, (name, refused.text)
        assert name in refused.text
