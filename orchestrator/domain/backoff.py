"""Retry delays for both layers, as pure functions.

Infrastructure layer (Graphile Worker's formula, unchanged): after the ``run``-th run of one
dispatch fails, wait ``exp(min(10, run))`` seconds; a dispatch gets ``max_attempts`` runs in all.

Reconnecting (a worker's side loops, its start-up wait for the database): after the ``n``-th
failure in a row, wait ``min(cap, first · 2^(n-1))``.

Application layer: the ``n``-th retry (1-based) waits ``min(cap, base · multiplier^(n-1))`` plus
the type's jitter. A delay the server asked for (``Retry-After``, ``RetryLater``) replaces the
computed one, capped by the type's cap and never jittered: the server knows when it will recover.
"""

from __future__ import annotations

import math
import random
from datetime import datetime

from orchestrator.domain.reply_clock import http_date
from retry_config import AdditiveJitter, BackoffConfig, FullJitter, NoJitter, ProportionalJitter

GRAPHILE_EXPONENT_CAP = 10


def graphile_delay_seconds(run: int) -> float:
    """Seconds Graphile Worker waits after the ``run``-th failed run (1-based)."""
    if run < 1:
        raise ValueError(f"run must be >= 1, got {run}")
    return math.exp(min(GRAPHILE_EXPONENT_CAP, run))


def graphile_retries_left(run: int, max_attempts: int) -> bool:
    """Whether a dispatch whose ``run``-th run just failed gets another run."""
    return run < max_attempts


def doubling_delay(failures: int, *, first: float, cap: float) -> float:
    """Seconds to wait after the ``failures``-th failure in a row (1-based): ``first``,
    doubling each time, never more than ``cap``; safe for any ``failures``."""
    if failures < 1:
        raise ValueError(f"failures must be >= 1, got {failures}")
    if first <= 0 or cap < first:
        raise ValueError(f"want 0 < first <= cap, got first={first}, cap={cap}")
    if failures - 1 >= math.log2(cap / first):
        return cap
    return min(cap, first * 2.0 ** (failures - 1))


def app_base_delay_ms(n: int, backoff: BackoffConfig) -> float:
    """``min(cap, base · multiplier^(n-1))`` without jitter, safe for any ``n``."""
    if n < 1:
        raise ValueError(f"retry number must be >= 1, got {n}")
    if backoff.multiplier > 1 and (n - 1) * math.log(backoff.multiplier) >= math.log(
        backoff.cap_ms / backoff.base_ms
    ):
        return float(backoff.cap_ms)
    return float(min(backoff.cap_ms, backoff.base_ms * backoff.multiplier ** (n - 1)))


def app_delay_ms(
    n: int,
    backoff: BackoffConfig,
    *,
    server_hint_seconds: float | None = None,
    rng: random.Random | None = None,
) -> float:
    """The delay before the ``n``-th application retry, in milliseconds."""
    if server_hint_seconds is not None:
        return min(float(backoff.cap_ms), max(0.0, server_hint_seconds * 1_000))
    low, high = app_delay_bounds_ms(n, backoff)
    return low if low == high else (rng or random).uniform(low, high)


def app_delay_bounds_ms(n: int, backoff: BackoffConfig) -> tuple[float, float]:
    """The least and the most the ``n``-th application retry waits: its jitter's range (the
    dashboard draws the schedule from it)."""
    raw = app_base_delay_ms(n, backoff)
    jitter = backoff.jitter
    match jitter:
        case NoJitter():
            return raw, raw
        case FullJitter():
            return 0.0, raw
        case ProportionalJitter(ratio=ratio):
            return raw * (1 - ratio), raw * (1 + ratio)
        case AdditiveJitter(max_ms=max_ms):
            return raw, raw + float(max_ms)
    raise AssertionError(f"unhandled jitter {jitter!r}")  # pragma: no cover


def parse_retry_after(value: str | None, *, now: datetime) -> float | None:
    """Seconds to wait from an HTTP ``Retry-After`` header: its delta-seconds, or its HTTP-date
    measured from ``now`` (the reply's instant: orchestrator.domain.reply_clock)."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        when = http_date(value)
        if when is None:
            return None
        seconds = (when - now).total_seconds()
    if math.isnan(seconds) or math.isinf(seconds):
        return None
    return max(0.0, seconds)
