"""The fleet at a glance (docs/operations.md, "The fleet at a glance"): what runs, what waits
and for whom, and what is wrong with what to do about it. One read makes it (the facade's
``summary``); the overview's banners, ``orchestrator status`` and ``GET /api/v1/summary`` show
it as it is. Pure: no I/O."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel

from orchestrator.domain.applications import UnservedJobs
from orchestrator.domain.states import TERMINAL, Status


class Process(BaseModel):
    """A process in the worker registry: ``runs`` ``jobs`` (a worker), ``external`` (an API
    server: the external types' dispatches), or None (a release before 0061, which says
    neither); ``stalled``: its heartbeat is older than the stalled-worker timeout."""

    worker_id: int
    worker: str | None
    application: str | None
    runs: str | None
    last_heartbeat: datetime
    stalled: bool


class HeldKey(BaseModel):
    """A flow key that holds its jobs back: paused (by whom, why, until when) or slowed (its
    adaptive rate below 1, after its provider answered 429)."""

    key: str
    limit_name: str
    paused: bool  # (its pause may have ended while its rate is still low)
    paused_until: datetime | None
    paused_by: str | None
    pause_reason: str | None
    rate_factor: float | None
    waiting: int


class Notifications(BaseModel):
    """Where this process sends a failed job's notice and a waiting approval's: the channel
    (never the target itself, which may hold a secret), or None: nobody is told."""

    failures: str | None
    approvals: str | None


class FleetProblem(BaseModel):
    """Something wrong, said as a person acts on it: what, what to do, and the dashboard's page
    where it is fixed."""

    kind: str
    text: str
    fix: str
    link: str


class FleetSummary(BaseModel):
    at: datetime
    #: Unfinished jobs by status (of the reader's tenants).
    jobs: dict[str, int]
    #: Live processes that run jobs (workers), and those that do not (API servers).
    runners: list[Process]
    servers: list[Process]
    stalled: list[Process]
    unserved: list[UnservedJobs]
    held_keys: list[HeldKey]
    #: Dead letters to review, by state (``recorded``, ``discard_requested``).
    letters_to_review: dict[str, int]
    approvals_waiting: int
    notifications: Notifications
    problems: list[FleetProblem]


def unfinished_by_status(
    rows: Iterable[dict[str, Any]], tenants: Collection[str] | None
) -> dict[str, int]:
    """The fleet's rows (status, job_type, tenant, n) counted by status, of ``tenants`` only."""
    counts = {s.value: 0 for s in Status if s not in TERMINAL}
    for row in rows:
        if tenants is None or (row["tenant"] or None) in tenants:
            counts[row["status"]] = counts.get(row["status"], 0) + row["n"]
    return counts


def channel(target: dict[str, Any] | None) -> str | None:
    """What a notification target is called: its channel (``webhook``), never its address."""
    if target is None:
        return None
    return str(target.get("channel") or "set")


def summary(
    *,
    at: datetime,
    jobs: dict[str, int],
    processes: list[Process],
    unserved: list[UnservedJobs],
    held_keys: list[HeldKey],
    letters_to_review: dict[str, int],
    approvals_waiting: int,
    notifications: Notifications,
) -> FleetSummary:
    live = [p for p in processes if not p.stalled]
    return FleetSummary(
        at=at,
        jobs=jobs,
        runners=[p for p in live if p.runs != "external"],
        servers=[p for p in live if p.runs == "external"],
        stalled=[p for p in processes if p.stalled],
        unserved=unserved,
        held_keys=held_keys,
        letters_to_review=letters_to_review,
        approvals_waiting=approvals_waiting,
        notifications=notifications,
        problems=problems(
            processes=processes, unserved=unserved, held_keys=held_keys,
            letters_to_review=letters_to_review, notifications=notifications, at=at,
        ),
    )  # fmt: skip


def problems(
    *,
    processes: list[Process],
    unserved: list[UnservedJobs],
    held_keys: list[HeldKey],
    letters_to_review: dict[str, int],
    notifications: Notifications,
    at: datetime,
) -> list[FleetProblem]:
    """What is wrong, the most urgent first: jobs due that nothing runs, keys held back,
    workers stalled, letters to review, notices going nowhere."""
    found = []
    for u in unserved:
        if u.due:
            found.append(FleetProblem(
                kind="unserved",
                text=f"{u.due} {u.job_type} job(s) due on queue {', '.join(u.queues)}, and no "
                     "live worker runs this type",
                fix="start a worker of an application that runs it (orchestrator worker); "
                    "see Applications",
                link="/ui/applications",
            ))  # fmt: skip
    for k in held_keys:
        if k.paused and k.paused_until is not None:
            until = k.paused_until.astimezone(UTC)
            said = f"paused by {k.paused_by or 'unknown'} until {until:%H:%M:%S} UTC"
            if k.pause_reason:
                said += f": {k.pause_reason}"
            fix = f"resume it on Flow (orchestrator flow resume {k.key}) once the cause is gone"
        else:
            said = f"slowed to {k.rate_factor or 0:.0%} of its rate after its provider's 429s"
            fix = "it recovers by itself as calls succeed; see Flow"
        found.append(FleetProblem(
            kind="flow_key", text=f"Flow key {k.key} ({k.waiting} waiting) is {said}", fix=fix,
            link="/ui/flow",
        ))  # fmt: skip
    stalled = [p for p in processes if p.stalled]
    if stalled:
        names = ", ".join(p.worker or f"#{p.worker_id}" for p in stalled)
        oldest = max((at - p.last_heartbeat).total_seconds() for p in stalled)
        found.append(FleetProblem(
            kind="stalled",
            text=f"{len(stalled)} registered process(es) stalled ({names}): no heartbeat for "
                 f"{oldest:.0f} s",
            fix="check the process (its host, its logs); a dead one is forgotten when the next "
                "worker registers, and its jobs are swept as zombies",
            link="/ui/applications",
        ))  # fmt: skip
    letters = sum(letters_to_review.values())
    if letters:
        found.append(FleetProblem(
            kind="dead_letters", text=f"{letters} dead letter(s) to review",
            fix="requeue or discard each (a discard takes a second person)",
            link="/ui/dead-letters",
        ))  # fmt: skip
    targets = (("failures", notifications.failures), ("approvals", notifications.approvals))
    nobody = [what for what, target in targets if target is None]
    if nobody:
        found.append(FleetProblem(
            kind="notifications",
            text=f"Nobody is notified of {' or '.join(nobody)}: no target is set",
            fix="set ORCHESTRATOR_ESCALATION_TARGET (and ORCHESTRATOR_APPROVAL_TARGET) on the "
                "workers; until then, read the failures and approvals here",
            link="/ui/config",
        ))  # fmt: skip
    return found
