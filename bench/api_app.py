"""The application ``bench/api.py`` serves: one no-op job type."""

from __future__ import annotations

from typing import Any

from orchestrator import JobContext, Orchestrator


def register(orc: Orchestrator) -> None:
    @orc.job_type("noop")
    async def noop(ctx: JobContext, payload: Any) -> None:
        return None


orc = Orchestrator()
register(orc)
