"""The infrastructure layer: a Procrastinate retry strategy that behaves like Graphile Worker.

A dispatch (one Procrastinate job) gets ``max_attempts`` runs; after the ``run``-th failed run
it waits ``exp(min(10, run))`` seconds. Procrastinate's ``job.attempts`` counts finished runs,
so the run that just failed is ``attempts + 1``.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from procrastinate import BaseRetryStrategy, RetryDecision
from procrastinate.jobs import Job

from orchestrator.backoff import graphile_delay_seconds, graphile_retries_left


class InfraRetry(Exception):
    """Raised by an attempt whose TRANSIENT_INFRA failure is already recorded as RETRY.

    It carries the exact time written to the job row, so Procrastinate schedules the re-run at
    the same instant the job shows as ``next_retry_at``.
    """

    def __init__(self, retry_at: datetime, cause: BaseException) -> None:
        self.retry_at = retry_at
        super().__init__(f"infrastructure retry at {retry_at.isoformat()}: {cause!r}")


class GraphileRetryStrategy(BaseRetryStrategy):
    def __init__(self, max_attempts: int) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        self.max_attempts = max_attempts

    def get_retry_decision(self, *, exception: BaseException, job: Job) -> RetryDecision | None:
        if isinstance(exception, asyncio.CancelledError):
            return None  # an interrupted attempt has already handed its job back
        run = job.attempts + 1
        if not graphile_retries_left(run, self.max_attempts):
            return None
        if isinstance(exception, InfraRetry):
            return RetryDecision(retry_at=exception.retry_at)
        return RetryDecision(
            retry_at=datetime.now(UTC) + timedelta(seconds=graphile_delay_seconds(run))
        )

    def __repr__(self) -> str:
        return f"GraphileRetryStrategy(max_attempts={self.max_attempts})"
