"""The fleet at a glance (orchestrator.domain.summary): read once here, for the overview's
banners, ``orchestrator status`` and ``GET /api/v1/summary``. Every count is of the reader's
tenants; the reads use partial indexes and the small registry tables, never the finished
jobs."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from datetime import UTC, datetime

from orchestrator.domain.summary import FleetSummary, Notifications, channel, summary
from orchestrator.domain.summary import unfinished_by_status as by_status
from orchestrator.facade.arguments import storable, tenants_named
from orchestrator.facade.lifecycle import Lifecycle
from orchestrator.settings import Settings


async def fleet_summary(
    lifecycle: Lifecycle, settings: Settings, *, tenants: Collection[str] | None
) -> FleetSummary:
    storable(tenants=tenants)
    tenants_named(tenants=tenants)
    stores, live = lifecycle.stores, settings.stalled_worker_seconds
    unfinished, processes, unserved, held, letters, approvals = await asyncio.gather(
        stores.fleet.unfinished(zombie_threshold=settings.zombie_threshold, tenants=tenants),
        stores.dashboard.processes(seconds=live),
        stores.applications.unserved(seconds=live, tenants=tenants),
        stores.dashboard.held_keys(tenants=tenants),
        stores.dashboard.letters_to_review(tenants=tenants),
        stores.dashboard.approvals_waiting(tenants=tenants),
    )
    return summary(
        at=datetime.now(UTC),
        jobs=by_status(unfinished.jobs, tenants),
        processes=processes,
        unserved=unserved,
        held_keys=held,
        letters_to_review=letters,
        approvals_waiting=approvals,
        notifications=Notifications(
            failures=channel(settings.escalation_target),
            approvals=channel(settings.approval_target or settings.escalation_target),
        ),
    )
