"""Fairness inside a flow key (docs/flow-control.md, "Fairness"): which share goes next, what a
start or a call is charged, and the most of the key one share may hold. Pure; the database
applies the same rules under the key's lock (functions/flow_pump.sql: ``orc_flow_pump_v1`` picks,
``orc_flow_estimate_v1``, ``orc_flow_charged_v1`` and ``orc_flow_charge_v1`` charge,
``orc_flow_cap_v1`` and ``orc_flow_share_capacity_v1`` cap), and tests/test_flow_share.py holds
the policy's two promises by simulation: no share holds more than its cap, and shares that wait
converge to their weights.

A share (a tenant, or an agent with ``share_by = "agent"``) has a *virtual time*: what its calls
took of the key, over its weight. The next to go is the waiting share with the least virtual time
that its cap does not hold back. A start or call is charged its *estimate* when it is admitted
(the declared or estimated cost, bounded to ``[1, cap of units]``: a declared 0 cannot make a
share free, nor a huge one take more than a share may hold), and corrected to what it really
spent (at least 1) once its reply reports it; without ``units`` each start or call counts 1. So a
share's virtual time follows its real spend whatever it declares.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping


def cap(allowed: int | None, tenant_share: float | None) -> int | None:
    """The most of an allowance (``concurrency``, ``requests`` or ``units``) one share may hold:
    ``tenant_share`` of it, at least 1; all of it without a cap (None: no such allowance)."""
    if allowed is None or tenant_share is None:
        return allowed
    return max(1, math.floor(allowed * tenant_share))


def estimate(declared: int | None, units: int | None, tenant_share: float | None) -> int:
    """What a job's start (or a call) reserves and is charged before its reply: its declared or
    estimated cost, at least 1 and at most the units one share may hold."""
    bounded = max(1, declared if declared is not None else 1)
    most = cap(units, tenant_share)
    return bounded if most is None else min(bounded, most)


def charge(spent: int, units: int | None) -> int:
    """What ``spent`` units (an estimate, or a reply's real usage) count for fairness: at least
    1 under a limit with units; a limit without them counts each start or call as 1."""
    return 1 if units is None else max(1, spent)


def next_share(
    vtimes: Mapping[str, float], waiting: Iterable[str], held_back: Iterable[str] = ()
) -> str | None:
    """The share whose job goes next: of the ``waiting`` shares its cap does not hold back, the
    one of least virtual time (ties by name); None when there is none."""
    blocked = set(held_back)
    candidates = [s for s in waiting if s not in blocked]
    return min(candidates, key=lambda s: (vtimes[s], s), default=None)


def joining_vtime(vtimes: Mapping[str, float], waiting: Iterable[str], own: float) -> float:
    """A share that starts waiting starts level with the shares already waiting (its own
    virtual time if that is later): idle time is not saved up as credit."""
    floor = min((vtimes[s] for s in waiting), default=None)
    return own if floor is None else max(own, floor)
