"""Flow control's pure parts (docs/flow-control.md): what a submit says of a job's flow (its
limit, whose template the submit's statement renders into the job's key, ``orc_flow_key_v1``,
the rule's one home; its cost); and the one sentence that says why a job waits.

The database enforces the limits at the claim (migration 0029); this module decides nothing
there, it only shapes what is stored and what is shown.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict

from orchestrator.domain.flow_share import estimate
from retry_config.models import FlowLimit

#: What a waiting job waits for (``orc_flow_waiters.blocked_on``).
Blocked = Literal["concurrency", "requests", "units", "paused", "line", "share"]


@dataclass(frozen=True)
class Flow:
    """What a submit stores for a job under a limit: the limit's name, key template and whose
    share a job waits in (the submit's statement renders the key and names the share from them:
    ``orc_flow_key_v1``, ``orc_flow_share_of_v1``), and the job's cost in the limit's units."""

    limit: str
    template: str
    share_by: str
    cost: int


def flow_of(name: str, limit: FlowLimit, cost: int) -> Flow:
    """The job's flow under the limit ``name``; its ``cost`` (declared or estimated) an estimate
    bounded to ``[1, the units one share may hold]`` (orchestrator.domain.flow_share)."""
    bounded = estimate(cost, limit.units, limit.tenant_share)
    return Flow(limit=name, template=limit.key, share_by=limit.share_by, cost=bounded)


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
