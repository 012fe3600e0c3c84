"""decide(): the one place that turns a classified failure and a budget into an outcome."""

import functools
import itertools
import math
from typing import Literal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.domain.classification import Classified, ErrorClass
from orchestrator.domain.policy import (
    Budget,
    Fail,
    Layer,
    Retry,
    decide,
    has_app_budget,
)
from retry_config import BackoffConfig, NoJitter
from tests.support.attempts import max_attempts

BACKOFF = BackoffConfig(base_ms=1_000, cap_ms=60_000, multiplier=2, jitter=NoJitter())
INFRA = Classified(ErrorClass.TRANSIENT_INFRA, "ECONNRESET")
APP = Classified(ErrorClass.TRANSIENT_APP, "HTTP_429")


def budget(retry_count: int = 0, max_retries: int = 3, run: int = 1, max_runs: int = 5) -> Budget:
    return Budget(retry_count=retry_count, max_retries=max_retries, run=run, max_runs=max_runs)


def test_the_budget_spec_scenario() -> None:
    # max_retries=3: retry while retry_count < 3; 2 < 3 allows a retry, 3 < 3 does not.
    assert has_app_budget(2, 3) and not has_app_budget(3, 3)
    assert isinstance(decide(APP, budget(retry_count=2), BACKOFF), Retry)
    assert isinstance(decide(APP, budget(retry_count=3), BACKOFF), Fail)


def test_app_retries_use_the_type_backoff_for_the_next_retry_number() -> None:
    delays = [decide(APP, budget(retry_count=n, max_retries=10), BACKOFF) for n in range(7)]
    assert delays == [Retry(Layer.APP, d) for d in (1e3, 2e3, 4e3, 8e3, 16e3, 32e3, 60e3)]


def test_app_retry_honours_the_server_hint_capped() -> None:
    hinted = Classified(ErrorClass.TRANSIENT_APP, "HTTP_429", retry_after=12)
    assert decide(hinted, budget(), BACKOFF) == Retry(Layer.APP, 12_000)
    flood = Classified(ErrorClass.TRANSIENT_APP, "HTTP_429", retry_after=10_000)
    assert decide(flood, budget(), BACKOFF) == Retry(Layer.APP, 60_000)


def test_infra_failures_follow_graphile_and_do_not_touch_the_app_budget() -> None:
    for run in range(1, 5):
        assert decide(INFRA, budget(retry_count=3, run=run), BACKOFF) == Retry(
            Layer.INFRA, math.exp(run) * 1_000
        )
    assert decide(INFRA, budget(run=5), BACKOFF) == Fail(
        "infrastructure retries exhausted (5/5 runs)"
    )


@pytest.mark.parametrize("error_class", [ErrorClass.PERMANENT, ErrorClass.INVALID_OUTPUT])
def test_permanent_and_invalid_output_never_retry(error_class: ErrorClass) -> None:
    assert isinstance(decide(Classified(error_class, "X"), budget(), BACKOFF), Fail)


def test_valid_is_not_a_failure() -> None:
    with pytest.raises(ValueError):
        decide(Classified(ErrorClass.VALID, "OK"), budget(), BACKOFF)


@given(
    st.sampled_from([ErrorClass.TRANSIENT_INFRA, ErrorClass.TRANSIENT_APP, ErrorClass.PERMANENT,
                     ErrorClass.INVALID_OUTPUT]),
    st.integers(0, 50), st.integers(0, 50), st.integers(1, 50), st.integers(1, 50),
)  # fmt: skip
def test_decide_is_exhaustive(
    error_class: ErrorClass, retry_count: int, max_retries: int, run: int, max_attempts: int
) -> None:
    b = budget(retry_count, max_retries, run, max_attempts)
    decision = decide(Classified(error_class, "X"), b, BACKOFF)
    if error_class is ErrorClass.TRANSIENT_INFRA:
        assert isinstance(decision, Retry) == (run < max_attempts)
    elif error_class is ErrorClass.TRANSIENT_APP:
        assert isinstance(decision, Retry) == (retry_count < max_retries)
    else:
        assert isinstance(decision, Fail)
    if isinstance(decision, Retry):
        assert 0 <= decision.delay_ms <= max(BACKOFF.cap_ms, math.exp(10) * 1_000)


# -- max_attempts: the worker contract's cap of attempts -----------------------------------------

#: Every way an attempt can fail, as the policy sees it: a zombie and a step timeout are
#: TRANSIENT_APP, the job timeout is PERMANENT (JOB_TIMEOUT).
FAILURES = [
    Classified(ErrorClass.TRANSIENT_INFRA, "ECONNRESET"),
    Classified(ErrorClass.TRANSIENT_APP, "HTTP_429"),
    Classified(ErrorClass.TRANSIENT_APP, "ZOMBIE"),
    Classified(ErrorClass.TRANSIENT_APP, "STEP_TIMEOUT"),
    Classified(ErrorClass.PERMANENT, "HTTP_400"),
    Classified(ErrorClass.PERMANENT, "JOB_TIMEOUT"),
    Classified(ErrorClass.INVALID_OUTPUT, "OUTPUT_INVALID"),
]


def moment_of(verdict: Retry | Fail) -> Layer | Literal["terminal"]:
    return "terminal" if isinstance(verdict, Fail) else verdict.layer


def history(
    max_runs: int, max_retries: int, failures: list[Classified]
) -> list[tuple[str, int, int]]:
    """(what, attempt, max_attempts) at each claim and after each failure of a job whose tries
    fail in this order, until one is terminal or the failures run out."""
    told: list[tuple[str, int, int]] = []
    attempt = run = retry_count = 0
    for classified in failures:
        attempt, run = attempt + 1, run + 1
        b = budget(retry_count, max_retries, run, max_runs)
        told.append(("claim", attempt, max_attempts(attempt, b, "claim")))
        verdict = decide(classified, b, BACKOFF)
        moment = moment_of(verdict)
        told.append((str(moment), attempt, max_attempts(attempt, b, moment)))
        if isinstance(verdict, Fail):
            break
        if verdict.layer is Layer.APP:  # a new dispatch, whose runs count from 1 again
            retry_count, run = retry_count + 1, 0
    return told


@functools.cache
def most_attempts(attempt: int, run: int, retry_count: int, max_runs: int, max_retries: int) -> int:
    """The most attempts a job claimed at this point reaches if every try fails, by trying
    every failure at every attempt."""
    b = budget(retry_count, max_retries, run, max_runs)
    reached = attempt
    for classified in FAILURES:
        match decide(classified, b, BACKOFF):
            case Retry(layer=Layer.INFRA):
                further = most_attempts(attempt + 1, run + 1, retry_count, max_runs, max_retries)
            case Retry(layer=Layer.APP):
                further = most_attempts(attempt + 1, 1, retry_count + 1, max_runs, max_retries)
            case Fail():
                further = attempt
        reached = max(reached, further)
    return reached


@given(
    st.integers(1, 30), st.integers(1, 6), st.integers(0, 6), st.integers(1, 6),
    st.integers(0, 6),
)  # fmt: skip
def test_max_attempts_at_a_claim_is_the_most_attempts_any_failures_reach(
    attempt: int, run: int, retry_count: int, max_runs: int, max_retries: int
) -> None:
    b = budget(retry_count, max_retries, run, max_runs)
    expected = most_attempts(attempt, run, retry_count, max_runs, max_retries)
    assert max_attempts(attempt, b, "claim") == expected


def test_max_attempts_in_the_budget_spec_scenario() -> None:
    # 3 runs per dispatch, 3 retries: 4 dispatches of 3 runs, 12 attempts at most.
    assert max_attempts(1, budget(0, 3, 1, 3), "claim") == 12
    # an app failure on run 1 gives up the dispatch's two other runs
    assert max_attempts(1, budget(0, 3, 1, 3), Layer.APP) == 10
    assert max_attempts(1, budget(0, 3, 1, 3), Layer.INFRA) == 12
    assert max_attempts(7, budget(3, 3, 3, 3), "claim") == 7  # the last try
    assert max_attempts(5, budget(1, 3, 2, 3), "terminal") == 5


@given(
    st.integers(1, 5), st.integers(0, 5),
    st.lists(st.sampled_from(FAILURES), min_size=1, max_size=40),
)  # fmt: skip
def test_max_attempts_along_any_failures_of_both_layers(
    max_runs: int, max_retries: int, failures: list[Classified]
) -> None:
    """Invariants over random failure sequences (infrastructure failures within a dispatch,
    application retries, zombies, step and job timeouts, permanent errors):
    - a failure is terminal exactly when attempt >= max_attempts, and then they are equal;
    - max_attempts never grows along a history of failures, and a retry's equals the next
      claim's (an infrastructure retry keeps it, an application retry may lower it);
    - no attempt is made beyond any max_attempts told, and a claim is never past it."""
    told = history(max_runs, max_retries, failures)
    for what, attempt, cap in told:
        assert attempt <= cap
        if what != "claim":
            assert (what == "terminal") == (attempt >= cap)
        if what == "terminal":
            assert cap == attempt
    caps = [cap for _, _, cap in told]
    assert caps == sorted(caps, reverse=True)
    for (what, _, cap), (after, _, next_cap) in itertools.pairwise(told):
        if what in (Layer.APP, Layer.INFRA):
            assert after == "claim" and cap == next_cap
    last_attempt = told[-1][1]
    assert all(last_attempt <= cap for cap in caps)
