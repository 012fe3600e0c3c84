"""The string rule (orchestrator.domain.storable), generatively: it refuses exactly the text
PostgreSQL cannot store (a NUL anywhere, a lone UTF-16 surrogate); and a real ``orchestrator
serve`` refuses such text in every string field of every request body and every query and path
parameter of its OpenAPI document (read from the live server, so a field added tomorrow is
covered tomorrow), and in every query parameter and form field of the dashboard: 422 for a body,
400 for a URL, naming the field; never a 500. The Python API's submit says the same, with its
SubmitError, and its operator calls with InvalidArgument. (A header cannot carry a NUL: HTTP refuses it before the server sees it.)"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
import subprocess
import sys
import typing
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import httpx
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.types.json import Jsonb

from orchestrator import Orchestrator
from orchestrator.app import JobSpec
from orchestrator.domain.errors import InvalidArgument, SubmitError
from orchestrator.domain.storable import refusal
from orchestrator.interfaces.ui import pages
from tests.support import api_app, scripted
from tests.support.api_server import ApiServer, page_csrf, ui_session
from tests.support.harness import ROOT, settings_for_tests

#: Every character, surrogates included, and more often the ones the rule is about.
anything = st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=())
unstorable = st.sampled_from(["\x00", "\ud800", "\udbff", "\udc00", "\udfff"]) | st.characters(
    min_codepoint=0xD800, max_codepoint=0xDFFF, exclude_categories=()
)
texts = st.text(unstorable | anything, max_size=20)
#: Text the rule must refuse: some text, then a NUL or a lone surrogate, then some more.
refused = st.builds(lambda a, b, c: a + b + c, st.text(anything, max_size=4), unstorable,
                    st.text(anything, max_size=4)).filter(lambda t: refusal(t) is not None)  # fmt: skip
#: The same, as a URL can carry it (a URL's percent-escapes are UTF-8: no lone surrogate).
refused_in_urls = st.builds(lambda a, b: a + "\x00" + b, st.text(max_size=4), st.text(max_size=4))
#: Where a JSON value (a payload, say) holds the text: a string, a key, an item.
json_holding = st.sampled_from([lambda t: t, lambda t: {"k": t}, lambda t: {t: 1}, lambda t: [t]])
examples = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
#: For each field or parameter, every one of them tried: a few texts each.
each = settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- the rule is PostgreSQL's ----------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(texts)
def test_the_rule_refuses_exactly_what_postgresql_cannot_store(dsn: str, text: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            stored = conn.execute("SELECT %s::text, %s::jsonb", (text, Jsonb({text: [text]})))
            assert stored.fetchone() == (text, {text: [text]})
            storable = True
        except (psycopg.DataError, UnicodeEncodeError):  # NUL: PostgreSQL; surrogate: UTF-8
            storable = False
    assert (refusal(text) is None) == storable, repr(text)


# -- the Python API --------------------------------------------------------------------------

SPEC_TEXT = sorted(
    name for name, field in JobSpec.model_fields.items() if "str" in str(field.annotation)
)


@pytest.fixture(scope="module")
def submitting(dsn: str) -> Iterator[tuple[asyncio.Runner, Orchestrator]]:
    orc = Orchestrator(settings=settings_for_tests(), dsn=dsn, retry_config_path=api_app.CONFIG)
    scripted.register(orc)
    with asyncio.Runner() as runner:
        runner.run(orc.open())
        yield runner, orc
        runner.run(orc.close())


@examples
@given(field=st.sampled_from(SPEC_TEXT), bad=refused)
def test_the_python_api_refuses_such_text_naming_the_option(
    submitting: tuple[asyncio.Runner, Orchestrator], field: str, bad: str
) -> None:
    runner, orc = submitting
    options: dict[str, Any] = {"job_type": "scripted", "payload": {"script": ["ok"]}, field: bad}
    with pytest.raises(SubmitError, match=rf"\b{field}: "):
        runner.run(orc.submit(**options))


@examples
@given(bad=refused, holding=json_holding)
def test_a_payload_holding_such_text_is_refused_naming_where(
    submitting: tuple[asyncio.Runner, Orchestrator], bad: str, holding: Any
) -> None:
    runner, orc = submitting
    with pytest.raises(SubmitError, match=r"payload"):
        runner.run(orc.submit("external_echo", holding(bad)))


def text_arguments() -> list[tuple[str, str]]:
    """Every text argument of the Orchestrator's public calls that act on or read stored rows
    (ids aside: an id that is no UUID is refused as such), read from their signatures, so a
    call added tomorrow is tried tomorrow."""
    found = []
    for name, call in inspect.getmembers(Orchestrator, inspect.iscoroutinefunction):
        if name.startswith("_") or name in NOT_OPERATOR_CALLS:
            continue
        for argument, hint in typing.get_type_hints(call).items():
            if argument != "return" and "str" in str(hint) and "UUID" not in str(hint):
                found.append((name, argument))
    return found


#: Calls whose text is checked elsewhere (a submit's options: JobSpec, above) or that run the
#: orchestrator rather than act on rows (their text is configuration).
NOT_OPERATOR_CALLS = {"submit", "submit_many", "submit_specs", "run_worker", "run_exporter",
                      "wait_for_database"}  # fmt: skip


def test_the_operator_calls_take_text() -> None:
    assert {"cancel", "request_discard", "approve", "reject", "list_jobs"} <= {
        call for call, _ in text_arguments()
    }


@pytest.mark.parametrize(("name", "argument"), text_arguments())
@each
@given(bad=refused)
def test_the_python_api_s_operator_calls_refuse_such_text_naming_the_argument(
    submitting: tuple[asyncio.Runner, Orchestrator], name: str, argument: str, bad: str
) -> None:
    runner, orc = submitting
    call = getattr(orc, name)
    arguments: dict[str, Any] = {}
    for parameter in inspect.signature(call).parameters.values():
        if parameter.name == argument:
            arguments[argument] = bad
        elif parameter.default is inspect.Parameter.empty:  # an id, or the other text
            hint = str(typing.get_type_hints(getattr(Orchestrator, name))[parameter.name])
            arguments[parameter.name] = uuid.uuid4() if "UUID" in hint else "ok"
    with pytest.raises(InvalidArgument, match=rf"^{argument}: "):
        runner.run(call(**arguments))


# -- the HTTP API, every field of its OpenAPI document ----------------------------------------


@pytest.fixture(scope="module")
def live(dsn: str) -> Iterator[tuple[ApiServer, httpx.Client, dict[str, Any]]]:
    with ApiServer(dsn) as server:
        created = subprocess.run(
            [sys.executable, "-m", "orchestrator", "tokens", "create", "strings", "--scope",
             "admin"],
            cwd=ROOT, env={**os.environ, "DATABASE_URL": dsn}, capture_output=True, text=True,
            check=True,
        )  # fmt: skip
        headers = {"Authorization": f"Bearer {created.stdout.strip()}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=10) as client:
            document = client.get("/api/v1/openapi.json").json()
            yield server, client, document
        assert "psycopg" not in server.output(), server.output()[-3000:]


def _resolve(document: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _alternatives(document: dict[str, Any], schema: dict[str, Any]) -> list[dict[str, Any]]:
    schema = _resolve(document, schema)
    inner = schema.get("anyOf") or schema.get("oneOf") or schema.get("allOf")
    if inner:
        return [a for s in inner for a in _alternatives(document, s)]
    return [schema]


def _takes_text(document: dict[str, Any], schema: dict[str, Any]) -> bool:
    return any(a.get("type") in ("string", None) for a in _alternatives(document, schema))


def string_fields(
    document: dict[str, Any], schema: dict[str, Any], path: tuple[Any, ...] = ()
) -> Iterator[tuple[tuple[Any, ...], bool]]:
    """Every place of a body that takes text: (its path, whether it is any JSON)."""
    for alternative in _alternatives(document, schema):
        kind = alternative.get("type")
        if kind is None and "properties" not in alternative and "const" not in alternative:
            yield path, True  # any JSON: a payload, an output
        elif kind == "string":
            yield path, False
        elif kind == "array":
            yield from string_fields(document, alternative["items"], (*path, 0))
        elif kind == "object" or "properties" in alternative:
            for name, inner in alternative.get("properties", {}).items():
                yield from string_fields(document, inner, (*path, name))


#: Values a minimal body needs beyond what its schema says (a job type the server knows).
KNOWN = {"job_type": "external_echo"}


def minimal(document: dict[str, Any], schema: dict[str, Any], name: str = "") -> Any:
    """A body its schema takes, with only its required fields."""
    if name in KNOWN:
        return KNOWN[name]
    choices = [a for a in _alternatives(document, schema) if a.get("type") != "null"]
    s = choices[0] if choices else {}
    if "const" in s or "enum" in s:
        return s.get("const", (s.get("enum") or [None])[0])
    kind = s.get("type")
    if kind == "string":
        if s.get("format") == "uuid":
            return str(uuid.uuid4())
        if s.get("format") == "date-time":
            return datetime.now(UTC).isoformat()
        return "x" * max(1, s.get("minLength", 1))
    if kind in ("integer", "number"):
        return s.get("minimum", 1)
    if kind == "boolean":
        return False
    if kind == "array":
        return [minimal(document, s["items"])] * max(1, s.get("minItems", 1))
    if kind == "object" or "properties" in s:
        return {
            key: minimal(document, inner, key)
            for key, inner in s.get("properties", {}).items()
            if key in s.get("required", ())
        }
    return None


def with_value(body: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(head, int):
        items = list(body) if isinstance(body, list) and body else [None]
        items[0] = with_value(items[0], rest, value)
        return items
    return {**(body or {}), head: with_value((body or {}).get(head), rest, value)}


def operations(document: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            yield method.upper(), path, operation


def url_cases(document: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(method, path, where, name) of every query and path parameter that takes text."""
    return [
        (method, path, p["in"], p["name"])
        for method, path, operation in operations(document)
        for p in operation.get("parameters", [])
        if p["in"] in ("query", "path") and _takes_text(document, p.get("schema", {}))
    ]


def body_cases(document: dict[str, Any]) -> list[tuple[str, str, tuple[Any, ...], bool]]:
    """(method, path, field, any JSON) of every body field that takes text."""
    cases = []
    for method, path, operation in operations(document):
        content = operation.get("requestBody", {}).get("content", {})
        if "application/json" in content:
            schema = content["application/json"]["schema"]
            cases += [(method, path, f, j) for f, j in string_fields(document, schema)]
    return cases


def filled(path: str, **given: str) -> str:
    """The path with ``given`` (percent-encoded) in its parameters, an id in any other."""
    return re.sub(
        r"\{(\w+)\}", lambda m: quote(given.get(m.group(1), str(uuid.uuid4())), safe=""), path
    )


def test_the_document_s_fields_are_all_found(
    live: tuple[ApiServer, httpx.Client, dict[str, Any]],
) -> None:
    """The walk below sees the fields the issue named, so it sees the document."""
    _, _, document = live
    urls = {(path, name) for _, path, _, name in url_cases(document)}
    assert {("/api/v1/jobs", "tenant_id"), ("/api/v1/jobs", "job_key"),
            ("/api/v1/dead-letters", "tenant_id"), ("/api/v1/jobs/{job_id}", "job_id")} <= urls  # fmt: skip
    bodies = {(path, field) for _, path, field, _ in body_cases(document)}
    assert {("/api/v1/jobs", ("tenant_id",)), ("/api/v1/jobs/batch", ("jobs", 0, "queue")),
            ("/api/v1/jobs", ("payload",)),
            ("/api/v1/internal/task-complete", ("error", "stack"))} <= bodies  # fmt: skip


def test_every_parameter_refuses_such_text_with_a_400_naming_it(
    live: tuple[ApiServer, httpx.Client, dict[str, Any]],
) -> None:
    _, client, document = live

    @each
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        for method, path, where, name in url_cases(document):
            bad = data.draw(refused_in_urls, label=f"{method} {path} {name}")
            if where == "path":
                answer = fetched(client, method, filled(path, **{name: bad}))
            else:
                answer = fetched(client, method, filled(path), params={name: bad})
            assert_refused(answer, 400, name if where == "query" else "path")

    check()


def test_every_body_field_refuses_such_text_with_a_422_naming_it(
    live: tuple[ApiServer, httpx.Client, dict[str, Any]],
) -> None:
    _, client, document = live

    @each
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        for method, path, field, any_json in body_cases(document):
            operation = document["paths"][path][method.lower()]
            schema = operation["requestBody"]["content"]["application/json"]["schema"]
            bad = data.draw(refused, label=f"{method} {path} {field}")
            value = data.draw(json_holding)(bad) if any_json else bad
            body = with_value(minimal(document, schema), field, value)
            content = json.dumps(body, ensure_ascii=True)  # a lone surrogate as JSON writes it
            answer = client.request(
                method, filled(path), content=content, headers={"content-type": "application/json"}
            )
            if field == ("output",):  # an attempt's result: its INVALID_OUTPUT, under its lease
                assert answer.status_code < 500, answer.text
            else:
                assert_refused(answer, 422, str(field[-1]))

    check()


def fetched(client: httpx.Client, method: str, url: str, **options: Any) -> httpx.Response:
    """The answer, read unless it is an event stream (which would not end)."""
    with client.stream(method, url, **options) as answer:
        if not answer.headers.get("content-type", "").startswith("text/event-stream"):
            answer.read()
    return answer


def assert_refused(answer: httpx.Response, status: int, name: str) -> None:
    assert answer.status_code == status, (answer.request.url, answer.text)
    assert answer.headers["content-type"].startswith("application/problem+json")
    assert name in answer.json()["detail"], answer.text


# -- the dashboard ---------------------------------------------------------------------------


#: The dashboard's pages read these query parameters, and ignore any other (checked as well).
UI_PARAMETERS = ["status", "job_type", "tenant_id", "agent_id", "job_key", "created_after",
                 "created_before", "cursor", "q", "state", "note", "error", "next",
                 "type", "tenant", "failure"]  # fmt: skip
any_name = st.from_regex(r"[a-z_]{1,12}", fullmatch=True)
UI_PAGES = [r.path for r in pages.router.routes if "GET" in getattr(r, "methods", ())]
UI_FORMS = [
    (r.path, [p.name for p in r.dependant.body_params])
    for r in pages.router.routes
    if "POST" in getattr(r, "methods", ()) and r.dependant.body_params
]


def test_every_dashboard_page_and_form_refuses_such_text_naming_the_field(
    live: tuple[ApiServer, httpx.Client, dict[str, Any]],
) -> None:
    server, client, _ = live
    secret = client.headers["authorization"].split(" ", 1)[1]
    assert {"/ui/jobs", "/ui/fragments/jobs", "/ui/dead-letters"} <= set(UI_PAGES)
    assert any(names for path, names in UI_FORMS if path == "/ui/jobs/{job_id}/cancel")
    with ui_session(server, secret) as (browser, session_csrf):
        csrf = {"/ui/login": page_csrf(browser, "/ui/login")}  # before a session: its own

        @each
        @given(data=st.data())
        def check(data: st.DataObject) -> None:
            for page in UI_PAGES:
                name = data.draw(st.sampled_from(UI_PARAMETERS) | any_name, label=page)
                bad = data.draw(refused_in_urls, label=f"{page} {name}")
                answer = fetched(browser, "GET", filled(page), params={name: bad})
                assert_refused(answer, 400, name)
            for path, names in UI_FORMS:
                for name in names:
                    bad = data.draw(refused_in_urls, label=f"{path} {name}")
                    fields = {"csrf": csrf.get(path, session_csrf), "token": "orc_x", name: bad}
                    where = filled(path, action="requeue", decision="approve")
                    assert_refused(browser.post(where, data=fields), 422, name)

        check()
