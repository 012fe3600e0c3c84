"""What happens after an attempt fails: one pure decision, shared by the runtime and the tests.

The runtime classifies the exception, then asks :func:`decide`; it never computes a delay or
checks a budget anywhere else (the retry owner computes the delay; docs/contracts.md). How many
attempts the job can still reach, the worker contract's ``max_attempts``, is told by the SQL that
writes each claim and failure (orc_max_attempts_v1 and orc_max_attempts_after_v1, claim.sql);
tests/support/attempts.py is its model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import StrEnum

from orchestrator.domain.backoff import app_delay_ms, graphile_delay_seconds, graphile_retries_left
from orchestrator.domain.classification import Classified, ErrorClass
from orchestrator.domain.models import JobState
from retry_config import BackoffConfig


class Layer(StrEnum):
    APP = "app"
    INFRA = "infra"
    #: The provider paused the job's flow key with a hint (a 429 or 529): the job waits for
    #: the pause with a new dispatch and no budget used, its call never having reached the
    #: model (docs/flow-control.md).
    PAUSE = "pause"

    @property
    def retries_used(self) -> int:
        """Application retries a retry at this layer uses: the infrastructure layer re-runs the
        same dispatch, within its own budget of runs; a pause uses none."""
        return 1 if self is Layer.APP else 0


@dataclass(frozen=True)
class Budget:
    """The counters an attempt is judged against."""

    retry_count: int  # application retries already used
    max_retries: int
    run: int  # 1-based run of the current dispatch (Procrastinate's attempts + 1)
    max_runs: int  # runs a dispatch may take (the job's max_attempts: worker_max_attempts)

    @classmethod
    def of(cls, job: JobState) -> Budget:
        """Where the job stands: its retries and its current dispatch's runs."""
        return cls(
            retry_count=job.retry_count,
            max_retries=job.max_retries,
            run=job.dispatch_attempt,
            max_runs=job.max_attempts,
        )


@dataclass(frozen=True)
class Retry:
    layer: Layer
    delay_ms: float


@dataclass(frozen=True)
class Fail:
    reason: str


#: What to do after a failure: retry it (at which layer, after how long) or fail the job.
Verdict = Retry | Fail


#: The longest a provider's hint holds a job back in one pause.
MAX_PAUSE_MS = 86_400_000.0


def decide(
    classified: Classified,
    budget: Budget,
    backoff: BackoffConfig,
    rng: random.Random | None = None,
    *,
    flow_key: str | None = None,
) -> Verdict:
    """``flow_key``: the job's key under a limit, if any: a provider's rate limit or overload
    with a hint then pauses the key, and the job waits for it without spending budget."""
    if flow_key is not None and classified.throttled and classified.retry_after is not None:
        return Retry(Layer.PAUSE, min(MAX_PAUSE_MS, max(0.0, classified.retry_after * 1_000)))
    match classified.error_class:
        case ErrorClass.TRANSIENT_INFRA:
            if graphile_retries_left(budget.run, budget.max_runs):
                return Retry(Layer.INFRA, graphile_delay_seconds(budget.run) * 1_000)
            runs = f"{budget.run}/{budget.max_runs} runs"
            return Fail(f"infrastructure retries exhausted ({runs})")
        case ErrorClass.TRANSIENT_APP:
            if has_app_budget(budget.retry_count, budget.max_retries):
                delay = app_delay_ms(
                    budget.retry_count + 1,
                    backoff,
                    server_hint_seconds=classified.retry_after,
                    rng=rng,
                )
                return Retry(Layer.APP, delay)
            return Fail(f"retry budget exhausted ({budget.retry_count}/{budget.max_retries})")
        case ErrorClass.PERMANENT:
            return Fail("permanent error")
        case ErrorClass.INVALID_OUTPUT:
            return Fail("invalid output")
    raise ValueError(f"{classified.error_class} is not a failure class")


def has_app_budget(retry_count: int, max_retries: int) -> bool:
    """Retry while ``retry_count < max_retries`` (3 retries, 4 runs at most: docs/contracts.md,
    "The budget rule")."""
    return retry_count < max_retries
