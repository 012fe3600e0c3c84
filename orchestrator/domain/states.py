"""The job state machine, declared once as data.

Every status write in the project is a conditional UPDATE whose ``WHERE status = ANY(...)``
comes from :data:`TRANSITIONS` (see :func:`sources_of`), and ``orchestrator migrate`` copies
the same table into ``orc_state_transitions``, where a trigger rejects any other status change,
including one made by hand in SQL. Nothing else may list transitions.

    BLOCKED ──► PENDING                  (the last job it waits for ended: docs/workflows.md)
       │
       └──► CANCELLED                    (a parent failed under `cancel`, or cancelled)

    PENDING ──► RUNNING ──► COMPLETED
       │         │ ▲ │
       │         │ │ └──► FAILED          (permanent, invalid output, budget spent)
       │         ▼ │
       │        RETRY                    (visible backoff, app or infra layer)
       │         │
       │         ├──► BLOCKED            (a step waits for the children it spawned)
       │         └──► WAITING_APPROVAL ──► PENDING (approved, or rejected down the task's
       │                                   rejection path) | FAILED (rejected, expired)
       ▼
    CANCELLED ◄── BLOCKED | PENDING | RETRY | RUNNING | WAITING_APPROVAL
    COMPLETED | FAILED ◄── PENDING | RETRY   (a waiting job ended by a producer: Graphile
                                             Worker's complete_jobs, permanently_fail_jobs)

BLOCKED is a job that waits for other jobs: its parents (``depends_on``) at its submit, or,
from RUNNING, the children a step of it spawned (``step.wait_for``). It has no dispatch and no
lease, so no worker sees it, and it becomes PENDING, with a dispatch, in the transaction of the
end of the last job it waits for (functions/dependencies.sql); waiting costs no budget.
RUNNING → PENDING is the hand-back of a drained or interrupted attempt: it costs no retry
budget, and neither does resuming after an approval. PENDING | RETRY → COMPLETED | FAILED
end a waiting job that no attempt holds: Graphile Worker's ``complete_jobs`` and
``permanently_fail_jobs`` (docs/graphile.md); a worker's own writes are fenced by their lease,
which a waiting job has not.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum


class Status(StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    RETRY = "RETRY"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    WAITING_APPROVAL = "WAITING_APPROVAL"
    BLOCKED = "BLOCKED"


TRANSITIONS: Mapping[Status, frozenset[Status]] = {
    Status.PENDING: frozenset({Status.RUNNING, Status.CANCELLED, Status.COMPLETED, Status.FAILED}),
    Status.RUNNING: frozenset(
        {
            Status.COMPLETED,
            Status.RETRY,
            Status.FAILED,
            Status.CANCELLED,
            Status.PENDING,
            Status.WAITING_APPROVAL,
            Status.BLOCKED,
        }
    ),
    Status.RETRY: frozenset({Status.RUNNING, Status.CANCELLED, Status.COMPLETED, Status.FAILED}),
    Status.WAITING_APPROVAL: frozenset({Status.PENDING, Status.FAILED, Status.CANCELLED}),
    Status.BLOCKED: frozenset({Status.PENDING, Status.CANCELLED}),
    Status.COMPLETED: frozenset(),
    Status.FAILED: frozenset(),
    Status.CANCELLED: frozenset(),
}

#: Where a submit puts a job: PENDING, or BLOCKED when it has parents to wait for.
INITIAL: frozenset[Status] = frozenset({Status.PENDING, Status.BLOCKED})
TERMINAL: frozenset[Status] = frozenset(s for s, targets in TRANSITIONS.items() if not targets)
CLAIMABLE: frozenset[Status] = frozenset(s for s, t in TRANSITIONS.items() if Status.RUNNING in t)


def is_legal(source: Status, target: Status) -> bool:
    return target in TRANSITIONS[source]


def sources_of(target: Status) -> list[str]:
    """The statuses a job may be in for a write to ``target`` to apply (sorted, for SQL)."""
    return sorted(s.value for s, targets in TRANSITIONS.items() if target in targets)


def transition_rows() -> list[tuple[str, str]]:
    """Every legal (from, to) pair: the rows ``migrate`` writes to ``orc_state_transitions``."""
    return sorted((s.value, t.value) for s, targets in TRANSITIONS.items() for t in targets)


def illegal_pairs() -> list[tuple[str, str]]:
    """Every (from, to) pair the state machine refuses (a status to itself is no transition)."""
    return sorted(
        (s.value, t.value) for s in Status for t in Status if t != s and not is_legal(s, t)
    )
