"""``orchestrator serve``'s one ASGI application: the HTTP API (orchestrator.interfaces.api) with
the dashboard (orchestrator.interfaces.ui) mounted on it. The one module that knows both: the
dashboard builds on the API's routes, auth and event watch; the API knows nothing of the
dashboard (tests/test_architecture.py holds the arrows)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from starlette.staticfiles import StaticFiles

from orchestrator.app import Orchestrator
from orchestrator.interfaces.api.app import create_api
from orchestrator.interfaces.ui import outage, pages

STATIC = Path(pages.__file__).with_name("static")


def create_app(orc: Orchestrator) -> FastAPI:
    """The API for ``orc`` and its dashboard under ``/ui``, whose pages are answered in HTML,
    the outage page among them."""
    app = create_api(orc)
    app.state.overview = pages.OverviewCache(pages.OVERVIEW_SECONDS)
    app.state.outage_page = outage.answer
    app.include_router(pages.router)
    app.add_exception_handler(pages.SignInFirst, pages.sign_in_first)
    app.mount("/ui/static", StaticFiles(directory=STATIC), name="static")
    return app
