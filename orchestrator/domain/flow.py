"""Flow control's pure parts (docs/flow-control.md): a job's key, rendered from its limit's
template at submit; the share it waits in; and the one sentence that says why a job waits.

The database enforces the limits at the claim (migration 0029); this module decides nothing
there, it only shapes what is stored and what is shown.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from orchestrator.domain.flow_share import estimate
from retry_config.models import FlowLimit

_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
#: The longest key stored: a key is a name, not a payload.
MAX_KEY = 200

#: What a waiting job waits for (``orc_flow_waiters.blocked_on``).
Blocked = Literal["concurrency", "requests", "units", "paused", "line", "share"]


class FlowKeyError(ValueError):
    """The key cannot be rendered for this job (a payload field the template names is
    missing, or not a scalar)."""


@dataclass(frozen=True)
class Flow:
    """What a submit stores for a job under a limit: its key, the limit's name, its cost in
    the limit's units and the share it waits in."""

    key: str
    limit: str
    cost: int
    share: str


def render_key(
    template: str, *, job_type: str, tenant_id: str | None, agent_id: str | None, payload: Any
) -> str:
    """The template with each ``{...}`` filled: ``job_type``, ``tenant``, ``agent`` (``-``
    when the job has none) or ``payload.<field>[.<field>...]``, a scalar the payload must
    hold. Everything else is literal. Raises FlowKeyError naming what is missing."""

    def fill(match: re.Match[str]) -> str:
        name = match.group(1)
        if name == "job_type":
            return job_type
        if name == "tenant":
            return tenant_id or "-"
        if name == "agent":
            return agent_id or "-"
        value: Any = payload
        for part in name.removeprefix("payload.").split("."):
            if not isinstance(value, dict) or part not in value:
                raise FlowKeyError(f"the flow key {template!r} needs {name}, which is missing")
            value = value[part]
        if isinstance(value, dict | list) or value is None:
            raise FlowKeyError(f"the flow key {template!r} needs {name} to be a string or number")
        return str(value).lower() if isinstance(value, bool) else str(value)

    key = _PLACEHOLDER.sub(fill, template)
    if len(key) > MAX_KEY:
        raise FlowKeyError(f"the flow key is {len(key)} characters long, over {MAX_KEY}")
    return key


def flow_of(
    name: str,
    limit: FlowLimit,
    *,
    job_type: str,
    tenant_id: str | None,
    agent_id: str | None,
    payload: Any,
    cost: int,
) -> Flow:
    """The job's flow under the limit ``name``; its ``cost`` (declared or estimated) an estimate
    bounded to ``[1, the units one share may hold]`` (orchestrator.domain.flow_share)."""
    key = render_key(
        limit.key, job_type=job_type, tenant_id=tenant_id, agent_id=agent_id, payload=payload
    )
    share = {"tenant": tenant_id, "agent": agent_id, "none": None}[limit.share_by]
    bounded = estimate(cost, limit.units, limit.tenant_share)
    return Flow(key=key, limit=name, cost=bounded, share=share or "")


def waiting_reason(key: str, blocked_on: Blocked, paused_until: datetime | None) -> str:
    """Why a waiting job has not started: ``waiting for capacity on <key> (<what>)``."""
    what = {
        "concurrency": "its concurrency limit is reached",
        "requests": "its requests per interval are spent",
        "units": "its units per interval are spent",
        "line": "in line behind other jobs of the key",
        "share": "its share of the key (tenant_share) is in use",
        "paused": "paused",
    }[blocked_on]
    if blocked_on == "paused" and paused_until is not None:
        what = f"paused until {paused_until.isoformat(timespec='seconds')}"
    return f"waiting for capacity on {key} ({what})"


class FlowKey(BaseModel):
    """A key as it stands: its limit, its jobs running and waiting, what its window spent, its
    pause and its adaptive rate (1: full; a 429 without a hint halves it)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    key: str
    limit_name: str
    concurrency: int | None
    #: Its allowances per interval in effect: its limit's, lowered to what its provider allows
    #: when the limit learns (``learn``); None: no such limit.
    requests: int | None
    units: int | None
    interval_seconds: float | None
    #: Its limit learns the provider's limits from its replies' rate-limit headers.
    learn: bool = False
    #: The provider's limits of requests and units per its period, as its replies last said.
    learned_requests: int | None = None
    learned_units: int | None = None
    #: When what it learned last changed.
    learned_at: datetime | None = None
    running: int
    waiting: int
    requests_used: int
    units_used: int
    rate_factor: float | None
    #: 429s and 529s its provider answered, since the key was first used.
    throttled: int
    paused_until: datetime | None
    pause_reason: str | None
    #: ``provider`` (a 429's hint) or the operator who paused it.
    paused_by: str | None
