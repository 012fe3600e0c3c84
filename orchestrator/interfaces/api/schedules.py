"""The schedules (docs/job-types.md, "Schedules"): listed with their next and last run, paused
and resumed by an operator. Each caller sees and steers only its tenants' schedules; one of
another tenant's, or of none when the caller is limited to tenants, is not found (404)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path

from orchestrator.domain.principals import Principal, Scope
from orchestrator.domain.schedules import ScheduleView
from orchestrator.interfaces.api.auth import Allowed
from orchestrator.interfaces.api.jobs import Orc
from orchestrator.interfaces.api.models import Schedules

router = APIRouter(prefix="/api/v1")

Reader = Annotated[Principal, Depends(Allowed(Scope.READ))]
Operator = Annotated[Principal, Depends(Allowed(Scope.OPERATE))]
Name = Annotated[str, Path(min_length=1, max_length=128, description="The schedule's name.")]


@router.get("/schedules", tags=["schedules"])
async def list_schedules(orc: Orc, caller: Reader) -> Schedules:
    """Every schedule of the caller's tenants, by name, with its next and last run."""
    return Schedules(schedules=await orc.list_schedules(tenants=caller.tenants))


@router.post("/schedules/{schedule_name}/pause", tags=["schedules"])
async def pause(schedule_name: Name, orc: Orc, caller: Operator) -> ScheduleView:
    """None of its ticks runs until it is resumed; the caller is recorded as who paused it."""
    return await orc.pause_schedule(schedule_name, by=caller.actor, tenants=caller.tenants)


@router.post("/schedules/{schedule_name}/resume", tags=["schedules"])
async def resume(schedule_name: Name, orc: Orc, caller: Operator) -> ScheduleView:
    """It runs again from its next tick; the ticks it missed while paused never run."""
    return await orc.resume_schedule(schedule_name, tenants=caller.tenants)
