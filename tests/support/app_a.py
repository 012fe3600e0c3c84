"""Application ``a`` of the several-applications tests (tests/test_applications_fleet.py): the
built-in ``llm_generate`` under its limit ``a_llm`` (one call at a time, fleet-wide) and
``a_note``, which a Graphile Worker producer adds in SQL, under ``a_notes``, with a daily
schedule. Its processes run with ``ORCHESTRATOR_APPLICATION=a`` and
``ORCHESTRATOR_RETRY_CONFIG`` a file of ``config()`` (``--app tests.support.app_a:orc``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orchestrator import JobContext, Orchestrator
from tasks import llm
from tests.support.harness import BASE_CONFIG

#: A's names in the shared tables, by table.
LIMITS = ("a_llm", "a_notes")
JOB_TYPES = ("a_note", "llm_generate")
SCHEDULES = ("a_note",)

TABLE = """
[limits.a_llm]
key = "a_llm:{payload.model}"
concurrency = 1

[limits.a_notes]
key = "a_notes"
requests = 20
interval_seconds = 1

[job_types.llm_generate]
limit = "a_llm"
app_max_retries = 2

[job_types.a_note]
limit = "a_notes"
app_max_retries = 7

[job_types.a_note.schedule]
cron = "0 7 1 1 *"  # early on New Year's Day only: no run during a test
"""


def config(path: Path) -> Path:
    """A's retry config, written at ``path``."""
    path.write_text(BASE_CONFIG.read_text() + TABLE)
    return path


def register(orc: Orchestrator) -> None:
    @orc.job_type("a_note")
    async def a_note(ctx: JobContext, payload: Any) -> Any:
        return payload

    llm.register(orc)


orc = Orchestrator()
register(orc)
