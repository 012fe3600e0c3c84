"""The HTTP API (``/api/v1``, docs/api.md), its OpenAPI document, and its probes and metrics, as
one ASGI application on FastAPI, which ``orchestrator serve`` extends with the dashboard
(orchestrator.interfaces.server).

FastAPI rather than bare Starlette: requests and responses are the pydantic models the Python
API already has (``JobSpec``, ``Job``, ...), validated and documented once; the OpenAPI
document that external workers and Schemathesis read is generated from them, so it cannot drift
from the code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException

from orchestrator.app import Orchestrator
from orchestrator.domain.principals import Principal, Scope
from orchestrator.interfaces.api import (
    access,
    flow,
    jobs,
    operations,
    parameters,
    problems,
    schedules,
    stats,
    summary,
    workers,
)
from orchestrator.interfaces.api.auth import Authenticator, authenticate
from orchestrator.interfaces.api.feeds import OutputFeeds
from orchestrator.interfaces.api.middleware import AsgiScope, HttpMiddleware, Receive, Send
from orchestrator.interfaces.watch import EventWatch
from orchestrator.runtime.external import ExternalRuns
from orchestrator.runtime.loops import keep_running
from orchestrator.storage.availability import Availability

logger = logging.getLogger("orchestrator.api")

VERSION = "1"
OPENAPI_URL = "/api/v1/openapi.json"
#: The one /api/v1 path served without a token: the document describes the API, holds no data,
#: and is the repository's docs/openapi.json anyway; clients and tools read it before they
#: have a token.
OPEN_DOCUMENT = (
    "Every operation needs an API token (`Authorization: Bearer orc_...`, docs/api.md); "
    "this document itself is served without one."
)


def create_api(orc: Orchestrator) -> FastAPI:
    """The API for ``orc``, which the application opens when it starts and closes when it
    stops (with its background tasks: external workers' wake-ups, event watching). No
    dashboard: a 503 while the database is away is a problem, until a dashboard that mounts on
    it sets ``app.state.outage_page`` for its own pages (problems.outage_answer)."""
    settings = orc.settings

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        orc.check_definition()
        await orc.open()
        await orc.check_schedules()
        app.state.availability = Availability(orc.dsn, wait=settings.api_database_wait_seconds)
        app.state.authenticator = Authenticator(orc.stores.tokens)
        app.state.watch = EventWatch(dsn=orc.dsn, listeners=orc.stores.listeners, role="api")
        app.state.feeds = OutputFeeds(orc, app.state.watch)
        app.state.external = ExternalRuns(
            dsn=orc.dsn, stores=orc.stores, settings=settings, config=orc.live_config,
            job_types=orc.job_types, failures=orc.failures, metrics=orc.metrics,
            host=f"{socket.gethostname()}/api", declares=orc.declares,
        )  # fmt: skip
        background = [
            asyncio.create_task(app.state.watch.run(), name="event watch"),
            asyncio.create_task(app.state.external.run(), name="external workers"),
            asyncio.create_task(orc.scheduler().run(), name="schedules"),
        ]
        reload = orc.config_reload()
        if reload is not None:  # what the API submits and reports follows the file's edits
            background.append(
                asyncio.create_task(
                    keep_running("retry config reload", reload.run), name="retry config reload"
                )
            )
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await orc.close()

    app = FastAPI(
        title="agent-orchestrator",
        version=VERSION,
        summary="Durable, two-layer retry orchestrator for LLM agent jobs",
        description=OPEN_DOCUMENT,
        openapi_url=OPENAPI_URL,
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
    )
    app.state.orc = orc
    app.state.settings = settings
    app.state.outage_page = None
    for kind, handler in problems.HANDLERS:
        app.add_exception_handler(kind, handler)
    for router in (jobs.router, operations.router, stats.router, schedules.router, flow.router,
                   summary.router):  # fmt: skip
        app.include_router(router, responses=problems.ERRORS)
    app.include_router(workers.router)  # declares its own answers (no 404 for a report)
    app.add_api_route("/healthz", healthz, methods=["GET"], include_in_schema=False)
    app.add_api_route("/readyz", readyz, methods=["GET"], include_in_schema=False)
    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
    app.add_middleware(BodyLimit, limit=settings.api_max_body_bytes)
    app.add_middleware(StorableParameters)
    app.add_middleware(Authenticate, open_metrics=settings.api_open_metrics)
    app.add_middleware(FailFast)
    app.add_middleware(SecurityHeaders)
    app.add_middleware(ServerTiming)
    app.add_middleware(access.AccessLog)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, with the errors' schema (Problem) that every route refers to, and
    the bearer token required everywhere it is."""
    if app.openapi_schema is None:
        document = get_openapi(
            title=app.title, version=app.version, summary=app.summary,
            description=app.description, routes=app.routes,
        )  # fmt: skip
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        if "Problem" in schemas:  # a model of an answer named so would be described as an error
            raise RuntimeError("an API model is named Problem, the errors' schema: rename it")
        schemas["Problem"] = problems.Problem.model_json_schema()
        app.openapi_schema = document
    return app.openapi_schema


async def healthz() -> Response:
    """Alive, whatever the database (so an outage does not restart the fleet)."""
    return Response("ok", media_type="text/plain")


async def readyz(request: Request) -> Response:
    """Ready while the database answers; 503 at once while it is away (FailFast), and within
    ``api_database_wait_seconds`` and a probe's second when it just went."""
    orc: Orchestrator = request.app.state.orc
    await orc.stores.liveness.ping()  # DatabaseUnavailable: answered by problems.outage_answer
    return Response("ok", media_type="text/plain")


async def metrics(request: Request) -> Response:
    """The API server's metrics (its external workers' attempts among them)."""
    orc: Orchestrator = request.app.state.orc
    if not orc.settings.api_open_metrics:
        caller: Principal = request.state.principal  # authenticated first (Authenticate)
        caller.require(Scope.READ)
    body, content_type = await orc.metrics.exposition(request.headers.get("accept", ""))
    return Response(body, media_type=content_type)


class ServerTiming(HttpMiddleware):
    """``Server-Timing: app;dur=<ms>`` on every answer: the server's own time, which a browser's
    developer tools show, and bench/ui.py reads."""

    async def http(self, scope: AsgiScope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()

        async def timed(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                ms = (time.perf_counter() - started) * 1000
                message["headers"] = [*message.get("headers", []),
                                      (b"server-timing", f"app;dur={ms:.1f}".encode())]  # fmt: skip
            await send(message)

        await self.app(scope, receive, timed)


#: Paths answered while the database is away (they need nothing from it, or, /metrics behind a
#: token, need only the token cache's word).
NO_DATABASE = ("/healthz", "/metrics", OPENAPI_URL, "/ui/static/")


class FailFast(HttpMiddleware):
    """While the database is away (storage.availability), a request that needs it is answered
    503 at once (the dashboard's outage page, the API's problem, /readyz's text) rather than
    after the pool's wait. Any other request's wait for a pooled connection is bounded:
    ``api_database_wait_seconds``, then on only if a probe connection says the database
    answers."""

    async def http(self, scope: AsgiScope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        availability: Availability = scope["app"].state.availability
        if (
            not path.startswith(NO_DATABASE)
            and availability.away
            and not await availability.reachable()
        ):
            availability.refused()
            reason = f"cannot reach the database: {availability.reason}"
            page = scope["app"].state.outage_page
            await problems.outage_answer(path, reason, page)(scope, receive, send)
            return
        with availability.bounding():
            await self.app(scope, receive, send)


class BodyLimit:
    """Refuse a request body over ``limit`` bytes with 413, whether it says its length up
    front or streams it: nothing past the limit is read."""

    def __init__(self, app: Callable[[AsgiScope, Receive, Send], Awaitable[None]], limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: AsgiScope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await self._too_large(scope, receive, send)
            return
        seen = 0

        async def limited() -> MutableMapping[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise HTTPException(413, f"request body over {self.limit} bytes")
            return message

        await self.app(scope, limited, send)

    async def _too_large(self, scope: AsgiScope, receive: Receive, send: Send) -> None:
        response = problems.problem(
            413, "REQUEST_TOO_LARGE",
            f"request body over {self.limit} bytes (ORCHESTRATOR_API_MAX_BODY_BYTES)",
        )  # fmt: skip
        await response(scope, receive, send)


class Authenticate:
    """Every ``/api/v1`` request but the OpenAPI document's (and ``/metrics`` unless it is open)
    is authenticated first, before its size, its parameters or its body are looked at: without
    a live token it is 401 whatever else is wrong with it, and learns nothing more (docs/api.md,
    "Auth"). The caller is left in the request's state for the routes' scope checks."""

    def __init__(
        self, app: Callable[[AsgiScope, Receive, Send], Awaitable[None]], *, open_metrics: bool
    ):
        self.app = app
        self.open_metrics = open_metrics

    def guards(self, path: str) -> bool:
        if path == "/metrics":
            return not self.open_metrics
        return (path == "/api/v1" or path.startswith("/api/v1/")) and path != OPENAPI_URL

    async def __call__(self, scope: AsgiScope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.guards(scope["path"]):
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            caller = await authenticate(request)
        except Exception as exc:  # answered as a route's would be (401, 503, ...)
            await (await problems.answer(request, exc))(scope, receive, send)
            return
        scope.setdefault("state", {})["principal"] = caller
        await self.app(scope, receive, send)


class StorableParameters:
    """A query or path parameter PostgreSQL cannot store (api.parameters) is a 400
    ``REQUEST_INVALID`` naming it, whatever the route."""

    def __init__(self, app: Callable[[AsgiScope, Receive, Send], Awaitable[None]]):
        self.app = app

    async def __call__(self, scope: AsgiScope, receive: Receive, send: Send) -> None:
        refused = parameters.refused(scope) if scope["type"] == "http" else None
        if refused is None:
            await self.app(scope, receive, send)
            return
        await problems.problem(400, "REQUEST_INVALID", refused)(scope, receive, send)


#: On every answer: what a browser may load, and that no other site may frame or sniff it
#: (docs/ui.md, "Security headers"). The dashboard has no inline script or style.
SECURITY_HEADERS = (
    (b"content-security-policy",
     b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
     b"connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
)  # fmt: skip
#: What may be kept in a cache: only the dashboard's static files.
CACHEABLE = "/ui/static/"


class SecurityHeaders(HttpMiddleware):
    """SECURITY_HEADERS on every answer, and ``Cache-Control: no-store`` on every answer but
    the static files (pages and API answers show jobs: no browser or proxy keeps them)."""

    async def http(self, scope: AsgiScope, receive: Receive, send: Send) -> None:
        cacheable = scope["path"].startswith(CACHEABLE)

        async def secured(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), *SECURITY_HEADERS]
                if not cacheable and not any(k.lower() == b"cache-control" for k, _ in headers):
                    headers.append((b"cache-control", b"no-store"))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, secured)
