"""Reviewing dead letters: which states a listing shows, and what a bulk action did to each
letter it was given (docs/operations.md, "Dead letters")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from uuid import UUID

from pydantic import BaseModel, computed_field

from orchestrator.domain.errors import InvalidArgument

LETTER_STATES = ("recorded", "discard_requested", "requeued", "discarded")
#: Awaiting review: neither requeued nor discarded yet.
OPEN = ("recorded", "discard_requested")
#: What a listing's ``state`` may name: ``open`` (the default), ``all``, or one state.
SHOWN: dict[str, tuple[str, ...] | None] = {
    "open": OPEN, "all": None, **{state: (state,) for state in LETTER_STATES}
}  # fmt: skip
#: The most letters one bulk action takes (the API's, the CLI's, the page's): more matching
#: ones are left for the next call (``BulkReview.more``).
BULK_MAX = 500

Action = Literal["requeue", "discard-request", "discard-confirm"]
#: The states a letter must be in for each action to take it.
TAKES: dict[Action, tuple[str, ...]] = {
    "requeue": OPEN, "discard-request": ("recorded",), "discard-confirm": ("discard_requested",),
}  # fmt: skip
#: What each action makes of a letter it succeeds on.
BECOMES: dict[Action, str] = {
    "requeue": "requeued", "discard-request": "discard_requested", "discard-confirm": "discarded",
}  # fmt: skip


@dataclass(frozen=True)
class LetterFilter:
    """Which letters a bulk action takes (besides the states it can take): of this job type,
    of this tenant, whose error has ``error`` in its code, message or class (any case); None:
    any. ``LetterFilter()``: every letter."""

    job_type: str | None = None
    tenant_id: str | None = None
    error: str | None = None


def states_shown(state: str) -> tuple[str, ...] | None:
    """The states a listing's ``state`` names (None: every state)."""
    try:
        return SHOWN[state]
    except KeyError:
        raise InvalidArgument(f"state: {state!r} is not one of {', '.join(SHOWN)}") from None


class LetterOutcome(BaseModel):
    """One letter of a bulk action: what became of it (``refused``: by its state or the
    two-person rule, ``detail`` says which; ``not_found``: no such letter this caller sees)."""

    dead_letter_id: UUID
    outcome: Literal["requeued", "discard_requested", "discarded", "refused", "not_found"]
    #: The new job a requeue submitted.
    job_id: UUID | None = None
    detail: str | None = None


class BulkReview(BaseModel):
    """A bulk action's answer: each letter's outcome, in the order taken (each letter in its
    own transaction: one refused leaves the others done)."""

    outcomes: list[LetterOutcome]
    #: More letters match the filter than one call takes (BULK_MAX): call again for them.
    more: bool = False

    @computed_field  # type: ignore[prop-decorator]
    @property
    def done(self) -> int:
        return sum(o.outcome not in ("refused", "not_found") for o in self.outcomes)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def refused(self) -> int:
        return len(self.outcomes) - self.done
