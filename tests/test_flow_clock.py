"""No worker's clock decides when a flow key's pause ends or when a job runs again
(docs/flow-control.md, "Pauses"; docs/contracts.md, "Times"). Worker processes whose wall clock
is an hour fast, or an hour slow (libfaketime, their monotonic clock untouched), meet 429s from
the local LLM server with a ``Retry-After`` in seconds, an HTTP-date ``Retry-After`` and
Anthropic's reset headers, learn a spent limit from a success's headers, and sweep a zombie.
Each time the key's stored pause end and the job's next run are the database's clock plus what
the server asked (within what a loaded machine meets), and the job runs again after the pause.
Before, a worker an hour fast turned an absolute hint into no pause at all and retried its job
an hour after the pause, and an hour slow paused the key for an hour, and set its wake-up timer
for a job due soon an hour out."""

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


async def skewed_worker(
    stack: contextlib.ExitStack, dsn: str, skew: str, app: str, **env: Any
) -> WorkerProcess:
    """A worker process whose wall clock is ``skew`` off (``+1h``: an hour fast), once it has
    started: the time its log says it started at is off by that much (so a test cannot pass
    because the clock was not skewed)."""
    worker = stack.enter_context(WorkerProcess(dsn, app, **env, **tools.faketime(skew)))
    line: list[str] = []

    async def started() -> bool:
        line.extend(x for x in worker.output().splitlines() if " started: database " in x)
        return bool(line)

    await wait_for(started, timeout=60)
    said = datetime.strptime(line[0][:23], "%Y-%m-%d %H:%M:%S,%f")  # the process's local time
    hours = round((said - datetime.now()).total_seconds() / 3600, 1)
    assert hours == float(skew.removesuffix("h")), (skew, line[0])
    return worker


async def flow_worker(
    stack: contextlib.ExitStack, dsn: str, skew: str, config: Any, server: llm.LocalLLM
) -> WorkerProcess:
    return await skewed_worker(
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


async def row_of(
    db: psycopg.AsyncConnection[Any], query: str, *args: Any, timeout: float = 30
) -> tuple[Any, ...]:
    """The first row ``query`` returns, polled for until it returns one."""
    seen: list[tuple[Any, ...]] = []

    async def found() -> bool:
        seen.extend(await (await db.execute(query, args)).fetchall())
        return bool(seen)

    await wait_for(found, timeout=timeout, interval=0.02)
    return seen[0]


#: While a job waits in RETRY: its next_retry_at, its dispatch's scheduled_at, its key's pause
#: end, and when its failure was written (the event's time, stamped by the database).
RETRYING = """
SELECT j.next_retry_at, p.scheduled_at, k.paused_until,
       (SELECT max(e.at) FROM orc_job_events AS e
         WHERE e.job_id = j.id AND e.kind = 'job.failed') AS failed_at
  FROM orc_jobs AS j
  JOIN procrastinate_jobs AS p ON p.id = j.procrastinate_job_id
  JOIN orc_flow_keys AS k ON k.key = j.flow_key
 WHERE j.id = %s AND j.status = 'RETRY'
"""
#: Once a key learned its provider's limit: its pause end, and when it learned (the database's).
LEARNED = """
SELECT paused_until, learned_at FROM orc_flow_keys WHERE key = %s AND learned_at IS NOT NULL
"""
#: While a job waits parked on its key, sent ahead: when its dispatch is due.
PARKED = """
SELECT p.scheduled_at FROM orc_jobs AS j
  JOIN orc_flow_waiters AS w ON w.job_id = j.id
  JOIN procrastinate_jobs AS p ON p.id = j.procrastinate_job_id
 WHERE j.id = %s AND j.status = 'PENDING' AND p.scheduled_at IS NOT NULL
"""
#: Once a zombie was swept: when it is due again, its backoff, and when it was detected.
SWEPT = """
SELECT (r.payload ->> 'available_at')::timestamptz, (r.payload ->> 'backoff_ms')::float8 / 1000,
       d.at, d.payload ->> 'reason'
  FROM orc_job_events AS r JOIN orc_job_events AS d ON d.job_id = r.job_id
 WHERE r.job_id = %s AND r.kind = 'job.retry_scheduled' AND d.kind = 'job.zombie_detected'
"""


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
        await flow_worker(stack, dsn, skew, flow_app.CONFIG, server)
        job_id = await orc.submit("llm_generate", ASK)
        retry_at, scheduled_at, paused_until, failed_at = await row_of(db, RETRYING, job_id)
        for stored in (paused_until, retry_at, scheduled_at):  # from the failure's write
            assert HINT - EARLY <= after(stored, failed_at) <= HINT + LATE, (stored, failed_at)
        await completed(orc, job_id)
        assert server.requests["m"] == 2
    events = await orc.job_events(job_id)
    [failed] = [e for e in events if e.kind == "job.failed"]
    assert failed.payload["layer"] == "pause"
    [key] = await orc.flow_keys("anthropic:m")
    assert key.paused_by == "provider" and key.paused_until == paused_until
    [retried] = [e for e in events if e.kind == "job.retry_scheduled"]
    assert datetime.fromisoformat(retried.payload["available_at"]) == retry_at
    again = [e.at for e in events if e.kind == "job.running"][1]
    assert again >= retry_at and again >= paused_until - timedelta(milliseconds=50)


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
        await flow_worker(stack, dsn, skew, config, server)
        job_id = await orc.submit("chat", {"model": "m", "calls": 2})
        paused_until, learned_at = await row_of(db, LEARNED, "anthropic:m")
        assert paused_until is not None, "the key did not hold"
        [resumes_at] = await row_of(db, PARKED, job_id)
        for stored in (paused_until, resumes_at):  # from when the lesson was written
            assert HINT - EARLY <= after(stored, learned_at) <= HINT + LATE, stored
        await completed(orc, job_id)
        assert server.rate_limited == 0 and server.accepted == 2
    [key] = await orc.flow_keys("anthropic:m")
    assert key.paused_by == "provider" and key.learned_requests == 1
    events = await orc.job_events(job_id)
    assert "job.failed" not in [e.kind for e in events]
    again = [e.at for e in events if e.kind == "job.running"][1]
    assert again >= resumes_at >= paused_until


@pytest.mark.parametrize("skew", SKEWS)
async def test_the_zombie_sweep_retries_by_the_database_s_clock(
    dsn: str,
    make_orc: Callable[..., Orchestrator],
    db: psycopg.AsyncConnection[Any],
    skew: str,
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
        await skewed_worker(stack, dsn, skew, AGENT_APP)
        retry_at, backoff, detected_at, reason = await row_of(db, SWEPT, job_id)
        assert reason == "heartbeat"
        assert backoff - EARLY <= after(retry_at, detected_at) <= backoff + LATE
        await completed(orc, job_id)
    again = [e.at for e in await orc.job_events(job_id) if e.kind == "job.running"][1]
    assert again >= retry_at


#: Seconds between a worker's fetches, and between its reads of the soonest due time, when
#: nothing wakes it: longer than the test waits, so only the due time it heard can wake it.
POLL = 120
DUE_IN = 3.0
#: Maintenance once a year: each run is a dispatch whose insert wakes the worker's fetch.
RARE_MAINTENANCE = {
    f"ORCHESTRATOR_{name}_CRON": "0 0 1 1 *"
    for name in ("SWEEP", "SAFETY_NET", "APPROVALS", "PRUNE", "RETENTION", "ROLLUP")
}


@pytest.mark.parametrize("skew", SKEWS)
async def test_a_job_due_soon_wakes_its_worker_by_the_database_s_clock(
    dsn: str, make_orc: Callable[..., Orchestrator], skew: str
) -> None:
    """A job submitted to run 3 s later, to a worker that fetches and reads the soonest due
    time only every two minutes: the due time the database announces (``orc_wakeup``, seconds
    since the epoch by its clock) is read against the database's clock, so the worker wakes
    when the job is due. Before, a worker an hour slow set its timer an hour out, and the job
    waited for the next poll."""
    orc = make_orc(retry_config=flow_app.CONFIG)
    flow_app.register(orc)
    await orc.open()
    with contextlib.ExitStack() as stack:
        await skewed_worker(
            stack, dsn, skew, APP, ORCHESTRATOR_RETRY_CONFIG=flow_app.CONFIG,
            ORCHESTRATOR_FETCH_POLLING_INTERVAL=POLL, **RARE_MAINTENANCE,
        )  # fmt: skip
        run_at = datetime.now().astimezone() + timedelta(seconds=DUE_IN)
        job_id = await orc.submit("tick", run_at=run_at)
        await completed(orc, job_id, timeout=DUE_IN + 20)
    started = next(e.at for e in await orc.job_events(job_id) if e.kind == "job.running")
    assert started >= run_at
    await orc.close()
