"""The application of the schedule tests' worker processes: ``tick``, a job type that runs by
itself every second (croniter's six fields, seconds last) and does nothing.
Its workers take ``ORCHESTRATOR_RETRY_CONFIG=tests/support/retry_config.toml``."""

from __future__ import annotations

from typing import Any

from orchestrator import JobContext, Orchestrator

orc = Orchestrator()


@orc.job_type("tick", cron="* * * * * *")
async def tick(ctx: JobContext, payload: Any) -> None:
    return None
