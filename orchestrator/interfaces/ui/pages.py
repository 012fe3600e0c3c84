"""The dashboard (``/ui``, docs/ui.md): server-rendered pages over the same Orchestrator as the
API, signed in with an API token, and live.

A page renders its live part from a fragment endpoint; the page's script re-reads that fragment
when the server says something changed (Server-Sent Events): a job's page when the job has new
events (woken by the database, as an API wait), the lists every two seconds. A job's page also
shows its output as it is written, from a stream of its chunks (as the API's), which a re-read
leaves in place. Actions are plain
forms carrying the session's CSRF token; each records the signed-in principal as who acted, and
the API's rules apply (scopes, tenants, the two-person discard).

Every form the dashboard takes, sign-in included, is one of its own pages' (``from_this_page``):
the browser says it was sent from this origin, and it carries the CSRF token that page was given
(a session's, or before signing in, a cookie's: double submit). Anything else is 401.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import secrets
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlencode, urlsplit
from uuid import UUID

from fastapi import APIRouter, Depends, Form, Header, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from fastapi.templating import Jinja2Templates

from orchestrator.app import Orchestrator
from orchestrator.domain.dead_letters import BECOMES, BULK_MAX, SHOWN, TAKES, LetterFilter
from orchestrator.domain.errors import (
    ApprovalNotFound,
    DatabaseUnavailable,
    DeadLetterNotFound,
    JobNotFound,
    OrchestratorError,
    ScheduleNotFound,
)
from orchestrator.domain.models import Job, JobEvent
from orchestrator.domain.principals import Scope, Unauthorized
from orchestrator.domain.states import Status
from orchestrator.domain.storable import Text
from orchestrator.interfaces.api.feeds import OutputFeeds
from orchestrator.interfaces.api.jobs import (
    Orc,
    orchestrator,
    resumed_at,
    visible_job,
)
from orchestrator.interfaces.api.operations import shown_limit, shown_type
from orchestrator.interfaces.ui import views
from orchestrator.interfaces.watch import EventWatch, Recheck
from orchestrator.storage.jobs import JobFilters
from orchestrator.storage.rows import ApprovalRecord
from orchestrator.storage.sessions import Session
from retry_config.names import tenant_refusal

router = APIRouter(prefix="/ui", include_in_schema=False)
templates = Jinja2Templates(directory=Path(__file__).with_name("templates"))
templates.env.filters["seconds"] = views.seconds
templates.env.filters["pretty"] = views.pretty
templates.env.filters["readable"] = views.readable
templates.env.globals["layer_of"] = views.layer_of

COOKIE = "orc_session"
#: Before signing in: the sign-in form's CSRF token, the same in this cookie and in the form.
LOGIN_COOKIE = "orc_login"
SESSION_SECONDS = 12 * 3600
LIST_REFRESH_SECONDS = 2.0
#: How often a live page's stream checks that its session (and its token) still lives: a
#: query, so less often than an API stream's cached check (api.auth.RECHECK_SECONDS).
SESSION_CHECK_SECONDS = 2.0
JOB_PAGE = 50
HISTORY_SECONDS = 3600.0  # the overview's counts of finished jobs: the last hour's rollups
OVERVIEW_SECONDS = 2.0  # how long one read of the overview serves every viewer


class SignInFirst(Exception):
    """No live session: the browser is sent to the sign-in page, and back afterwards."""

    def __init__(self, path: str) -> None:
        self.path = path


async def sign_in_first(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, SignInFirst)
    return RedirectResponse(f"/ui/login?{urlencode({'next': exc.path})}", status_code=303)


async def viewer(request: Request) -> Session:
    """The signed-in session, which may read; SignInFirst otherwise."""
    session_id = request.cookies.get(COOKIE)
    orc = orchestrator(request)
    session = await orc.stores.sessions.find(session_id) if session_id else None
    if session is None or not session.principal.allows(Scope.READ):
        raise SignInFirst(request.url.path + (f"?{request.url.query}" if request.url.query else ""))
    return session


Viewer = Annotated[Session, Depends(viewer)]


async def from_this_page(request: Request, expected: str | None) -> None:
    """A form one of this dashboard's pages gave the browser: Unauthorized otherwise. The
    browser says it comes from this origin (``Sec-Fetch-Site``; an older one, ``Origin``), and
    its ``csrf`` field is ``expected``, the token that page was given."""
    given = (await request.form()).get("csrf")
    if not (
        isinstance(given, str)
        and expected
        and hmac.compare_digest(_bytes(given), _bytes(expected))
        and _same_origin(request)
    ):
        raise Unauthorized("this form is not from this dashboard's page (CSRF token); reload it")


def _bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _same_origin(request: Request) -> bool:
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site == "same-origin"  # not same-site: a sibling subdomain is another site
    origin = request.headers.get("origin")
    return origin is None or urlsplit(origin).netloc == request.headers.get("host")


async def signed(request: Request, session: Viewer) -> Session:
    """The session, acting through a form of its own pages."""
    await from_this_page(request, session.csrf)
    return session


async def acting(session: Annotated[Session, Depends(signed)]) -> Session:
    """The session, acting through a form of its own pages, with the operate scope."""
    session.principal.require(Scope.OPERATE)
    return session


async def signing_in(request: Request) -> None:
    """A sign-in from this dashboard's own sign-in form, so that no other site's form can sign
    a browser in to a session of that site's choosing (login CSRF)."""
    await from_this_page(request, request.cookies.get(LOGIN_COOKIE))


Signed = Annotated[Session, Depends(signed)]
Acting = Annotated[Session, Depends(acting)]


def _back(to: str, *, note: str | None = None, error: str | None = None) -> RedirectResponse:
    query = urlencode({k: v for k, v in (("note", note), ("error", error)) if v})
    joined = "&" if "?" in to else "?"
    return RedirectResponse(f"{to}{joined}{query}" if query else to, status_code=303)


def _page(
    request: Request, name: str, session: Session, *, status_code: int = 200, **context: Any
) -> HTMLResponse:
    principal = session.principal
    return templates.TemplateResponse(
        request,
        name,
        status_code=status_code,
        context={
            "principal": principal,
            "can_operate": principal.allows(Scope.OPERATE),
            "csrf": session.csrf,
            "note": request.query_params.get("note"),
            "error": request.query_params.get("error"),
            "now": datetime.now(UTC),
            **context,
        },
    )


# -- signing in -------------------------------------------------------------------------------


@router.get("/login")
async def login_form(request: Request, next: str = "/ui") -> HTMLResponse:
    csrf = request.cookies.get(LOGIN_COOKIE, "")
    if not (len(csrf) == 43 and csrf.isascii()):  # a tab's form stays good while another opens
        csrf = secrets.token_urlsafe(32)
    response = templates.TemplateResponse(
        request,
        "login.html",
        {"next": _local(next), "error": request.query_params.get("error"), "csrf": csrf},
    )
    response.set_cookie(
        LOGIN_COOKIE, csrf, path="/ui/login", httponly=True, samesite="strict",
        secure=request.url.scheme == "https",
    )  # fmt: skip
    return response


@router.post("/login", dependencies=[Depends(signing_in)])
async def login(
    request: Request,
    orc: Orc,
    token: Annotated[Text, Form(max_length=200)],
    next: Annotated[Text, Form(max_length=2000)] = "/ui",
) -> Response:
    try:
        principal = await orc.stores.tokens.authenticate(token)
        principal.require(Scope.READ)
    except OrchestratorError as exc:
        query = urlencode({"next": _local(next), "error": str(exc)})
        return RedirectResponse(f"/ui/login?{query}", status_code=303)
    assert principal.token_id is not None
    session_id = await orc.stores.sessions.create(principal.token_id, seconds=SESSION_SECONDS)
    response = RedirectResponse(_local(next), status_code=303)
    response.set_cookie(
        COOKIE, session_id, max_age=int(SESSION_SECONDS), path="/ui", httponly=True,
        samesite="strict", secure=request.url.scheme == "https",
    )  # fmt: skip
    response.delete_cookie(LOGIN_COOKIE, path="/ui/login")  # used: the next sign-in gets another
    return response


@router.post("/logout")
async def logout(request: Request, orc: Orc, session: Signed) -> Response:
    await orc.stores.sessions.end(request.cookies[COOKIE])
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(COOKIE, path="/ui")
    return response


def _local(path: str) -> str:
    """Only a path of this dashboard to go back to (never another site)."""
    return path if path.startswith("/ui") and not path.startswith("//") else "/ui"


# -- the overview -----------------------------------------------------------------------------


class OverviewCache:
    """The overview, read at most once per ``seconds`` for each set of tenants, whoever asks:
    its counts read the whole fleet (hundreds of milliseconds at a million jobs), and every open
    overview re-reads it every few seconds."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._read: dict[frozenset[str] | None, tuple[float, dict[str, Any]]] = {}
        self._lock = asyncio.Lock()

    async def get(self, orc: Orchestrator, session: Session) -> dict[str, Any]:
        key = session.principal.tenants
        async with self._lock:
            cached = self._read.get(key)
            now = asyncio.get_running_loop().time()
            if cached is None or now - cached[0] > self.seconds:
                cached = (now, await _overview(orc, session))
                self._read[key] = cached
            return cached[1]


def _cached_overview(request: Request, orc: Orchestrator, session: Session) -> Any:
    cache: OverviewCache = request.app.state.overview
    return cache.get(orc, session)


async def _overview(orc: Orchestrator, session: Session) -> dict[str, Any]:
    """What the overview shows: what is wrong (the fleet summary's problems, as banners), the
    unfinished jobs counted, the last hour's retries and failures by the minute they happened
    (their events), and the history charted from the rollups, so that nothing here reads the
    finished jobs (bench/overview.py: at 1,000,000).
    Its reads are independent of each other: they run at once, on as many connections (the
    first error is raised as it is, as one read's would be)."""
    tenants = session.principal.tenants
    now = datetime.now(UTC)
    stores, hour_ago = orc.stores, now - timedelta(hours=1)
    minute_ago_hour = hour_ago.replace(second=0, microsecond=0)  # the rollups' first minute
    counts = asyncio.gather(
        stores.fleet.unfinished(zombie_threshold=orc.settings.zombie_threshold, tenants=tenants),
        orc.stats(since=hour_ago, until=now, step=60, tenants=tenants),
        orc.stats(since=now - timedelta(days=1), until=now, step=3600, tenants=tenants),
        stores.fleet.queue_stats(tenants=tenants),
    )
    lists = asyncio.gather(
        stores.dashboard.holders(tenants=tenants),
        orc.summary(tenants=tenants),
        orc.dead_letters(limit=5, tenants=tenants),
        orc.approvals(limit=5, tenants=tenants),
        stores.dashboard.activity(since=minute_ago_hour, tenants=tenants),
    )
    (fleet, hour, day, queues), lists_read = await asyncio.gather(counts, lists)
    holders, summary, letters, approvals, activity = lists_read
    outcomes = views.outcome_series(hour)
    finished = {"COMPLETED": sum(outcomes["completed"].values()),
                "FAILED": sum(outcomes["failed"].values())}  # fmt: skip
    minutes = views.steps_of(hour.since, hour.until, hour.step)
    hours = views.steps_of(day.since, day.until, day.step)
    charts = [
        views.chart("Now: retries and failures, last hour", minutes, activity,
                    unit="per minute, in the minute they happened", known_until=None,
                    nothing="no retry scheduled, no job failed", y_label="retries, failures"),
        views.chart("Finished, last hour", minutes, outcomes,
                    unit="per minute, in the minute the job finished",
                    known_until=hour.rolled_up_to),
        views.chart("Finished, last day", hours, views.outcome_series(day),
                    unit="per hour, in the hour the job finished",
                    known_until=hour.rolled_up_to),
        views.chart("Queue depth, last hour", minutes, views.depth_series(hour),
                    unit="at each minute", known_until=views.last_sample(hour), sums=False,
                    nothing="nothing waiting or running"),
    ]  # fmt: skip
    failed_now = sum(activity["failed"].values())
    return {
        "counts": views.counts(fleet.jobs, finished, HISTORY_SECONDS, tenants, failed_now),
        "charts": charts,
        "rolled_up_to": hour.rolled_up_to,
        "queues": queues,
        "holders": holders,
        "summary": summary,
        "letters": letters,
        "approvals": approvals,
        "zombies": fleet.zombies,
    }


@router.get("")
async def overview(request: Request, orc: Orc, session: Viewer) -> HTMLResponse:
    context = await _cached_overview(request, orc, session)
    return _page(request, "overview.html", session, **context)


@router.get("/fragments/overview")
async def overview_fragment(request: Request, orc: Orc, session: Viewer) -> HTMLResponse:
    context = await _cached_overview(request, orc, session)
    return _page(request, "_overview.html", session, **context)


# -- jobs -------------------------------------------------------------------------------------


def _filters(request: Request, session: Session) -> JobFilters:
    q = request.query_params
    status = q.get("status", "").upper()
    return JobFilters(
        status=Status(status) if status in Status.__members__ else None,
        job_type=q.get("job_type") or None, tenant_id=_tenant_filter(q.get("tenant_id")),
        agent_id=q.get("agent_id") or None, job_key=q.get("job_key") or None,
        created_after=_when(q.get("created_after")), created_before=_when(q.get("created_before")),
        tenants=session.principal.tenants,
    )  # fmt: skip


def _tenant_filter(value: str | None) -> str | None:
    """The form's tenant field: an empty or blank one (names no tenant) filters nothing, as
    the form's other empty fields."""
    return value if value and tenant_refusal(value) is None else None


def _when(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


async def _jobs(request: Request, orc: Orchestrator, session: Session) -> dict[str, Any]:
    cursor = request.query_params.get("cursor")
    try:
        before = UUID(cursor) if cursor else None
    except ValueError:
        before = None
    jobs = await orc.stores.jobs.page(_filters(request, session), before=before, limit=JOB_PAGE + 1)
    more = len(jobs) > JOB_PAGE
    query = {k: v for k, v in request.query_params.items() if k not in ("cursor", "note", "error")}
    return {
        "jobs": jobs[:JOB_PAGE],
        "short": views.short_ids([job.id for job in jobs[:JOB_PAGE]]),
        "next_page": (
            "/ui/jobs?" + urlencode({**query, "cursor": str(jobs[JOB_PAGE - 1].id)})
            if more
            else None
        ),
        "query": query,
        "query_string": urlencode(query),
        "statuses": [s.value for s in Status],
    }


@router.get("/jobs")
async def jobs_page(request: Request, orc: Orc, session: Viewer) -> Response:
    found = request.query_params.get("q", "").strip()
    if found:
        try:
            return RedirectResponse(f"/ui/jobs/{UUID(found)}", status_code=303)
        except ValueError:
            return _back("/ui/jobs", error=f"not a job id: {found[:80]!r}")
    return _page(request, "jobs.html", session, **await _jobs(request, orc, session))


@router.get("/fragments/jobs")
async def jobs_fragment(request: Request, orc: Orc, session: Viewer) -> HTMLResponse:
    return _page(request, "_jobs.html", session, **await _jobs(request, orc, session))


async def _job(orc: Orchestrator, session: Session, job_id: UUID) -> dict[str, Any]:
    job = await orc.get_job(job_id)
    if not session.principal.sees(job.tenant_id):
        raise JobNotFound(job_id)
    events = await orc.job_events(job_id)
    letter = await orc.stores.dead_letters.of_job(job_id)
    approval = await _pending_approval(orc, job, events)
    tenants = session.principal.tenants
    graph = orc.stores.graph
    parents = [p for _, p in await graph.parents(job_id, limit=GRAPH_SHOWN, tenants=tenants)]
    children = await graph.children(job_id, after=None, limit=GRAPH_SHOWN + 1, tenants=tenants)
    return {
        "job": job,
        "parents": parents,
        "children": children[:GRAPH_SHOWN],
        "more_children": len(children) > GRAPH_SHOWN,
        "summary": views.summary(job, events, letter, approval, datetime.now(UTC)),
        "events": views.event_lines(events),
        "steps": await orc.job_steps(job_id),
        "letter": letter,
        "approval": approval,
        "transcript": views.transcript(job.result),
        "config": orc.retry_config.for_type(job.job_type),
        "usage": await orc.job_usage(job_id),
    }


#: The parents and the children a job's page shows, and watches live (the API pages them all).
GRAPH_SHOWN = 50


async def _pending_approval(
    orc: Orchestrator, job: Job, events: list[JobEvent]
) -> ApprovalRecord | None:
    """The approval a job waiting for one waits for: its newest ``job.waiting_approval``'s."""
    if job.status is not Status.WAITING_APPROVAL:
        return None
    asked = next((e for e in reversed(events) if e.kind == "job.waiting_approval"), None)
    if asked is None:
        return None
    approval = await orc.stores.approvals.get(UUID(asked.payload["approval_id"]))
    return approval if approval["status"] == "pending" else None


@router.get("/jobs/{job_id}")
async def job_page(request: Request, orc: Orc, session: Viewer, job_id: UUID) -> HTMLResponse:
    try:
        context = await _job(orc, session, job_id)
    except JobNotFound:  # unknown, or another tenant's: the same friendly page, and a 404
        return _page(
            request, "missing.html", session, status_code=404, what=f"job {job_id}",
            back="/ui/jobs",
        )  # fmt: skip
    return _page(request, "job.html", session, **context)


@router.get("/fragments/jobs/{job_id}")
async def job_fragment(request: Request, orc: Orc, session: Viewer, job_id: UUID) -> HTMLResponse:
    return _page(request, "_job.html", session, **await _job(orc, session, job_id))


@router.post("/jobs/{job_id}/cancel")
async def cancel(
    orc: Orc, session: Acting, job_id: UUID, reason: Annotated[Text, Form(max_length=2000)] = ""
) -> Response:
    await _job(orc, session, job_id)
    return await _acted(
        f"/ui/jobs/{job_id}", "cancelled",
        orc.cancel(job_id, reason=reason, by=session.principal.actor),
    )  # fmt: skip


async def _acted(to: str, note: str, action: Any) -> RedirectResponse:
    """Do it, then back to the page: a refusal (a finished job, the same reviewer twice) is
    shown there, in the API's words."""
    try:
        await action
    except OrchestratorError as exc:
        return _back(to, error=str(exc))
    return _back(to, note=note)


# -- dead letters -----------------------------------------------------------------------------


#: The dead-letter page's filters: query parameter -> the facade's argument (``failure``, not
#: ``error``: a page's ``error`` is the refusal it shows).
LETTER_FILTERS = {"type": "job_type", "tenant": "tenant_id", "failure": "error"}


def _letter_filter(values: Any) -> LetterFilter:
    """The filters given (the page's query, or the bulk form's fields); blank: none."""
    given = {arg: str(values.get(name) or "").strip() for name, arg in LETTER_FILTERS.items()}
    return LetterFilter(**{arg: value or None for arg, value in given.items()})


async def _letters(request: Request, orc: Orchestrator, session: Session) -> dict[str, Any]:
    state = request.query_params.get("state") or "open"
    chosen = _letter_filter(request.query_params)
    shown = {name: request.query_params.get(name, "") for name in LETTER_FILTERS}
    query = urlencode({k: v for k, v in {"state": state, **shown}.items() if v})
    letters, filter_error = [], None
    try:
        letters = await orc.dead_letters(
            state=state, job_type=chosen.job_type, tenant_id=chosen.tenant_id,
            error=chosen.error, limit=100, tenants=session.principal.tenants,
        )  # fmt: skip
    except OrchestratorError as exc:  # a filter refused: said on the page, nothing listed
        filter_error = str(exc)
    same = orc.stores.dead_letters.same_person
    return {
        "letters": letters,
        "state": state,
        "states": tuple(SHOWN),
        "shown": shown,
        "query": query,
        "filter_error": filter_error,
        "filtered": chosen != LetterFilter(),
        "bulk_max": BULK_MAX,
        #: the discards this viewer requested, as the database's two-person rule tells persons
        "requested_by_viewer": {
            letter.id
            for letter in letters
            if letter.discard_requested_by is not None
            and letter.discarded_by is None
            and await same(letter.discard_requested_by, session.principal.actor)
        },
    }


@router.get("/dead-letters")
async def dead_letters_page(request: Request, orc: Orc, session: Viewer) -> HTMLResponse:
    return _page(request, "dead_letters.html", session, **await _letters(request, orc, session))


@router.get("/fragments/dead-letters")
async def dead_letters_fragment(request: Request, orc: Orc, session: Viewer) -> HTMLResponse:
    return _page(request, "_dead_letters.html", session, **await _letters(request, orc, session))


async def _own_letter(orc: Orchestrator, session: Session, letter_id: UUID) -> None:
    letter = await orc.dead_letter(letter_id)
    if not session.principal.sees(letter.tenant_id):
        raise DeadLetterNotFound(letter_id)


@router.post("/dead-letters/bulk")
async def dead_letters_bulk(
    request: Request, orc: Orc, session: Acting,
    action: Annotated[Text, Form(max_length=40)] = "",
    ids: Annotated[list[Text], Form(max_length=BULK_MAX)] = [],  # noqa: B006 (FastAPI's form)
    matching: Annotated[Text, Form(max_length=10)] = "",
    reason: Annotated[Text, Form(max_length=2000)] = "",
) -> Response:  # fmt: skip
    """One action on the letters ticked, or on every one the action can take matching the
    page's filters (``matching``): each letter's outcome counted in the note, the first
    refusal in the error."""
    form = await request.form()
    query = urlencode({"state": str(form.get("state") or "open"),
                       **{n: str(form[n]) for n in LETTER_FILTERS if form.get(n)}})  # fmt: skip
    back = f"/ui/dead-letters?{query}"
    taken = next((name for name in TAKES if name == action), None)
    if taken is None:
        return _back(back, error=f"no such action: {action[:40]!r}")
    if not matching and not ids:
        return _back(back, error="tick the letters to act on, or choose all matching the filter")
    tenants, actor = session.principal.tenants, session.principal.actor
    try:
        chosen = _letter_filter(form) if matching else LetterFilter()
        review = await orc.review_dead_letters(
            taken, None if matching else ids, job_type=chosen.job_type,
            tenant_id=chosen.tenant_id, error=chosen.error, by=actor, reason=reason,
            tenants=tenants,
        )  # fmt: skip
    except OrchestratorError as exc:
        return _back(back, error=str(exc))
    done = f"{BECOMES[taken].replace('_', ' ')}: {review.done} of {len(review.outcomes)}"
    more = f"; more match (at most {BULK_MAX} at a time)" if review.more else ""
    refusal = next((o.detail for o in review.outcomes if o.detail), None)
    if refusal is not None:
        return _back(back, error=f"{done}, {review.refused} refused ({refusal}){more}")
    return _back(back, note=done + more)


@router.post("/dead-letters/{letter_id}/{action}")
async def dead_letter_action(
    orc: Orc, session: Acting, letter_id: UUID, action: str,
    reason: Annotated[Text, Form(max_length=2000)] = "",
) -> Response:  # fmt: skip
    await _own_letter(orc, session, letter_id)
    actor = session.principal.actor
    match action:
        case "requeue":
            return await _acted("/ui/dead-letters", "requeued", orc.requeue_dead_letter(letter_id))
        case "discard-request":
            return await _acted(
                "/ui/dead-letters", "discard requested: a second reviewer must confirm it",
                orc.request_discard(letter_id, by=actor, reason=reason),
            )  # fmt: skip
        case "discard-confirm":
            return await _acted(
                "/ui/dead-letters", "discarded", orc.confirm_discard(letter_id, by=actor)
            )
    return _back("/ui/dead-letters", error=f"no such action: {action[:40]!r}")


# -- approvals --------------------------------------------------------------------------------


async def _approvals(orc: Orchestrator, session: Session) -> dict[str, Any]:
    return {"approvals": await orc.approvals(limit=100, tenants=session.principal.tenants)}


@router.get("/approvals")
async def approvals_page(request: Request, orc: Orc, session: Viewer) -> HTMLResponse:
    return _page(request, "approvals.html", session, **await _approvals(orc, session))


@router.get("/fragments/approvals")
async def approvals_fragment(request: Request, orc: Orc, session: Viewer) -> HTMLResponse:
    return _page(request, "_approvals.html", session, **await _approvals(orc, session))


@router.post("/approvals/{approval_id}/{decision}")
async def decide(
    orc: Orc, session: Acting, approval_id: UUID, decision: str,
    reason: Annotated[Text, Form(max_length=2000)] = "",
    back: Annotated[Text, Form(max_length=2000)] = "/ui/approvals",
) -> Response:  # fmt: skip
    """Approve or reject, from the approvals page or the job's own (``back``: where to)."""
    approval = await orc.stores.approvals.get(approval_id)
    if not session.principal.sees(approval["tenant_id"]):
        raise ApprovalNotFound(approval_id)
    actor, to = session.principal.actor, _local(back)
    if decision == "approve":
        return await _acted(to, "approved", orc.approve(approval_id, by=actor, reason=reason))
    if decision == "reject":
        return await _acted(to, "rejected", orc.reject(approval_id, by=actor, reason=reason))
    return _back(to, error=f"no such decision: {decision[:40]!r}")


# -- schedules --------------------------------------------------------------------------------


async def _schedules(orc: Orchestrator, session: Session) -> dict[str, Any]:
    return {"schedules": await orc.list_schedules(tenants=session.principal.tenants)}


@router.get("/schedules")
async def schedules_page(request: Request, orc: Orc, session: Viewer) -> HTMLResponse:
    return _page(request, "schedules.html", session, **await _schedules(orc, session))


@router.get("/fragments/schedules")
async def schedules_fragment(request: Request, orc: Orc, session: Viewer) -> HTMLResponse:
    return _page(request, "_schedules.html", session, **await _schedules(orc, session))


@router.post("/schedules/{schedule_name}/{steer}")
async def steer_schedule(orc: Orc, session: Acting, schedule_name: str, steer: str) -> Response:
    """Pause or resume; a schedule the session's tenants do not hold is not found (404)."""
    tenants = session.principal.tenants
    if schedule_name not in {s.name for s in await orc.list_schedules(tenants=tenants)}:
        raise ScheduleNotFound(schedule_name)
    match steer:
        case "pause":
            action = orc.pause_schedule(schedule_name, by=session.principal.actor, tenants=tenants)
            return await _acted("/ui/schedules", f"{schedule_name} paused", action)
        case "resume":
            action = orc.resume_schedule(schedule_name, tenants=tenants)
            return await _acted("/ui/schedules", f"{schedule_name} resumed", action)
    return _back("/ui/schedules", error=f"no such action: {steer[:40]!r}")


# -- flow control -----------------------------------------------------------------------------


async def _flow(orc: Orchestrator, session: Session) -> dict[str, Any]:
    """The keys, to a session of every tenant: their counts cover every tenant's jobs."""
    fleet = session.principal.tenants is None
    return {"fleet": fleet, "keys": await orc.flow_keys() if fleet else []}


@router.get("/flow")
async def flow_page(request: Request, orc: Orc, session: Viewer) -> HTMLResponse:
    return _page(request, "flow.html", session, **await _flow(orc, session))


@router.get("/fragments/flow")
async def flow_fragment(request: Request, orc: Orc, session: Viewer) -> HTMLResponse:
    return _page(request, "_flow.html", session, **await _flow(orc, session))


@router.post("/flow/resume")
async def resume_flow_key(
    orc: Orc, session: Acting, key: Annotated[Text, Form(min_length=1, max_length=200)]
) -> Response:
    """Lift a key's pause and slow-down; a session limited to tenants is refused (403). The key
    is a field of the form, not a part of its address: rendered from a payload, it may hold
    any character, and a key of ``..`` (or ``%2e%2e``) is a path segment a browser removes."""
    session.principal.require_fleet("flow keys")
    return await _acted("/ui/flow", f"{key} resumed", orc.resume_flow_key(key))


# -- token accounting -------------------------------------------------------------------------

#: The usage page's ranges: a name and its seconds back from now (None: everything recorded).
USAGE_RANGES = {"1h": 3600, "24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400, "all": None}
USAGE_GROUPINGS = ("tenant,model", "tenant", "model", "agent", "job_type", "tenant,agent", "job")


@router.get("/usage")
async def usage_page(request: Request, orc: Orc, session: Viewer) -> HTMLResponse:
    """LLM calls and their tokens over a range, grouped; the session's tenants' only."""
    q = request.query_params
    chosen = q.get("range", "24h")
    chosen = chosen if chosen in USAGE_RANGES else "24h"
    by = q.get("by", "tenant,model")
    by = by if by in USAGE_GROUPINGS else "tenant,model"
    seconds = USAGE_RANGES[chosen]
    since = datetime.now(UTC) - timedelta(seconds=seconds) if seconds is not None else None
    totals = await orc.llm_usage(by=by, since=since, tenants=session.principal.tenants, limit=500)
    groups = by.split(",")
    return _page(
        request, "usage.html", session, totals=totals, groups=groups, columns=[
            (g, views.USAGE_COLUMN[g]) for g in groups], ranges=list(USAGE_RANGES),
        chosen=chosen, by=by, groupings=USAGE_GROUPINGS, since=since,
        budgets=sorted(session.principal.own_entries(orc.retry_config.token_budgets).items()),
    )  # fmt: skip


# -- the applications -------------------------------------------------------------------------


async def _applications(orc: Orchestrator, session: Session) -> dict[str, Any]:
    return {"found": await orc.applications(tenants=session.principal.tenants)}


@router.get("/applications")
async def applications_page(request: Request, orc: Orc, session: Viewer) -> HTMLResponse:
    """The applications sharing the database (docs/applications.md), as the API lists them."""
    return _page(request, "applications.html", session, **await _applications(orc, session))


@router.get("/fragments/applications")
async def applications_fragment(request: Request, orc: Orc, session: Viewer) -> HTMLResponse:
    return _page(request, "_applications.html", session, **await _applications(orc, session))


# -- the retry config -------------------------------------------------------------------------


@router.get("/config")
async def config_page(request: Request, orc: Orc, session: Viewer) -> HTMLResponse:
    config, principal = orc.retry_config, session.principal
    types = sorted({*orc.job_types, *config.job_types})
    return _page(
        request, "config.html", session,
        types=[(name, shown_type(config.for_type(name), principal)) for name in types],
        limits=sorted((name, shown_limit(limit, principal))
                      for name, limit in config.limits.items()),
        app_schedule=views.app_schedule, infra_schedule=views.infra_schedule,
    )  # fmt: skip


# -- live -------------------------------------------------------------------------------------


async def signed_in(request: Request) -> None:
    """SignInFirst once the session of a live page has ended (signed out, expired, or its
    token revoked): asked every SESSION_CHECK_SECONDS while it lasts."""
    await viewer(request)


@router.get("/live")
async def live(request: Request, session: Viewer) -> StreamingResponse:
    """The lists' heartbeat: "changed" every two seconds (the page re-reads its fragment),
    while the session lives and the database answers (the stream ends otherwise: the page
    says it is disconnected, and connects again)."""

    async def ticks() -> AsyncIterator[str]:
        yield "retry: 2000\n\n"
        while True:
            await asyncio.sleep(LIST_REFRESH_SECONDS)
            try:
                await signed_in(request)
            except (SignInFirst, DatabaseUnavailable):  # the page shows it is disconnected
                return
            yield "data: changed\n\n"

    return StreamingResponse(ticks(), media_type="text/event-stream")


@router.get("/live/jobs/{job_id}")
async def live_job(request: Request, orc: Orc, session: Viewer, job_id: UUID) -> StreamingResponse:
    """ "changed" the moment the job, or a parent or child its page shows, has new events
    (woken by the database), and once a second while it waits for a retry (its countdown is
    drawn by the page); while the session lives."""
    shown = await _job(orc, session, job_id)
    relatives = [r.job_id for r in (*shown["parents"], *shown["children"])]
    watch: EventWatch = request.app.state.watch
    ping = orc.settings.api_stream_ping_seconds
    check = functools.partial(signed_in, request)

    async def changes() -> AsyncIterator[str]:
        recheck = Recheck(check, SESSION_CHECK_SECONDS)
        try:
            async with watch.watching(job_id, *relatives) as waiter:
                while True:
                    woken = await waiter.wait_checked(ping, recheck=recheck)
                    yield "data: changed\n\n" if woken else ": ping\n\n"
        except (SignInFirst, DatabaseUnavailable):  # the page shows it is disconnected
            return

    return StreamingResponse(changes(), media_type="text/event-stream")


@router.get("/live/jobs/{job_id}/output")
async def live_output(
    request: Request,
    orc: Orc,
    session: Viewer,
    job_id: UUID,
    offset: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
    last_event_id: Annotated[str | None, Header(max_length=30)] = None,
) -> StreamingResponse:
    """The job's output for its page, as the API's stream of it (docs/output.md): each chunk as
    it is written, from ``offset`` (or after ``Last-Event-ID``, the browser's reconnection),
    then ``end`` once the job has finished; while the session lives."""
    await visible_job(orc, session.principal, job_id)
    feeds: OutputFeeds = request.app.state.feeds
    check = functools.partial(signed_in, request)
    return StreamingResponse(
        feeds.stream(
            job_id, resumed_at(offset, last_event_id), check, every=SESSION_CHECK_SECONDS,
            ends=(SignInFirst,),
        ),
        media_type="text/event-stream",
    )  # fmt: skip
