"""The fleet at a glance (``GET /api/v1/summary``): what the overview's banners and
``orchestrator status`` show, from the same read (orchestrator.domain.summary)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from orchestrator.domain.principals import Principal, Scope
from orchestrator.domain.summary import FleetSummary
from orchestrator.interfaces.api.auth import Allowed
from orchestrator.interfaces.api.jobs import Orc

router = APIRouter(prefix="/api/v1")

Reader = Annotated[Principal, Depends(Allowed(Scope.READ))]


@router.get("/summary", tags=["fleet"])
async def summary(orc: Orc, caller: Reader) -> FleetSummary:
    """Unfinished jobs by status; the live processes that run jobs (``runners``), the API
    servers, and those stalled; the waiting jobs no live worker runs, by type with their
    queues; the flow keys paused or slowed, with who paused them and why; the dead letters and
    approvals waiting for a person; where failures and approvals are notified (this server's
    settings); and ``problems``: what is wrong, each with what to do and where. A token limited
    to tenants: only what concerns its tenants (a flow key only when one of their jobs waits on
    it or runs under it)."""
    return await orc.summary(tenants=caller.tenants)
