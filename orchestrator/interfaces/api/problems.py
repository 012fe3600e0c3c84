"""Errors as ``application/problem+json`` (RFC 9457), with the project's stable codes.

Every error the API returns is shaped here, once: the orchestrator's own errors keep their code
(``WF_STATE_TRANSITION_INVALID``, ``JOB_NOT_FOUND``, ...) and message; a request the API cannot
read is ``REQUEST_INVALID`` with what was wrong where; a statement naming what the database
lacks, on a database that is not migrated to this version (emptied, or restored from an older
backup under a running server), is ``SCHEMA_OUTDATED``; anything else unexpected is a 500 that
says nothing of the server's insides (no stack, no SQL; the log has them). A database away is
``DATABASE_UNAVAILABLE`` (503), and for a dashboard page its outage page, never JSON.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from orchestrator.domain import errors
from orchestrator.domain.principals import Forbidden, Unauthorized
from orchestrator.domain.rollups import StatsQueryInvalid
from orchestrator.runtime.external import NotExternal
from orchestrator.storage.migrate import names_what_is_missing, schema_outdated
from orchestrator.storage.tokens import TokenError

logger = logging.getLogger("orchestrator.api")

MEDIA_TYPE = "application/problem+json"

Handler = Callable[["Request", Exception], Awaitable["Response"]]
#: A dashboard's answer to a request of a path while the database is away (path, reason), for
#: its own pages (in HTML); None for any other path.
OutagePage = Callable[[str, str], "Response | None"]

#: The HTTP status of each of the orchestrator's errors (the first class that matches wins).
STATUS: tuple[tuple[type[Exception], int], ...] = (
    (Unauthorized, 401),
    (Forbidden, 403),
    (errors.JobNotFound, 404),
    (errors.DeadLetterNotFound, 404),
    (errors.ApprovalNotFound, 404),
    (errors.ScheduleNotFound, 404),
    (errors.FlowKeyNotFound, 404),
    (errors.InvalidTransition, 409),
    (errors.StaleLease, 409),
    (errors.DeadLetterError, 409),
    (errors.ApprovalError, 409),
    (errors.TransactionConflict, 409),
    (TokenError, 409),
    (errors.SubmitError, 422),  # unknown job type, invalid payload, bad options
    (NotExternal, 422),
    (StatsQueryInvalid, 422),  # a range or step the rollups cannot answer
    (errors.InvalidArgument, 422),  # an argument that cannot be used (a usage grouping)
    (errors.DatabaseUnavailable, 503),
    (errors.SchemaOutdated, 503),
)


class Problem(BaseModel):
    """An error: ``code`` is stable, for programs; ``detail`` is for people."""

    type: str = "about:blank"
    title: str
    status: int
    code: str
    detail: str


#: Every answer an endpoint may give besides its own, documented once for all routes.
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {
        "description": title,
        "content": {MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}},
    }
    for status, title in (
        (400, "A body that cannot be read"),
        (401, "No live API token"), (403, "Beyond the token's scopes or tenants"),
        (404, "No such resource (or not the token's tenants')"),
        (409, "A conflict with the state of what it acts on"),
        (413, "Request body too large"), (422, "A request the API cannot take"),
        (500, "An unexpected error"), (503, "The database is unreachable"),
    )
}  # fmt: skip


def problem(status: int, code: str, detail: str) -> JSONResponse:
    title = _TITLES.get(status, "Error")
    body = Problem(title=title, status=status, code=code, detail=detail)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(
        body.model_dump(), status_code=status, media_type=MEDIA_TYPE, headers=headers
    )


def status_of(exc: Exception) -> int:
    return next((status for kind, status in STATUS if isinstance(exc, kind)), 500)


async def orchestrator_error(request: Request, exc: Exception) -> Response:
    status = status_of(exc)
    if isinstance(exc, errors.DatabaseUnavailable):
        return await database_unavailable(request, exc)
    if status >= 500 and not isinstance(exc, errors.SchemaOutdated):
        return await unexpected(request, exc)
    code = getattr(exc, "code", "ORC_ERROR")
    return problem(status, code, str(exc))


async def database_unavailable(request: Request, exc: errors.DatabaseUnavailable) -> Response:
    """503: the dashboard's outage page for its pages, the problem for the API's. Whether the
    database is away is checked (one probe connection, storage.availability), so that the next
    requests answer at once while it is."""
    availability = getattr(request.app.state, "availability", None)
    if availability is not None:
        await availability.reachable()
    return outage_answer(request.url.path, str(exc), request.app.state.outage_page)


def outage_answer(path: str, reason: str, page: OutagePage | None) -> Response:
    """What a request of ``path`` is answered while the database is away: the dashboard's
    ``page`` for its own paths, when one is mounted."""
    answer = page(path, reason) if page is not None else None
    if answer is not None:
        return answer
    if path == "/readyz":
        return Response("database unreachable", status_code=503, media_type="text/plain")
    return problem(503, errors.DatabaseUnavailable.code, reason)


async def request_invalid(request: Request, exc: Exception) -> JSONResponse:
    """422 for a request the API read but cannot take; 400 for a body it cannot read at all."""
    assert isinstance(exc, RequestValidationError)
    unreadable = _unreadable(request, exc)
    if unreadable is not None:
        return problem(400, "REQUEST_INVALID", unreadable)
    return problem(422, "REQUEST_INVALID", "; ".join(_where(e) for e in exc.errors()))


def _unreadable(request: Request, exc: RequestValidationError) -> str | None:
    """Why the body is no JSON document (malformed, or sent as another media type); None when
    it is one."""
    for error in exc.errors():
        if error.get("type") == "json_invalid":
            reason = error.get("ctx", {}).get("error", "malformed")
            return f"body: not valid JSON ({reason} at character {error['loc'][-1]})"
    if isinstance(exc.body, bytes):  # read as bytes: its content-type is not JSON's
        media = request.headers.get("content-type", "none")
        return f"body: not JSON (content-type {media}; send application/json)"
    return None


async def http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    code = {
        400: "REQUEST_INVALID", 404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED",
        413: "REQUEST_TOO_LARGE",
    }.get(exc.status_code, "HTTP_ERROR")  # fmt: skip
    return problem(exc.status_code, code, str(exc.detail))


async def database_error(request: Request, exc: Exception) -> JSONResponse:
    """A statement the database refused that no store turned into an orchestrator error:
    ``SCHEMA_OUTDATED`` if it named what a database not migrated to this version lacks, else
    unexpected."""
    outdated = await _schema_outdated(request, exc)
    if outdated is not None:
        logger.warning("%s %s: %s", request.method, request.url.path, outdated)
        return problem(503, outdated.code, str(outdated))
    return await unexpected(request, exc)


async def unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return problem(500, "INTERNAL", "the server could not answer this request; see its log")


async def _schema_outdated(request: Request, exc: Exception) -> errors.SchemaOutdated | None:
    """Why the database lacked what a statement named, when it is not migrated to this
    version; None for anything else (a bug: the schema is whole), or if the check fails."""
    if not names_what_is_missing(exc):
        return None
    orc = request.app.state.orc
    try:
        async with orc.stores.queries.connection() as conn:
            return await schema_outdated(conn)
    except errors.OrchestratorError:  # the database lost meanwhile: the error stands
        return None


def _where(error: Any) -> str:
    parts = list(error.get("loc", ()))
    if parts[:1] == ["body"]:  # the request's body: its fields are named from there
        parts = parts[1:]
    loc = ".".join(str(part) for part in parts)
    return f"{loc or 'request'}: {error.get('msg', 'invalid')}"


#: Which handler answers which error (the first class that matches wins): the app registers
#: them for its routes, and its Authenticate middleware, which runs before the routes' own error
#: handling, answers with them too (answer).
HANDLERS: tuple[tuple[type[Exception], Handler], ...] = (
    (errors.OrchestratorError, orchestrator_error),
    (RequestValidationError, request_invalid),
    (HTTPException, http_error),
    (psycopg.Error, database_error),
    (Exception, unexpected),
)


async def answer(request: Request, exc: Exception) -> Response:
    """The problem a route's error would have been answered with."""
    handler = next(handle for kind, handle in HANDLERS if isinstance(exc, kind))
    return await handler(request, exc)


_TITLES = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    413: "Content Too Large",
    422: "Unprocessable Content",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
