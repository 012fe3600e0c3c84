"""Every path that fails a job for good writes the same failure: one dead letter, then FAILED,
and a ``job.failed`` and a ``last_error`` whose keys are the ones docs/contracts.md lists,
whichever path wrote them (a worker in this process, real PostgreSQL)."""

from __future__ import annotations

import asyncio
import errno
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest
from pydantic import BaseModel

from orchestrator import JobContext, Orchestrator, PermanentError, RetryLater, Status
from tests.support import agent_app, log_guard
from tests.support.external import MessageService, message_service
from tests.support.harness import ROOT, WorkerRun, finished, wait_for

CONTRACTS = (ROOT / "docs" / "contracts.md").read_text()
RELEASE: dict[UUID, asyncio.Event] = {}

#: No budget at either layer: the first failure of each kind is terminal.
CONFIG = """
[defaults]
worker_max_attempts = 1
app_max_retries = 0
job_timeout_seconds = 30
call_timeout_ms = 10000
connect_timeout_ms = 1000
backoff = { base_ms = 50, cap_ms = 400, multiplier = 2, jitter = "none" }
"""


def documented(name: str) -> set[str]:
    """The keys docs/contracts.md lists for an event kind or a record."""
    [row] = [line for line in CONTRACTS.splitlines() if line.startswith(f"| `{name}` |")]
    return set(re.findall(r"`([a-z_]+)`", row.split("|")[2]))


class How(BaseModel):
    how: str


def register(orc: Orchestrator) -> None:
    @orc.job_type("fails")
    async def fails(ctx: JobContext, payload: How) -> None:
        match payload.how:
            case "permanent":
                raise PermanentError("400 Bad Request", code="HTTP_400")
            case "app":
                raise RetryLater(0, "rate limited")
            case "infra":
                raise ConnectionResetError(errno.ECONNRESET, "connection reset by peer")
            case "timeout":
                await asyncio.sleep(30)
            case "hang":  # until released: its worker looks dead meanwhile
                await RELEASE.setdefault(ctx.job_id, asyncio.Event()).wait()


@pytest.fixture
def service() -> Iterator[MessageService]:
    with message_service() as svc:
        yield svc


@pytest.fixture
def orc(make_orc: Callable[..., Orchestrator], tmp_path: Path) -> Orchestrator:
    (tmp_path / "retry_config.toml").write_text(CONFIG)
    orc = make_orc(
        retry_config=tmp_path / "retry_config.toml",
        heartbeat_interval=60,  # none in the test's time: a heartbeat set back stays stale
        drain_seconds=1,
    )
    register(orc)
    agent_app.register(orc)
    return orc


async def last_error_of(db: psycopg.AsyncConnection[Any], job_id: UUID) -> dict[str, Any]:
    cur = await db.execute("SELECT last_error FROM orc_jobs WHERE id = %s", (job_id,))
    row = await cur.fetchone()
    assert row is not None
    return dict(row[0])


@log_guard.fails_jobs(
    "APPROVAL_EXPIRED", "ECONNRESET", "HTTP_400", "JOB_TIMEOUT", "RETRY_LATER", "ZOMBIE"
)
async def test_every_terminal_failure_has_the_same_keys_whichever_path_wrote_it(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any], service: MessageService
) -> None:
    async with WorkerRun(orc) as worker:
        by_path = {
            how: await orc.submit(
                "fails", {"how": how}, timeout_seconds=1 if how == "timeout" else None
            )
            for how in ("permanent", "app", "infra", "timeout")
        }
        await worker.until_finished(*by_path.values())

        by_path["zombie"] = zombie = await orc.submit("fails", {"how": "hang"})

        async def stale() -> bool:
            job = await orc.get_job(zombie)
            if job.status is not Status.RUNNING:
                return False
            await db.execute(
                "UPDATE orc_jobs SET heartbeat_at = now() - interval '1 hour' WHERE id = %s",
                (zombie,),
            )
            return (await orc.maintenance.sweep.run_once()).handled > 0

        await wait_for(stale, timeout=10, interval=0.2)
        RELEASE[zombie].set()  # its completion is refused by the lease

        gated = {"service": service.url, "approval_at": 1}
        by_path["rejected"] = rejected = await orc.submit("agent", gated)
        by_path["expired"] = expired = await orc.submit(
            "agent", {**gated, "approval_expires_in": 0.2}
        )
        for job_id in (rejected, expired):

            async def waiting(job_id: UUID = job_id) -> bool:
                return (await orc.get_job(job_id)).status is Status.WAITING_APPROVAL

            await wait_for(waiting)
        [approval] = [a for a in await orc.approvals() if a["job_id"] == rejected]
        await orc.reject(approval["id"], by="bob", reason="no")
        await asyncio.sleep(0.3)
        # expired by this run, or by the worker's own maintenance lane when it came first
        await orc.maintenance.approval_expiry.run_once()

    failed_keys, error_keys = documented("job.failed"), documented("last_error")
    codes = {}
    for path, job_id in by_path.items():
        job = await finished(orc, job_id)
        assert job.status is Status.FAILED, path
        [failed] = [e for e in await orc.job_events(job_id) if e.kind == "job.failed"]
        assert set(failed.payload) == failed_keys, path
        assert failed.payload["terminal"] is True and failed.payload["layer"] is None, path
        [letter] = [d for d in await orc.dead_letters(limit=100) if d.job_id == job_id]
        assert failed.payload["dead_letter_id"] == str(letter.id), path
        error = await last_error_of(db, job_id)
        assert set(error) == error_keys, path
        assert error["terminal"] is True, path
        codes[path] = (error["classification"], error["code"])
    assert codes == {
        "permanent": ("PERMANENT", "HTTP_400"),
        "app": ("TRANSIENT_APP", "RETRY_LATER"),
        "infra": ("TRANSIENT_INFRA", "ECONNRESET"),
        "timeout": ("PERMANENT", "JOB_TIMEOUT"),
        "zombie": ("TRANSIENT_APP", "ZOMBIE"),
        "rejected": ("PERMANENT", "APPROVAL_REJECTED"),
        "expired": ("PERMANENT", "APPROVAL_EXPIRED"),
    }
