"""decide(): the one place that turns a classified failure and a budget into an outcome."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.domain.classification import Classified, ErrorClass
from orchestrator.domain.policy import Budget, Fail, Layer, Retry, decide, has_app_budget
from retry_config import BackoffConfig, NoJitter

BACKOFF = BackoffConfig(base_ms=1_000, cap_ms=60_000, multiplier=2, jitter=NoJitter())
INFRA = Classified(ErrorClass.TRANSIENT_INFRA, "ECONNRESET")
APP = Classified(ErrorClass.TRANSIENT_APP, "HTTP_429")


def budget(
    retry_count: int = 0, max_retries: int = 3, run: int = 1, max_attempts: int = 5
) -> Budget:
    return Budget(
        retry_count=retry_count, max_retries=max_retries, run=run, max_attempts=max_attempts
    )


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
