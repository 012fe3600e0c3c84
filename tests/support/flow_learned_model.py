"""The model of a learned limit's allowances in effect, which the database's rule
(orc_flow_limit_of_v1, functions/flow_learned.sql) must answer as: tests/test_flow_learned.py and
tests/test_flow_admission_model.py hold the database to it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Allowances:
    """A key's requests and units per interval (None: no such limit)."""

    requests: int | None
    units: int | None


def in_effect(configured: int | None, provider: int | None) -> int | None:
    """The model of one allowance of a key that learns: the configured one, lowered to what the
    provider allows (never raised above it); what the provider allows when none is configured;
    None when neither says (the key has no such limit)."""
    known = [value for value in (configured, provider) if value is not None]
    return min(known) if known else None


def allowances(configured: Allowances, provider: Allowances, *, learn: bool) -> Allowances:
    """The model of a key's allowances: its limit's, and, when the limit learns, each lowered
    to what its provider allows (``in_effect``), as orc_flow_limit_of_v1 must answer."""
    if not learn:
        return configured
    return Allowances(
        in_effect(configured.requests, provider.requests),
        in_effect(configured.units, provider.units),
    )
