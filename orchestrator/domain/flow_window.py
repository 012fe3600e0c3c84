"""A running job's next LLM call against its flow key's window (docs/flow-control.md, "Every call
admitted"): does it fit now, when will it, and does the job wait for it in place or give its
worker slot back. The model of the rule: production admits a call in one statement, in SQL
(orc_flow_admit_call_v1, functions/flow_calls.sql), and tests/test_flow_admission_model.py holds
the two to the same answers; no production module decides with ``admit_call`` or ``room``
(``CallParked`` and ``parked``, the park a verdict leads to, are production's).

The window is a sliding one: never more than ``requests`` requests, nor ``units`` units, in any
``interval`` seconds. A call's spend holds one request and its estimate in units from the
instant it is admitted until the interval has passed (its estimate is corrected to the reply's
usage once the call returns, never upwards here). Each admission checks the window that ends
at its instant, and spends are placed at their admissions' instants, in order: so every
interval holds no more than the last admission in it checked. A job's first call after its
claim takes the claim's reservation instead of a request more: the reservation moves to the
call's instant, with the call's estimate, if the window without it has room for it there
(moving a spend later, checked as a new one, keeps that rule true). Under a limit with a
``tenant_share``, the call's share must also fit its cap: its own spends of the window, checked
by the same rule against the capped allowance (orchestrator.domain.flow_share.cap).

A call whose room comes within ``WAIT_IN_PLACE_SECONDS`` is admitted for that instant: its spend
is placed there at once (a spend ahead of now), so the calls decided after it meet that room
taken, and it goes then without asking again. The rule above holds for spends placed ahead:
each admission counts every spend placed after its instant less the interval, those ahead of
it included, so an interval's last admitted spend was checked against all the others in it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from orchestrator.domain.flow_share import cap

#: A call whose room comes within this many seconds waits for it in place, its room reserved;
#: one that would wait longer gives its worker slot back, its job parked as a waiter of its key
#: until its room is handed to it. About what a park and its resumption cost the job (a claim, a
#: dispatch, its checkpoints read again), and no more: a slot held waiting is held from all other
#: work, and at saturation every running job's next call has room within a few seconds, which
#: it would wait for holding its slot.
WAIT_IN_PLACE_SECONDS = 0.25

CallBlocked = Literal["requests", "units", "paused", "share"]


@dataclass(frozen=True)
class Spend:
    """A spend in a key's window: when (seconds, on the window's clock), requests, units."""

    at: float
    requests: int
    units: int


@dataclass(frozen=True)
class Allowance:
    """A key's allowance per window, its adaptive rate already applied (None: no such limit)."""

    requests: int | None
    units: int | None
    interval: float


@dataclass(frozen=True)
class Room:
    """Why a spend does not fit now, and the instant it will (``math.inf``: no spend of the
    window frees enough; the room comes with spends not made yet)."""

    blocked: CallBlocked
    at: float
    #: The call would have taken its claim's reservation (which, if its job parks, no call
    #: used: it leaves the window).
    reserved: bool = False


def room(
    allowance: Allowance, spends: Sequence[Spend], now: float, *, requests: int, units: int,
    held: int = 0, held_cost: int = 0,
) -> Room | None:  # fmt: skip
    """None when a spend of ``requests`` and ``units`` fits the window ending at ``now``, beside the
    ``held`` waiters (of ``held_cost`` units) handed room already; else what it waits for and
    when it fits (as far as the window's own spends go). A spend dearer than the whole window
    counts as the whole window: it runs alone in one."""
    window = sorted((s for s in spends if s.at > now - allowance.interval), key=lambda s: s.at)
    blocked: CallBlocked | None = None
    fits_at = now
    for kind, allowed, asked, extra in (
        ("requests", allowance.requests, requests, held),
        ("units", allowance.units, units, held_cost),
    ):
        if allowed is None or asked <= 0:
            continue
        used = [s.requests if kind == "requests" else s.units for s in window]
        excess = sum(used) + extra + min(asked, allowed) - allowed
        if excess <= 0:
            continue
        blocked = blocked or ("requests" if kind == "requests" else "units")
        slid, frees = 0, math.inf
        for spend, amount in zip(window, used, strict=True):
            slid += amount
            if slid >= excess:
                frees = spend.at + allowance.interval
                break
        fits_at = max(fits_at, frees)
    return None if blocked is None else Room(blocked, fits_at)


@dataclass(frozen=True)
class ShareWindow:
    """The call's share's part of the window: its cap (the limit's ``tenant_share``), its own
    spends, and its waiters handed room now."""

    tenant_share: float
    spends: tuple[Spend, ...]
    held: int
    held_cost: int


@dataclass(frozen=True)
class CallWindow:
    """A key's window as a running job's call meets it, read under the key's lock, on a clock
    whose ``now`` is 0 (each spend's ``at`` is minus its age)."""

    allowance: Allowance
    spends: tuple[Spend, ...]  # the window's, but the job's reservation
    held: int  # waiters handed room now (their dispatches due), whose claims have yet to spend it
    held_cost: int
    paused_for: float | None  # seconds the key stays paused for this job (None: it is not)
    #: Units the job's claim reserved and no call has used (None: no reservation).
    reserved: int | None
    #: The job's share's cap and use (None: the limit caps no share).
    share: ShareWindow | None = None


@dataclass(frozen=True)
class Admit:
    """The call goes: a spend of one request and ``units`` (its estimate, at most the whole
    window) ``after`` seconds from now (0: at once; else its room, reserved: it waits in place
    for it); ``reuse``: the claim's reservation moves there to be it."""

    units: int
    reuse: bool
    after: float = 0.0


def admit_call(window: CallWindow, units: int, *, first: bool) -> Admit | Room:
    """May a call estimated at ``units`` go now, or soon enough to wait for it in place (admitted
    for that instant)? Else, why not and when its room comes: its job parks. The job's
    ``first`` call since its claim takes the claim's reservation, if it still has one."""
    allowance, share = window.allowance, window.share
    capped = None if share is None else Allowance(
        cap(allowance.requests, share.tenant_share), cap(allowance.units, share.tenant_share),
        allowance.interval,
    )  # fmt: skip
    allowed = (capped or allowance).units
    ask = Admit(
        units if allowed is None else min(units, allowed),
        reuse=first and window.reserved is not None,
    )
    held, held_cost = (0, 0) if ask.reuse else (window.held, window.held_cost)  # its own room
    wait = room(
        allowance, window.spends, 0.0, requests=1, units=ask.units, held=held, held_cost=held_cost
    )
    if share is not None and capped is not None:
        mine, theirs = (0, 0) if ask.reuse else (share.held, share.held_cost)
        over = room(
            capped, share.spends, 0.0, requests=1, units=ask.units, held=mine, held_cost=theirs
        )
        if over is not None:
            wait = Room("share", max(over.at, wait.at if wait is not None else 0.0))
    if window.paused_for is not None and window.paused_for > 0:
        wait = Room("paused", max(window.paused_for, wait.at if wait is not None else 0.0))
    if wait is None:
        return ask
    if waits_in_place(wait.at):
        return Admit(ask.units, ask.reuse, after=wait.at)
    return Room(wait.blocked, wait.at, ask.reuse)


class CallParked(BaseException):
    """Raised by ``ctx.admit_call`` when the call's room is further off than a wait in place:
    the attempt ends, its job parked as a waiter of ``key`` for a call of ``cost`` units
    (``release``: the claim's reservation, which no call used, leaves the window;
    ``not_before``: seconds from now before which its call cannot go, known for a fallback
    model's key, whose room its own key's pump does not see). A BaseException, so that a
    task's ``except Exception`` cannot swallow it by accident."""

    def __init__(
        self, key: str, blocked: CallBlocked, cost: int, *, release: bool,
        not_before: float | None = None,
    ) -> None:  # fmt: skip
        self.key, self.blocked, self.cost, self.release = key, blocked, cost, release
        self.not_before = not_before
        super().__init__(f"waiting for capacity on {key} ({blocked}) before its next call")


def waits_in_place(wait: float) -> bool:
    """Does a call whose room comes in ``wait`` seconds wait for it in place (True), or park its
    job (False)?"""
    return wait <= WAIT_IN_PLACE_SECONDS


def parked(
    key: str, call_key: str | None, blocked: CallBlocked, units: int, *, release: bool, at: float
) -> CallParked:
    """The park of a job whose call, estimated at ``units`` and admitted against ``call_key``,
    does not go (``blocked``; ``release``: its claim's reservation is given back): in its own
    ``key``'s line, sent for at ``at`` (seconds from now) if the call's key is another (a
    fallback model's, whose room its own key's pump does not see) and the instant is known."""
    elsewhere = call_key != key and math.isfinite(at)
    return CallParked(key, blocked, units, release=release, not_before=at if elsewhere else None)
