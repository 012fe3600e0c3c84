"""A provider's rate limits, learned from its replies (docs/flow-control.md, "Limits learned from
the provider"): what a reply's headers say. Pure: the worker parses each reply's headers here,
and the key's row keeps what was learned, under the key's lock (orchestrator.storage.flow). The
allowances a key then has are the database's rule alone (orc_flow_limit_of_v1, which every
claim, call and reader of a key meets; tests/test_flow_learned.py holds it to a model).

Anthropic sends ``anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,
remaining,reset}``, its ``reset`` an RFC 3339 time; OpenAI and the servers compatible with it
send ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``, their ``reset`` a duration
(``1s``, ``6m0s``, ``20ms``). Either way ``reset`` is when the limit is replenished, and a
limit is per the provider's own period (a minute for both), which the key's limit names in
``interval_seconds``. A header that does not parse is left out: a provider's odd header never
fails a call. An RFC 3339 ``reset`` is measured from the reply's own ``Date``, the provider's
clock, not the worker's (orchestrator.domain.reply_clock): a worker's skewed clock can neither
cancel nor stretch the hold.

A key's units are tokens counted as input plus output (its calls' usage), so they are learned
from the ``input-tokens`` and ``output-tokens`` limits together (their sum), else from the
``tokens`` limit. A limit with nothing remaining, each of them, holds the key until its reset.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from orchestrator.domain.reply_clock import reply_now
from retry_config.models import MAX_VALUE

#: The longest hold a reply may ask for (a day, as the longest pause a 429 may).
MAX_HOLD_SECONDS = 86_400.0

#: The limits a reply may report, by their names in Anthropic's headers.
LIMITS = ("requests", "tokens", "input-tokens", "output-tokens")

_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class Reading:
    """One limit, as a reply reported it: its size per the provider's period, what remains of
    it, and the seconds until it is replenished (each None when not said)."""

    limit: int | None
    remaining: int | None
    reset: float | None


@dataclass(frozen=True)
class Learned:
    """What one reply's headers teach about its key: the provider's limits of requests and of
    units (tokens) per its period, and how long the key must hold (the latest reset of the
    limits with nothing remaining, ``spent``; None: none is spent)."""

    requests: int | None
    units: int | None
    hold: float | None
    spent: tuple[str, ...] = ()

    @property
    def reason(self) -> str:
        """Why the key holds, as its pause says."""
        return f"the provider's {', '.join(self.spent)} limit has nothing remaining until its reset"


def readings(headers: Mapping[str, str], *, now: datetime) -> dict[str, Reading]:
    """The limits the headers report, by name (``requests``, ``tokens``, ``input-tokens``,
    ``output-tokens``), from Anthropic's headers, else OpenAI's; a limit none of whose three
    headers parses is left out. Header names in any case. ``now``: the worker's clock, which a
    reset given as a time is measured against only when the reply has no ``Date`` (else the
    ``Date``: orchestrator.domain.reply_clock)."""
    lower = {str(name).lower(): value for name, value in headers.items()}
    now = reply_now(lower, now=now)
    found: dict[str, Reading] = {}
    for name in LIMITS:
        for limit, remaining, reset in (
            (f"anthropic-ratelimit-{name}-{part}" for part in ("limit", "remaining", "reset")),
            (f"x-ratelimit-{part}-{name}" for part in ("limit", "remaining", "reset")),
        ):
            reading = Reading(
                _count(lower.get(limit), least=1),
                _count(lower.get(remaining), least=0),
                _reset(lower.get(reset), now),
            )
            if reading != Reading(None, None, None):
                found[name] = reading
                break
    return found


def learned(headers: Mapping[str, str], *, now: datetime) -> Learned | None:
    """What the headers teach (None: they report no limit); ``now`` as :func:`readings`
    takes it."""
    found = readings(headers, now=now)
    if not found:
        return None

    def limit(name: str) -> int | None:
        reading = found.get(name)
        return None if reading is None else reading.limit

    split = [limit("input-tokens"), limit("output-tokens")]
    if all(part is not None for part in split):
        units: int | None = min(MAX_VALUE, sum(part or 0 for part in split))
    else:
        units = limit("tokens") or next((part for part in split if part is not None), None)
    spent = tuple(
        name for name, r in found.items() if r.remaining == 0 and r.reset is not None
    )  # fmt: skip
    hold = max((found[name].reset or 0.0 for name in spent), default=None)
    return Learned(limit("requests"), units, hold, spent)


def _count(value: object, *, least: int) -> int | None:
    """A whole count of at least ``least`` (a fraction rounded down; at most MAX_VALUE), or
    None."""
    number = _number(value)
    if number is None or number < least:
        return None
    return min(MAX_VALUE, math.floor(number))


def _reset(value: object, now: datetime) -> float | None:
    """Seconds until a reset given as a duration (``6m0s``, ``20ms``), as seconds (``12``), or
    as an RFC 3339 time; never negative, at most MAX_HOLD_SECONDS; None if it parses as none."""
    if not isinstance(value, str):
        return None
    text = value.strip()
    seconds = _number(text)
    if seconds is None and text and _DURATION.sub("", text) == "":
        seconds = sum(float(n) * _UNIT_SECONDS[unit] for n, unit in _DURATION.findall(text))
    if seconds is None:
        try:
            when = datetime.fromisoformat(text)
        except ValueError:
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - now).total_seconds()
    if not math.isfinite(seconds):
        return None
    return min(MAX_HOLD_SECONDS, max(0.0, seconds))


def _number(value: object) -> float | None:
    """A finite number from a numeric string (not a bool), or None."""
    if not isinstance(value, str):
        return None
    try:
        number = float(value.strip())
    except (ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None
