"""What a task sees of its own attempt: ``async def fn(ctx: JobContext, payload)``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from uuid import UUID

from retry_config import JobRetryConfig


@dataclass(frozen=True)
class JobContext:
    job_id: UUID
    job_type: str
    attempt: int  # every claim of this job so far, this one included (never reset)
    run: int  # run of the current dispatch (infrastructure retries)
    retry_count: int  # application retries used before this attempt
    max_retries: int
    lease_token: UUID  # this attempt's run id; every write it makes is fenced by it
    worker: str
    trace_id: str
    agent_id: str | None
    config: JobRetryConfig
    log: logging.LoggerAdapter[logging.Logger]
    _should_abort: Callable[[], bool] = field(repr=False)

    def should_abort(self) -> bool:
        """True once the worker wants this attempt to stop (drain or cancellation).

        Long tasks check it between steps; an ``await`` is cancelled anyway when it happens.
        """
        return self._should_abort()
