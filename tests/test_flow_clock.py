"""No worker's clock decides when a flow key's pause ends or when a job runs again
(docs/flow-control.md, "Pauses"; docs/contracts.md, "Times"). Worker processes whose wall clock
is an hour fast, or an hour slow (libfaketime, their monotonic clock untouched), meet 429s from
the local LLM server with a ``Retry-After`` in seconds, an HTTP-date ``Retry-After`` and
Anthropic's reset headers, learn a spent limit from a success's headers, and sweep a zombie.
Each time the key's stored pause end and the job's next run are the database's clock plus what
the server asked (within what a loaded machine meets), and the job runs again after the pause.
Before, a worker an hour fast turned an absolute hint into no pause at all and retried its job
an hour after the pause, and an hour slow paused the key for an hour."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import psycopg
import pytest

from demo import llm_server as llm
from orchestrator import Orchestrator
from tests.support import agent_app, flow_app, tools
from tests.support.harness import config_with, wait_for
from tests.support.workers import WorkerProcess
from tests.test_flow_calls import KEY, NOT_ZOMBIES

APP = "tests.support.flow_app:orc"
AGENT_APP = "tests.support.agent_app:orc"
ASK = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
SKEWS = ["+1h", "-1h"]
HINT = 4  # seconds the server asks to wait
#: How much later, or earlier, than the hint a stored time may be: a hint read against the
#: reply's ``Date`` (whole seconds) is up to a second longer, a loaded machine writes it late,
#: and what was written is compared with a time the database stamped nearby.
LATE = 3.0
EARLY = 1.0


def skewed_worker(
    stack: contextlib.ExitStack, dsn: str, skew: str, app: str, **env: Any
) -> WorkerProcess:
    """A worker process whose wall clock is ``skew`` off (``+1h``: an hour fast)."""
    return stack.enter_context(WorkerProcess(dsn, app, **env, **tools.faketime(skew)))


def flow_worker(
    stack: contextlib.ExitStack, dsn: str, skew: str, config: Any, server: llm.LocalLLM
) -> WorkerProcess:
    return skewed_worker(
        stack, dsn, skew, APP, ORCHESTRATOR_RETRY_CONFIG=config, ANTHROPIC_BASE_URL=server.url,
        ANTHROPIC_API_KEY=KEY, **NOT_ZOMBIES,
    )  # fmt: skip


def after(later: datetime, earlier: datetime) -> float:
    return (later - earlier).total_seconds()


async def completed(orc: Orchestrator, job_id: UUID, timeout: float = 30) -> None:
    async def done() -> bool:
        return (await orc.get_job(job_id)).finished_at is not None

    await wait_for(done, timeout=timeout)
    assert (await orc.get_job(job_id)).status.value == "COMPLETED"


async def next_run(db: psycopg.AsyncConnection[Any], job_id: UUID) -> tuple[datetime, datetime]:
    """The job's next_retry_at and its dispatch's scheduled_at, read while it waits in RETRY."""
    seen: list[tuple[datetime, datetime]] = []

    async def retrying() -> bool:
        cur = await db.execute(
            "SELECT j.next_retry_at, p.scheduled_at FROM orc_jobs AS j"
            "  JOIN procrastinate_jobs AS p ON p.id = j.procrastinate_job_id"
            " WHERE j.id = %s AND j.status = 'RETRY'",
            (job_id,),
        )
        seen.extend(await cur.fetchall())
        return bool(seen)

    await wait_for(retrying, timeout=30, interval=0.02)
    return seen[0]


async def parked(
    db: psycopg.AsyncConnection[Any], job_id: UUID
) -> tuple[datetime, datetime, datetime]:
    """While a job waits parked on its key, sent ahead: when its dispatch is due, and its key's
    pause end and the time the key learned its provider's limit (both stamped by the
    database)."""
    seen: list[tuple[datetime, datetime, datetime]] = []

    async def waiting() -> bool:
        cur = await db.execute(
            "SELECT p.scheduled_at, k.paused_until, k.learned_at FROM orc_jobs AS j"
            "  JOIN orc_flow_waiters AS w ON w.job_id = j.id"
            "  JOIN orc_flow_keys AS k ON k.key = j.flow_key"
            "  JOIN procrastinate_jobs AS p ON p.id = j.procrastinate_job_id"
            " WHERE j.id = %s AND j.status = 'PENDING' AND p.scheduled_at IS NOT NULL",
            (job_id,),
        )
        seen.extend(await cur.fetchall())
        return bool(seen)

    await wait_for(waiting, timeout=30, interval=0.02)
    return seen[0]


LIMITED = {
    "seconds": llm.Status(429, "rate_limit_error", retry_after=str(HINT)),
    "http-date": llm.Status(429, "rate_limit_error", retry_at=HINT),
    "reset": llm.Status(429, "rate_limit_error", reset_in=HINT),
}


@pytest.mark.parametrize("skew", SKEWS)
@pytest.mark.parametrize("hint", list(LIMITED))
async def test_a_429_pauses_its_key_and_retries_its_job_by_the_database_s_clock(
    dsn: str,
    make_orc: Callable[..., Orchestrator],
    db: psycopg.AsyncConnection[Any],
    skew: str,
    hint: str,
) -> None:
    orc = make_orc(retry_config=flow_app.CONFIG)
    flow_app.register(orc)
    await orc.open()
    with llm.serve(api_key=KEY) as server, contextlib.ExitStack() as stack:
        server.script("m", [LIMITED[hint], llm.Text("ok")])
        flow_worker(stack, dsn, skew, flow_app.CONFIG, server)
        job_id = await orc.submit("llm_generate", ASK)
        retry_at, scheduled_at = await next_run(db, job_id)
        await completed(orc, job_id)
        assert server.requests["m"] == 2
    events = await orc.job_events(job_id)
    [failed] = [e for e in events if e.kind == "job.failed"]
    assert failed.payload["layer"] == "pause"
    [key] = await orc.flow_keys("anthropic:m")
    assert key.paused_until is not None and key.paused_by == "provider"
    for stored in (key.paused_until, retry_at, scheduled_at):  # the failure's write: a db time
        assert HINT - EARLY <= after(stored, failed.at) <= HINT + LATE, (stored, failed.at)
    [retried] = [e for e in events if e.kind == "job.retry_scheduled"]
    assert datetime.fromisoformat(retried.payload["available_at"]) == retry_at
    again = [e.at for e in events if e.kind == "job.running"][1]
    assert again >= retry_at and again >= key.paused_until - timedelta(milliseconds=50)


@pytest.mark.parametrize("skew", SKEWS)
async def test_a_spent_limit_learned_from_a_reply_holds_its_key_by_the_database_s_clock(
    dsn: str,
    make_orc: Callable[..., Orchestrator],
    db: psycopg.AsyncConnection[Any],
    skew: str,
) -> None:
    """The server allows one request per 4 s; a job's first call's reply says none remains until
    then. The key holds until the reset, by the database's clock: the job's second call parks
    until then, and goes through when it resumes, without meeting a 429."""
    config = flow_app.config("learn = true\ninterval_seconds = 1")
    orc = make_orc(retry_config=config)
    flow_app.register(orc)
    await orc.open()
    with llm.serve(
        api_key=KEY, requests_per_window=1, window_seconds=HINT
    ) as server, contextlib.ExitStack() as stack:  # fmt: skip
        flow_worker(stack, dsn, skew, config, server)
        job_id = await orc.submit("chat", {"model": "m", "calls": 2})
        resumes_at, paused_until, learned_at = await parked(db, job_id)
        await completed(orc, job_id)
        assert server.rate_limited == 0 and server.accepted == 2
    [key] = await orc.flow_keys("anthropic:m")
    assert key.paused_by == "provider" and key.learned_requests == 1
    for stored in (paused_until, resumes_at):  # from when the lesson was written: a db time
        assert HINT - EARLY <= after(stored, learned_at) <= HINT + LATE, stored
    events = await orc.job_events(job_id)
    assert "job.failed" not in [e.kind for e in events]
    again = [e.at for e in events if e.kind == "job.running"][1]
    assert again >= resumes_at >= paused_until


@pytest.mark.parametrize("skew", SKEWS)
async def test_the_zombie_sweep_retries_by_the_database_s_clock(
    dsn: str, make_orc: Callable[..., Orchestrator], skew: str
) -> None:
    """A worker dies mid-job; a worker whose clock is off sweeps the zombie: its retry is due
    its backoff after the database's now, and the same worker runs it then."""
    orc = make_orc(retry_config=config_with(agent_app.TABLE))
    agent_app.register(orc)
    await orc.open()
    plan = {"service": "http://127.0.0.1:9", "steps": 1, "send_at": [], "slow_step": 1}
    with WorkerProcess(dsn, AGENT_APP) as dying:
        job_id = await orc.submit("agent", plan)

        async def running() -> bool:
            return (await orc.get_job(job_id)).status.value == "RUNNING"

        await wait_for(running)
        dying.signal(signal.SIGKILL)
        dying.wait()
    with contextlib.ExitStack() as stack:
        skewed_worker(stack, dsn, skew, AGENT_APP)
        await completed(orc, job_id)
    events = await orc.job_events(job_id)
    [detected] = [e for e in events if e.kind == "job.zombie_detected"]
    assert detected.payload["reason"] == "heartbeat"
    [retried] = [e for e in events if e.kind == "job.retry_scheduled"]
    retry_at = datetime.fromisoformat(retried.payload["available_at"])
    backoff = retried.payload["backoff_ms"] / 1000
    assert backoff - EARLY <= after(retry_at, detected.at) <= backoff + LATE
    again = [e.at for e in events if e.kind == "job.running"][1]
    assert again >= retry_at
