"""Application ``b`` of the several-applications tests (tests/test_applications_fleet.py):
``b_work`` under its limit ``b_pool``, ``b_report`` with a daily schedule, and a limit
``b_extra`` that a later version of its config withdraws; retry settings of its own. Its
processes run with ``ORCHESTRATOR_APPLICATION=b`` and ``ORCHESTRATOR_RETRY_CONFIG`` a file of
``config(...)`` (``--app tests.support.app_b:orc``)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from orchestrator import JobContext, Orchestrator
from tests.support.harness import BASE_CONFIG

TABLE = """
[limits.b_pool]
key = "b_pool"
concurrency = @POOL@

[job_types.b_work]
limit = "b_pool"
worker_max_attempts = 3
app_max_retries = 5

[job_types.b_report]
app_max_retries = 0

[job_types.b_report.schedule]
cron = "30 6 1 1 *"  # early on New Year's Day only: no run during a test
"""

EXTRA = """
[limits.b_extra]
key = "b_extra"
concurrency = 2
"""


def config(path: Path, *, pool: int = 3, extra: bool = True, more: str = "") -> Path:
    """B's retry config (``b_pool``'s concurrency ``pool``, ``b_extra`` or not, ``more``
    tables), written at ``path`` whole at once (a process polling it never reads half)."""
    text = BASE_CONFIG.read_text() + TABLE.replace("@POOL@", str(pool))
    text += (EXTRA if extra else "") + more
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    os.replace(part, path)
    return path


def register(orc: Orchestrator) -> None:
    @orc.job_type("b_work")
    async def b_work(ctx: JobContext, payload: Any) -> None:
        await asyncio.sleep(0.05)

    @orc.job_type("b_report")
    async def b_report(ctx: JobContext, payload: Any) -> None:
        return None


orc = Orchestrator()
register(orc)
