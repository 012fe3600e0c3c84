"""The dashboard's page while the database is away (503): what is wrong, that the page tries
again on its own, and a link to try now; never the API's problem+json. It reads nothing from the
database (not even the session): it has to show when nothing else can."""

from __future__ import annotations

from pathlib import Path

import jinja2
from starlette.responses import HTMLResponse

RETRY_SECONDS = 5
_TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).with_name("templates")), autoescape=True
)


def outage_page(path: str, reason: str) -> HTMLResponse:
    """The page for a request of ``path`` (a dashboard one) while the database is away."""
    again = path if path.startswith("/ui") and not path.startswith("/ui/fragments") else "/ui"
    body = _TEMPLATES.get_template("outage.html").render(
        retry_seconds=RETRY_SECONDS, again=again, reason=reason
    )
    return HTMLResponse(body, status_code=503, headers={"Retry-After": str(RETRY_SECONDS)})


def answer(path: str, reason: str) -> HTMLResponse | None:
    """The outage page for a dashboard page's path; None for any other (the API answers it)."""
    return outage_page(path, reason) if is_dashboard(path) else None


def is_dashboard(path: str) -> bool:
    """Whether ``path`` is one of the dashboard's pages (answered in HTML), not a static file."""
    return (path == "/ui" or path.startswith("/ui/")) and not path.startswith("/ui/static/")
