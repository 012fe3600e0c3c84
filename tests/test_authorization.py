"""Authorization as a table: every operation of the live OpenAPI document of a real
``orchestrator serve``, and every dashboard route of the application's route list, against
every kind of credential (none, malformed, unknown, revoked after use, each scope, another
tenant's token, a tenant-limited token of the right tenant, a worker token limited to tenants
written by SQL), each answered as :func:`expected` says.

The expectation is not written per endpoint: the scope an operation needs is the one its route's
dependencies declare (``auth.Allowed``; the dashboard's ``viewer`` and ``acting``), a route that
declares none is expected to need ``admin`` (so a new endpoint that forgets its check is refused
by nothing, and fails here), and the objects it acts on are named by its path parameters. Each
tenant has real objects (a waiting job submitted with an ``Idempotency-Key``, a job with steps
waiting for an approval, dead letters, a running and a due external job), so another tenant's
token meets real ids, and must get 404 (existence is not revealed).

Every refused request is checked for its status, its problem ``code``, an answer that names
nothing of the other tenant, and that nothing changed: the jobs, events, dead letters,
approvals, steps, tokens, sessions and dispatches are read back after each. The allowed requests
run after every refusal (on the token's own tenant), and must get past every check.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID, uuid4

import httpx
import psycopg
import pytest
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute, iter_route_contexts

from orchestrator import Orchestrator, Status
from orchestrator.domain.principals import Scope, new_token
from orchestrator.interfaces.api.auth import Allowed
from orchestrator.interfaces.server import create_app
from orchestrator.interfaces.ui import pages
from tests.support import agent_app, api_app, log_guard, scripted
from tests.support.api_server import ApiServer, page_csrf, token
from tests.support.harness import ROOT, WorkerRun, settings_for_tests, wait_for

#: The module's objects include dead letters: jobs failed on purpose, logged at ERROR.
pytestmark = log_guard.fails_jobs("HTTP_400")

MINE, THEIRS = "tenant-a", "tenant-b"
#: The Idempotency-Key both tenants submit with: one tenant's must never answer the other's job.
KEY = "authz-shared-key"
FAR = "2099-01-01T00:00:00Z"

# -- the table's rule (pure) ---------------------------------------------------------------------

#: What a path parameter names, by its name; an unknown name fails the table (give it objects).
OBJECTS = {"job_id": "job", "dead_letter_id": "dead letter", "letter_id": "dead letter",
           "approval_id": "approval", "schedule_name": "schedule", "key": "flow key"}  # fmt: skip
NOT_FOUND = {"job": "JOB_NOT_FOUND", "dead letter": "DEAD_LETTER_NOT_FOUND",
             "approval": "APPROVAL_NOT_FOUND", "schedule": "SCHEDULE_NOT_FOUND",
             "flow key": "FLOW_KEY_NOT_FOUND"}  # fmt: skip
#: Shared by the whole fleet: refused to a token limited to tenants (docs/flow-control.md).
FLEET = ("/api/v1/flow/", "/ui/flow/")
#: The dashboard's forms naming their action in the path take the API's verbs (from its document).
VERBS = {"action": "/api/v1/dead-letters/{dead_letter_id}/",
         "decision": "/api/v1/approvals/{approval_id}/",
         "steer": "/api/v1/schedules/{schedule_name}/"}  # fmt: skip
#: The dashboard's sign-in, the one part of it open to anyone.
SIGN_IN = {("GET", "/ui/login"), ("POST", "/ui/login")}
STRENGTH = [Scope.READ, Scope.SUBMIT, Scope.OPERATE, Scope.WORKER, Scope.ADMIN]


@dataclass(frozen=True)
class Credential:
    """What a request carries. ``scopes`` empty: no live token (none, malformed, unknown,
    revoked)."""

    name: str
    scopes: frozenset[Scope] = frozenset()
    tenants: frozenset[str] | None = None

    def allows(self, scope: Scope) -> bool:
        return Scope.ADMIN in self.scopes or scope in self.scopes

    def sees(self, tenant: str) -> bool:
        return self.tenants is None or tenant in self.tenants


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    #: The scope its route's dependencies declare (None: none).
    scope: Scope | None
    #: What its path parameters name: object kinds (``OBJECTS``) or verbs (``VERBS``).
    parameters: tuple[tuple[str, str], ...]
    #: Its body names a tenant (a submit).
    takes_tenant: bool
    ui: bool

    def __str__(self) -> str:
        return f"{self.method} {self.path}"

    @property
    def objects(self) -> list[str]:
        return [kind for _, kind in self.parameters if kind in NOT_FOUND]


@dataclass(frozen=True)
class Refused:
    status: int
    code: str  # the problem's code; "sign in" for the dashboard's redirect to its sign-in


SIGN_IN_FIRST = Refused(303, "sign in")


def expected(op: Operation, credential: Credential, tenant: str) -> Refused | None:
    """How ``op`` on ``tenant``'s objects (or submitting into it) answers ``credential``: the
    refusal, or None when it is allowed. A route declaring no scope needs ``admin``."""
    if op.ui and not credential.allows(Scope.READ):  # no token without read can sign in
        return SIGN_IN_FIRST
    if not credential.scopes:
        return Refused(401, "UNAUTHORIZED")
    needed = op.scope or Scope.ADMIN
    if not credential.allows(needed):
        return Refused(403, "FORBIDDEN")
    if needed is Scope.WORKER and credential.tenants is not None:
        return Refused(403, "FORBIDDEN")  # a worker runs every tenant's jobs
    if op.path.startswith(FLEET) and credential.tenants is not None:
        return Refused(403, "FORBIDDEN")  # a key's counts and pause cover every tenant
    if op.objects and not credential.sees(tenant):
        return Refused(404, NOT_FOUND[op.objects[0]])
    if op.takes_tenant and not credential.sees(tenant):
        return Refused(403, "FORBIDDEN")
    return None


def declared_scope(dependant: Dependant) -> Scope | None:
    """The strongest scope a route's dependencies (and theirs) require."""
    found = set()
    for dependency in [dependant, *_below(dependant)]:
        if isinstance(dependency.call, Allowed):
            found.add(dependency.call.scope)
        elif dependency.call is pages.viewer:
            found.add(Scope.READ)
        elif dependency.call is pages.acting:
            found.add(Scope.OPERATE)
    return max(found, key=STRENGTH.index) if found else None


def _below(dependant: Dependant) -> Iterator[Dependant]:
    for dependency in dependant.dependencies:
        yield dependency
        yield from _below(dependency)


def operations() -> list[Operation]:
    """Every operation of the API's document and every dashboard route but the sign-in, from
    the application's own routes (the live document is compared with it below)."""
    app = create_app(api_app.orc)
    routes = {  # as the document names their paths (``{key:path}``: ``{key}``)
        (method, re.sub(r"\{(\w+):\w+\}", r"{\1}", str(context.path))): context.original_route
        for context in iter_route_contexts(app.routes)
        if isinstance(context.original_route, APIRoute)
        for method in context.methods or ()
    }
    found = []
    for path, methods in app.openapi()["paths"].items():
        for method, spec in methods.items():
            route = routes[(method.upper(), path)]
            body = _ref_name(spec)
            found.append(
                Operation(
                    method.upper(), path, declared_scope(route.dependant),
                    tuple((p.name, _names(p.name)) for p in route.dependant.path_params),
                    takes_tenant=body in ("JobSpec", "SubmitBatch"), ui=False,
                )
            )  # fmt: skip
    for (method, path), route in sorted(routes.items()):
        if path.startswith("/ui") and (method, path) not in SIGN_IN:
            found.append(
                Operation(
                    method, path, declared_scope(route.dependant),
                    tuple((p.name, _names(p.name)) for p in route.dependant.path_params),
                    takes_tenant=False, ui=True,
                )
            )  # fmt: skip
    return found


def _names(parameter: str) -> str:
    if parameter in OBJECTS:
        return OBJECTS[parameter]
    if parameter in VERBS:
        return parameter
    raise AssertionError(f"path parameter {parameter!r} names nothing the table creates: add it")


def _ref_name(spec: Mapping[str, Any]) -> str | None:
    schema = spec.get("requestBody", {}).get("content", {}).get("application/json", {})
    ref = schema.get("schema", {}).get("$ref")
    return ref.rsplit("/", 1)[-1] if ref else None


OPERATIONS = operations()


def test_the_rule_refuses_what_each_credential_lacks_and_allows_the_rest() -> None:
    job = Operation("POST", "/j/{job_id}/cancel", Scope.OPERATE, (("job_id", "job"),), False, False)
    bare = Operation("GET", "/new", None, (), False, False)
    claim = Operation("POST", "/claim", Scope.WORKER, (), False, False)
    submit = Operation("POST", "/jobs", Scope.SUBMIT, (), True, False)
    page = Operation("GET", "/ui/jobs/{job_id}", Scope.READ, (("job_id", "job"),), False, True)
    admin = Credential("admin", frozenset({Scope.ADMIN}))
    limited = Credential("a", frozenset({Scope.ADMIN}), frozenset({MINE}))
    reader = Credential("r", frozenset({Scope.READ}))
    nobody = Credential("none")
    assert expected(job, nobody, MINE) == Refused(401, "UNAUTHORIZED")
    assert expected(job, reader, MINE) == Refused(403, "FORBIDDEN")
    assert expected(job, admin, THEIRS) is None
    assert expected(job, limited, THEIRS) == Refused(404, "JOB_NOT_FOUND")
    assert expected(job, limited, MINE) is None
    assert expected(bare, reader, MINE) == Refused(403, "FORBIDDEN")  # undeclared: admin's
    assert expected(bare, admin, MINE) is None
    assert expected(claim, limited, MINE) == Refused(403, "FORBIDDEN")
    assert expected(claim, Credential("w", frozenset({Scope.WORKER})), MINE) is None
    assert expected(submit, limited, THEIRS) == Refused(403, "FORBIDDEN")
    assert expected(submit, limited, MINE) is None
    assert expected(page, nobody, MINE) == SIGN_IN_FIRST
    assert expected(page, Credential("s", frozenset({Scope.SUBMIT})), MINE) == SIGN_IN_FIRST
    assert expected(page, limited, THEIRS) == Refused(404, "JOB_NOT_FOUND")
    key = Operation("GET", "/api/v1/flow/keys", Scope.READ, (), False, False)
    assert expected(key, limited, MINE) == Refused(403, "FORBIDDEN")
    assert expected(key, reader, MINE) is None
    # every operation refuses someone and allows someone
    for op in OPERATIONS:
        answers = {expected(op, c, MINE) for c in (nobody, reader, admin, limited)}
        assert None in answers and len(answers) > 1, op


# -- the world: a server, tokens, sessions and each tenant's objects -------------------------------

#: Read back after each refused request: none of them may change.
STATE = ("orc_jobs", "orc_job_events", "orc_dead_letters", "orc_approvals", "orc_checkpoints",
         "orc_side_effects", "orc_api_tokens", "orc_ui_sessions", "procrastinate_jobs",
         "orc_schedules", "orc_flow_keys", "orc_flow_spends", "orc_flow_spent_calls",
         "orc_flow_waiters", "orc_llm_usage")  # fmt: skip
SNAPSHOT = " UNION ALL ".join(
    f"SELECT '{table}', md5(coalesce(string_agg(t::text, '|' ORDER BY t::text), '')) "
    f"FROM {table} AS t"
    for table in STATE
)


@dataclass
class Caller:
    credential: Credential
    headers: dict[str, str]
    cookie: str | None = None  # the dashboard session's
    csrf: str | None = None


@dataclass
class World:
    server: ApiServer
    db: psycopg.Connection[Any]
    orc: Orchestrator
    callers: list[Caller]
    #: tenant -> kind -> its objects' ids
    objects: dict[str, dict[str, list[Any]]]
    #: tenant -> the running external job's lease
    leases: dict[str, dict[str, Any]]
    verbs: dict[str, list[str]]
    #: tenant -> text naming its data (ids, tenant): never in an answer to another tenant
    markers: dict[str, set[str]] = field(default_factory=dict)

    def state(self) -> dict[str, str]:
        return dict(self.db.execute(SNAPSHOT).fetchall())


def documented_revocation_seconds() -> float:
    """How soon docs/api.md says a revoked token is refused."""
    found = re.search(r"refused within (\d+(?:\.\d+)?) s", (ROOT / "docs" / "api.md").read_text())
    assert found, "docs/api.md no longer says how soon a revoked token is refused"
    return float(found.group(1))


def bearer(secret: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"} if secret else {}


def signed_in(server: ApiServer, secret: str) -> tuple[str, str]:
    """A dashboard session of this token: its cookie and its forms' CSRF token."""
    with httpx.Client(base_url=server.url, timeout=10) as browser:
        signed = browser.post(
            "/ui/login", data={"token": secret, "csrf": page_csrf(browser, "/ui/login")}
        )
        assert signed.status_code == 303 and "error" not in signed.headers["location"]
        return browser.cookies["orc_session"], page_csrf(browser, "/ui")


@pytest.fixture(scope="module")
async def world(dsn: str) -> AsyncIterator[World]:
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute(
            "TRUNCATE orc_job_events, orc_dead_letters, orc_jobs, procrastinate_events, "
            "procrastinate_periodic_defers, procrastinate_jobs, procrastinate_workers, "
            "orc_api_tokens, orc_event_listeners, orc_flow_keys RESTART IDENTITY CASCADE"
        )
        orc = Orchestrator(settings=settings_for_tests(), dsn=dsn, retry_config_path=api_app.CONFIG)
        scripted.register(orc)
        agent_app.register(orc)
        await orc.open()
        with ApiServer(
            dsn, ORCHESTRATOR_API_REPLAY_ENDPOINTS="true", ORCHESTRATOR_API_WAIT_MAX_SECONDS="0.2"
        ) as server:
            try:
                yield await _world(orc, server, db)
            finally:
                await orc.close()


async def _world(orc: Orchestrator, server: ApiServer, db: psycopg.Connection[Any]) -> World:
    tokens = orc.stores.tokens
    # revoked after use: used (so the server has checked it), revoked, refused soon after
    revoked_secret = await token(tokens, "authz-revoked", Scope.ADMIN)
    revoked_session = signed_in(server, revoked_secret)
    http = httpx.AsyncClient(base_url=server.url, timeout=30)
    used = await http.get("/api/v1/jobs", headers=bearer(revoked_secret))
    assert used.status_code == 200
    await tokens.revoke("authz-revoked")
    revoked_at = time.monotonic()

    setup = await token(tokens, "authz-setup", Scope.ADMIN)
    own = {t: await token(tokens, f"authz-{t}", Scope.ADMIN, tenants=[t]) for t in (MINE, THEIRS)}
    objects: dict[str, dict[str, list[Any]]] = {}
    for tenant in (MINE, THEIRS):
        submitted = await http.post(
            "/api/v1/jobs",
            headers={**bearer(own[tenant]), "Idempotency-Key": KEY},
            json={"job_type": "scripted", "payload": {"script": ["ok"]}, "run_at": FAR,
                  "queue": f"queue-of-{tenant}"},  # named in the queues' counts
        )  # fmt: skip
        assert submitted.status_code == 201, submitted.text
        plan = {"service": "http://127.0.0.1:9", "steps": 3, "send_at": [], "approval_at": 2}
        objects[tenant] = {
            "job": [
                UUID(submitted.json()["job_id"]),
                await orc.submit("agent", plan, tenant_id=tenant),
                *[
                    await orc.submit("scripted", {"script": ["permanent"]}, tenant_id=tenant)
                    for _ in range(2)
                ],
                await orc.submit("external_echo", {"output": 1}, tenant_id=tenant),
            ]
        }
    async with WorkerRun(orc):

        async def settled() -> bool:
            jobs = [await orc.get_job(j) for t in (MINE, THEIRS) for j in objects[t]["job"][1:4]]
            return all(j.status in (Status.WAITING_APPROVAL, Status.FAILED) for j in jobs)

        await wait_for(settled)
    leases = {}
    claim = {"job_types": ["external_echo"], "worker": "authz", "limit": 10}
    answer = await http.post("/api/v1/internal/task-claim", headers=bearer(setup), json=claim)
    claimed = answer.json()["tasks"]
    for tenant in (MINE, THEIRS):
        [task] = [t for t in claimed if UUID(t["job_id"]) == objects[tenant]["job"][4]]
        leases[tenant] = {k: task[k] for k in ("job_id", "attempt", "lease_token")}
        objects[tenant]["job"].append(
            await orc.submit("external_echo", {"output": 2}, tenant_id=tenant)  # due, unclaimed
        )
        letters = await orc.dead_letters(tenants=[tenant])
        assert len(letters) == 2
        await orc.request_discard(letters[0].id, by="someone (cli:authz)", reason="the table")
        objects[tenant]["dead letter"] = [letter.id for letter in letters]
        approvals = await orc.approvals(tenants=[tenant])
        objects[tenant]["approval"] = [UUID(str(a["id"])) for a in approvals]
        objects[tenant]["schedule"] = [api_app.SCHEDULES[tenant]]  # stored by the server
        # a flow key its jobs use (keys are fleet-wide: only an unlimited token sees them)
        db.execute(
            "INSERT INTO orc_flow_keys (key, limit_name, task_prefix) VALUES (%s, 'l', 'orc.')",
            (f"authz-key-{tenant}",),
        )
        objects[tenant]["flow key"] = [f"authz-key-{tenant}"]
        assert len(approvals) == 1 and await orc.job_steps(objects[tenant]["job"][1])
        # An LLM call of the tenant's job, as a worker records it: GET /api/v1/usage sums it
        # for its own tenant only (its model names the tenant, a marker of its answers too).
        db.execute(
            "INSERT INTO orc_llm_usage (job_id, call_id, attempt, tenant_id, job_type, model,"
            " input_tokens, output_tokens, cache_read_tokens, cache_creation_tokens)"
            " VALUES (%s, 'authz', 1, %s, 'agent', %s, 10, 5, 1, 2)",
            (objects[tenant]["job"][1], tenant, f"model-of-{tenant}"),
        )

    # a worker token limited to a tenant, as a database written before the CLI refused it has
    limited_worker = new_token()
    db.execute(
        "INSERT INTO orc_api_tokens (id, name, secret_sha256, scopes, tenants, created_by) "
        "VALUES (%s, 'authz-old-worker', %s, ARRAY['worker'], ARRAY[%s], 'an older release')",
        (limited_worker.id, limited_worker.secret_sha256, MINE),
    )
    callers = [
        Caller(Credential("none"), {}),
        Caller(Credential("malformed"), bearer("orc_not-a-token"), cookie="not a session"),
        Caller(
            Credential("unknown"),
            bearer(f"orc_{uuid4().hex}_{'x' * 43}"),
            cookie=secrets.token_urlsafe(32),
        ),
        Caller(Credential("revoked"), bearer(revoked_secret), *revoked_session),
        Caller(
            Credential("tenant-worker", frozenset({Scope.WORKER}), frozenset({MINE})),
            bearer(limited_worker.token),
        ),
    ]
    for scope in Scope:
        secret = await token(tokens, f"authz-{scope.value}", scope)
        session = signed_in(server, secret) if scope in (Scope.READ, Scope.ADMIN) else (None, None)
        callers.append(
            Caller(Credential(scope.value, frozenset({scope})), bearer(secret), *session)
        )
    # another tenant's token on THEIRS' objects, the right tenant's on MINE
    mine = Credential(MINE, frozenset({Scope.ADMIN}), frozenset({MINE}))
    callers.append(Caller(mine, bearer(own[MINE]), *signed_in(server, own[MINE])))

    document = (await http.get("/api/v1/openapi.json")).json()
    await http.aclose()
    verbs = {
        name: sorted(p.removeprefix(prefix) for p in document["paths"] if p.startswith(prefix))
        for name, prefix in VERBS.items()
    }
    await refused_within(server, revoked_secret, documented_revocation_seconds(), revoked_at)
    world = World(server, db, orc, callers, objects, leases, verbs)
    for tenant in (MINE, THEIRS):
        world.markers[tenant] = {tenant, *(str(i) for ids in objects[tenant].values() for i in ids)}
    return world


async def refused_within(server: ApiServer, secret: str, seconds: float, since: float) -> bool:
    """Whether the server refuses this token within ``seconds`` of ``since`` (a revocation)."""
    async with httpx.AsyncClient(base_url=server.url, headers=bearer(secret)) as client:
        while (await client.get("/api/v1/jobs")).status_code != 401:
            if time.monotonic() > since + seconds:
                return False
            await asyncio.sleep(0.05)
    return True


async def test_a_revoked_token_used_a_moment_ago_is_refused_within_the_documented_window(
    world: World,
) -> None:
    """The server caches a token's check (docs/api.md, "Auth"): a token it has just let in,
    revoked, is refused within the window the documentation gives, by the API and by the
    dashboard session it signed in."""
    tokens = world.orc.stores.tokens
    secret = await token(tokens, "authz-revoked-now", Scope.READ)
    cookie, _ = signed_in(world.server, secret)
    async with httpx.AsyncClient(base_url=world.server.url, headers=bearer(secret)) as client:
        assert (await client.get("/api/v1/jobs")).status_code == 200  # checked, and cached
    await tokens.revoke("authz-revoked-now")
    window = documented_revocation_seconds()
    assert await refused_within(world.server, secret, window, time.monotonic())
    # A client of its own: one kept from before the wait may hold a connection the server has
    # closed meanwhile (both sides' keep-alive lasts 5 s), and fail on it.
    async with httpx.AsyncClient(base_url=world.server.url) as client:
        page = await client.get("/ui", headers={"Cookie": f"{pages.COOKIE}={cookie}"})
    assert page.status_code == 303 and page.headers["location"].startswith("/ui/login")


# -- requests ---------------------------------------------------------------------------------


@dataclass
class Request:
    method: str
    url: str
    headers: dict[str, str]
    json: Any = None
    data: dict[str, str] | None = None

    def __str__(self) -> str:
        return f"{self.method} {self.url}"


@dataclass
class Answer:
    status: int
    headers: httpx.Headers
    text: str


def requests(op: Operation, world: World, caller: Caller, tenant: str) -> Iterator[Request]:
    """``op`` on every object of ``tenant`` its path can name, with a body that would act."""
    values = [
        [str(i) for i in world.objects[tenant][kind]] if kind in NOT_FOUND else world.verbs[kind]
        for _, kind in op.parameters
    ]
    spec: Mapping[str, Any] = {} if op.ui else DOCUMENT["paths"][op.path][op.method.lower()]
    headers = dict(caller.headers)
    if op.ui and caller.cookie:
        headers["Cookie"] = f"{pages.COOKIE}={caller.cookie}"
    for parameter in spec.get("parameters", []):
        if parameter["in"] == "header" and parameter["name"].lower() == "idempotency-key":
            headers["Idempotency-Key"] = KEY
    for chosen in itertools.product(*values):
        url = op.path
        for (name, _), value in zip(op.parameters, chosen, strict=True):
            url = url.replace(f"{{{name}}}", value)
        if op.ui:
            form = {"csrf": caller.csrf or "", "reason": "the authorization table",
                    # the Flow page's Resume names its key in the form, not in its address
                    "key": str(world.objects[tenant]["flow key"][0])}  # fmt: skip
            yield Request(op.method, url, headers, data=form if op.method == "POST" else None)
            continue
        body = spec.get("requestBody", {}).get("content", {}).get("application/json")
        payload = example(body["schema"], _hints(world, tenant)) if body else None
        yield Request(op.method, url, headers, json=payload)


def _hints(world: World, tenant: str) -> dict[str, Any]:
    """Values by field name, so that a body acts on ``tenant``'s objects."""
    return {
        "job_type": "scripted", "payload": {"script": ["ok"]}, "run_at": FAR,
        "tenant_id": tenant, "job_types": ["external_echo"], "worker": "authz",
        "reason": "the authorization table", **world.leases[tenant],
    }  # fmt: skip


def example(schema: Mapping[str, Any], hints: Mapping[str, Any]) -> Any:
    """A value of ``schema`` (the API's document), its fields from ``hints`` where named."""
    if "$ref" in schema:
        return example(DOCUMENT["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]], hints)
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return example(next(s for s in schema[key] if s.get("type") != "null"), hints)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    match schema.get("type"):
        case "object":
            properties = schema.get("properties", {})
            wanted = set(schema.get("required", [])) | (set(properties) & set(hints))
            return {n: hints[n] if n in hints else example(properties[n], hints) for n in wanted}
        case "array":
            return [example(schema.get("items", {}), hints)] * max(1, schema.get("minItems", 1))
        case "string":
            return "authz"
        case "integer" | "number":
            return schema.get("minimum", 1)
        case "boolean":
            return False
    return {}


DOCUMENT = create_app(api_app.orc).openapi()


def send(client: httpx.Client, request: Request) -> Answer:
    with client.stream(
        request.method, request.url, headers=request.headers, json=request.json, data=request.data
    ) as response:  # a stream that was let through is not read
        streaming = response.headers.get("content-type", "").startswith("text/event-stream")
        text = "" if streaming else response.read().decode(errors="replace")
        return Answer(response.status_code, response.headers, text)


def leaks(world: World, caller: Caller, request: Request, answer: Answer) -> set[str]:
    """What the answer names of a tenant the caller may not see (but what the request did)."""
    hidden = {
        marker
        for tenant, markers in world.markers.items()
        if not caller.credential.sees(tenant)
        for marker in markers
    }
    sent = f"{request.url} {json.dumps(request.json)}"
    return {m for m in hidden if m in answer.text and m not in sent}


def refused_as(op: Operation, refusal: Refused, answer: Answer) -> bool:
    if refusal == SIGN_IN_FIRST:
        return answer.status == 303 and answer.headers["location"].startswith("/ui/login")
    if op.ui and refusal.status == 404 and "text/html" in answer.headers.get("content-type", ""):
        return answer.status == 404 and "<h1>Not found</h1>" in answer.text  # a page's
    if answer.status != refusal.status or "problem+json" not in answer.headers.get(
        "content-type", ""
    ):
        return False
    code: str = json.loads(answer.text).get("code", "")
    return code == refusal.code


@pytest.fixture(scope="module")
def client(world: World) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=world.server.url, timeout=30) as made:
        yield made


def test_the_table_is_the_live_document(world: World, client: httpx.Client) -> None:
    """The live document has exactly the operations of the table, and each of its path
    parameters is one the table fills."""
    live = client.get("/api/v1/openapi.json").json()
    assert live["paths"] == DOCUMENT["paths"]
    listed = {(op.method, op.path) for op in OPERATIONS if not op.ui}
    assert listed == {(m.upper(), p) for p, ms in live["paths"].items() for m in ms}
    assert len(listed) > 20 and sum(op.ui for op in OPERATIONS) > 10


@pytest.mark.parametrize("op", OPERATIONS, ids=str)
def test_each_refusal(op: Operation, world: World, client: httpx.Client) -> None:
    """Every credential the rule refuses, on the other tenant's real objects with a body that
    would act: the status and code, nothing of that tenant in the answer, nothing changed."""
    before = world.state()
    wrong = []
    for caller in world.callers:
        refusal = expected(op, caller.credential, THEIRS)
        if refusal is None:
            continue
        for request in requests(op, world, caller, THEIRS):
            answer = send(client, request)
            said = f"{caller.credential.name}: {request} -> {answer.status} {answer.text[:200]}"
            if not refused_as(op, refusal, answer):
                wrong.append(f"{said}; expected {refusal}")
            if found := leaks(world, caller, request, answer):
                wrong.append(f"{said}; names {sorted(found)}")
            if (after := world.state()) != before:
                changed = [table for table in STATE if after[table] != before[table]]
                wrong.append(f"{said}; changed {changed}")
                before = after
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("op", OPERATIONS, ids=str)
def test_each_allowed_request_gets_past_every_check(
    op: Operation, world: World, client: httpx.Client
) -> None:
    """Every credential the rule allows, on its own tenant's objects: past every check (the
    action done, or refused by the job's state), naming nothing of a tenant it may not see.
    These run after every refusal: they act."""
    wrong = []
    for caller in world.callers:
        if expected(op, caller.credential, MINE) is not None:
            continue
        for request in requests(op, world, caller, MINE):
            answer = send(client, request)
            said = f"{caller.credential.name}: {request} -> {answer.status} {answer.text[:200]}"
            through = answer.status < 400 or answer.status == 409
            if not through or "<h1>Not found</h1>" in answer.text:
                wrong.append(said)
            if found := leaks(world, caller, request, answer):
                wrong.append(f"{said}; names {sorted(found)}")
    assert not wrong, "\n".join(wrong)
