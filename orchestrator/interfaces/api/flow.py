"""Flow control (docs/flow-control.md): the keys, with their limits, running and waiting jobs
and pauses; an operator pauses a key or lifts its pause. Keys are shared by the whole fleet
(their counts cover every tenant's jobs), so a token limited to tenants is refused (403); each
job still says what it waits for, to whoever may see the job. A key is rendered from payload
fields, so it may hold a slash: the routes take the rest of the path as the key."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path

from orchestrator.domain.flow import FlowKey
from orchestrator.domain.principals import Principal, Scope
from orchestrator.interfaces.api.auth import Allowed
from orchestrator.interfaces.api.jobs import Orc
from orchestrator.interfaces.api.models import FlowKeys, FlowPause

router = APIRouter(prefix="/api/v1")

Reader = Annotated[Principal, Depends(Allowed(Scope.READ))]
Operator = Annotated[Principal, Depends(Allowed(Scope.OPERATE))]
Key = Annotated[str, Path(min_length=1, max_length=200, description="The flow key.")]
WHAT = "flow keys"


@router.get("/flow/keys", tags=["flow control"])
async def list_keys(orc: Orc, caller: Reader) -> FlowKeys:
    """Every key: its limit, its jobs running and waiting, its window's spending, its pause."""
    caller.require_fleet(WHAT)
    return FlowKeys(keys=await orc.flow_keys())


@router.get("/flow/keys/{key:path}", tags=["flow control"])
async def get_key(key: Key, orc: Orc, caller: Reader) -> FlowKey:
    caller.require_fleet(WHAT)
    return await orc.stores.flow.get(key)


@router.post("/flow/keys/{key:path}/pause", tags=["flow control"])
async def pause(key: Key, body: FlowPause, orc: Orc, caller: Operator) -> FlowKey:
    """No job of the key starts for ``seconds``; the caller is recorded as who paused it."""
    caller.require_fleet(WHAT)
    return await orc.pause_flow_key(key, seconds=body.seconds, reason=body.reason, by=caller.actor)


@router.post("/flow/keys/{key:path}/resume", tags=["flow control"])
async def resume(key: Key, orc: Orc, caller: Operator) -> FlowKey:
    """Lift the key's pause (a provider's or an operator's) and its adaptive slow-down: its
    waiting jobs start at once, as its limits allow."""
    caller.require_fleet(WHAT)
    return await orc.resume_flow_key(key)
