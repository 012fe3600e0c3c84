"""Both layers' delays, as pure functions: exact values, and bounds under every jitter mode."""

import math
import random
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.domain.backoff import (
    app_base_delay_ms,
    app_delay_bounds_ms,
    app_delay_ms,
    doubling_delay,
    graphile_delay_seconds,
    graphile_retries_left,
    parse_retry_after,
)
from retry_config import AdditiveJitter, BackoffConfig, FullJitter, NoJitter, ProportionalJitter

# Graphile Worker's table: delay after attempt N is exp(least(10, N)) seconds.
SEED_TABLE = {1: 2.7, 2: 7.4, 3: 20.1, 4: 54.6, 5: 148.4, 6: 403.4, 7: 1096.6, 8: 2981.0,
              9: 8103.1, 10: 22026.5}  # fmt: skip


@pytest.mark.parametrize(("run", "seconds"), SEED_TABLE.items())
def test_graphile_delay_matches_graphile_workers_table(run: int, seconds: float) -> None:
    assert graphile_delay_seconds(run) == pytest.approx(seconds, abs=0.05)


@pytest.mark.parametrize("run", [10, 11, 25, 1000])
def test_graphile_delay_is_capped_at_exp_10(run: int) -> None:
    assert graphile_delay_seconds(run) == math.exp(10)


def test_graphile_runs_count_total_runs_per_dispatch() -> None:
    # worker_max_attempts = 3 means three runs: retries after run 1 and 2, none after run 3.
    assert [graphile_retries_left(run, 3) for run in (1, 2, 3, 4)] == [True, True, False, False]
    with pytest.raises(ValueError):
        graphile_delay_seconds(0)


LLM = BackoffConfig(base_ms=5_000, cap_ms=300_000, multiplier=3, jitter=NoJitter())


def test_app_delay_is_base_times_multiplier_to_the_n_minus_1_capped() -> None:
    assert [app_base_delay_ms(n, LLM) for n in range(1, 7)] == [
        5_000, 15_000, 45_000, 135_000, 300_000, 300_000,
    ]  # fmt: skip
    with pytest.raises(ValueError):
        app_base_delay_ms(0, LLM)


def test_app_delay_does_not_overflow_for_huge_n() -> None:
    assert app_base_delay_ms(10**9, LLM) == 300_000


def test_multiplier_one_is_constant() -> None:
    flat = BackoffConfig(base_ms=1_000, cap_ms=1_000, multiplier=1, jitter=NoJitter())
    assert {app_base_delay_ms(n, flat) for n in range(1, 50)} == {1_000}


def test_server_hint_is_honoured_and_capped_without_jitter() -> None:
    full = BackoffConfig(base_ms=1_000, cap_ms=60_000, multiplier=2, jitter=FullJitter())
    assert app_delay_ms(1, full, server_hint_seconds=7) == 7_000
    assert app_delay_ms(1, full, server_hint_seconds=3_600) == 60_000
    assert app_delay_ms(5, full, server_hint_seconds=0) == 0


backoffs = st.builds(
    lambda base, extra, mult, jitter: BackoffConfig(
        base_ms=base, cap_ms=base + extra, multiplier=mult, jitter=jitter
    ),
    st.integers(1, 10**6),
    st.integers(0, 10**7),
    st.floats(1, 10),
    st.one_of(
        st.just(NoJitter()),
        st.just(FullJitter()),
        st.floats(0.01, 1).map(lambda r: ProportionalJitter(ratio=r)),
        st.integers(0, 10_000).map(lambda m: AdditiveJitter(max_ms=m)),
    ),
)


@given(backoffs, st.integers(1, 10_000), st.integers(0, 2**32))
def test_app_delay_stays_within_the_jitter_bounds(
    backoff: BackoffConfig, n: int, seed: int
) -> None:
    raw = app_base_delay_ms(n, backoff)
    assert backoff.base_ms <= raw <= backoff.cap_ms
    delay = app_delay_ms(n, backoff, rng=random.Random(seed))
    match backoff.jitter:
        case NoJitter():
            assert delay == raw
        case FullJitter():
            assert 0 <= delay <= raw
        case ProportionalJitter(ratio=r):
            assert raw * (1 - r) - 1e-6 <= delay <= raw * (1 + r) + 1e-6
        case AdditiveJitter(max_ms=m):
            assert raw <= delay <= raw + m


@given(backoffs, st.integers(1, 10_000), st.integers(0, 2**32))
def test_the_bounds_the_dashboard_draws_hold_every_delay_and_are_reached(
    backoff: BackoffConfig, n: int, seed: int
) -> None:
    low, high = app_delay_bounds_ms(n, backoff)
    raw = app_base_delay_ms(n, backoff)
    assert 0 <= low <= high and low <= raw <= high
    assert low <= app_delay_ms(n, backoff, rng=random.Random(seed)) <= high
    # the ends are the drawing's own: a draw at the very bottom or top of the range gives them
    assert app_delay_ms(n, backoff, rng=_Edge(0.0)) == pytest.approx(low)
    assert app_delay_ms(n, backoff, rng=_Edge(1.0)) == pytest.approx(high)


class _Edge(random.Random):
    """Draws always at one end of the range (0: its low end, 1: its high end)."""

    def __init__(self, at: float) -> None:
        super().__init__()
        self.at = at

    def uniform(self, a: float, b: float) -> float:
        return a + (b - a) * self.at


@given(backoffs, st.integers(1, 60))
def test_base_delay_never_decreases_with_n(backoff: BackoffConfig, n: int) -> None:
    assert app_base_delay_ms(n, backoff) <= app_base_delay_ms(n + 1, backoff)


@given(backoffs, st.floats(0, 10**7, allow_nan=False))
def test_server_hint_never_exceeds_the_cap(backoff: BackoffConfig, hint: float) -> None:
    assert 0 <= app_delay_ms(3, backoff, server_hint_seconds=hint) <= backoff.cap_ms


def test_full_jitter_spreads_over_the_interval() -> None:
    full = BackoffConfig(base_ms=1_000, cap_ms=1_000, multiplier=1, jitter=FullJitter())
    rng = random.Random(7)
    draws = [app_delay_ms(1, full, rng=rng) for _ in range(2_000)]
    assert min(draws) < 100 and max(draws) > 900  # not clustered: the herd is spread


def test_parse_retry_after_seconds_and_http_dates() -> None:
    now = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)
    assert parse_retry_after("30", now=now) == 30
    assert parse_retry_after(" 1.5 ", now=now) == 1.5
    assert parse_retry_after("-4", now=now) == 0
    when = format_datetime(now + timedelta(seconds=90), usegmt=True)
    assert parse_retry_after(when, now=now) == pytest.approx(90)
    assert parse_retry_after(format_datetime(now - timedelta(hours=1), usegmt=True), now=now) == 0
    for bad in (None, "", "soon", "nan", "inf"):
        assert parse_retry_after(bad, now=now) is None


# -- reconnecting: first, doubling, capped ---------------------------------------------------


@given(
    st.integers(1, 10_000),
    st.floats(0.001, 100, allow_nan=False),
    st.floats(1, 10_000, allow_nan=False),
)
def test_doubling_delay_doubles_from_first_up_to_the_cap(
    failures: int, first: float, factor: float
) -> None:
    cap = first * factor
    delay = doubling_delay(failures, first=first, cap=cap)
    assert first <= delay <= cap
    assert delay == pytest.approx(min(cap, first * 2.0 ** min(failures - 1, 60)))
    following = doubling_delay(failures + 1, first=first, cap=cap)
    assert following == pytest.approx(min(cap, 2 * delay))


def test_doubling_delay_schedules() -> None:
    assert [doubling_delay(n, first=1, cap=30) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    assert [doubling_delay(n, first=0.5, cap=10) for n in range(1, 7)] == [0.5, 1, 2, 4, 8, 10]
    for bad in ({"failures": 0, "first": 1, "cap": 2}, {"failures": 1, "first": 0, "cap": 2},
                {"failures": 1, "first": 3, "cap": 2}):  # fmt: skip
        with pytest.raises(ValueError):
            doubling_delay(bad.pop("failures"), **bad)
