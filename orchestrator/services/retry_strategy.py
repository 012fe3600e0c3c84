"""Graphile Worker's infrastructure retries, as a Procrastinate retry strategy.

A dispatch gets ``max_attempts`` runs; after the ``run``-th failed run it waits
``exp(min(10, run))`` seconds. Procrastinate's ``job.attempts`` counts finished runs, so the run
that just failed is ``attempts + 1``. The maintenance services' ticks are Procrastinate tasks with
this strategy, which the worker asks when one fails; a job's own failures are decided by the one
policy, ``orchestrator.domain.policy.decide``, with the same formula.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from procrastinate import BaseRetryStrategy, RetryDecision
from procrastinate.jobs import Job

from orchestrator.domain.backoff import graphile_delay_seconds, graphile_retries_left


class GraphileRetryStrategy(BaseRetryStrategy):
    def __init__(self, max_attempts: int) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        self.max_attempts = max_attempts

    def get_retry_decision(self, *, exception: BaseException, job: Job) -> RetryDecision | None:
        if isinstance(exception, asyncio.CancelledError):
            return None  # a stopped worker's task: the next tick runs it again
        run = job.attempts + 1
        if not graphile_retries_left(run, self.max_attempts):
            return None
        return RetryDecision(
            retry_at=datetime.now(UTC) + timedelta(seconds=graphile_delay_seconds(run))
        )

    def __repr__(self) -> str:
        return f"GraphileRetryStrategy(max_attempts={self.max_attempts})"
