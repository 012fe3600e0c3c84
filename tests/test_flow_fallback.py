"""The model-fallback pass-through of flow control made sound (docs/flow-control.md, "Model
fallback"; issue 35, item 6), held by worker processes, the local LLM server and a real
database: an operator's pause stops every type; a provider's pause lets the waiters that can
fall back go, however many that cannot wait before them; the threshold is the database's, which
the claim and the worker both read; a call moved to a fallback model is admitted against that
model's key."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from demo import llm_server as llm
from orchestrator import Orchestrator
from retry_config import load
from tests.support import flow_app
from tests.support.harness import wait_for
from tests.support.workers import WorkerProcess

APP = "tests.support.flow_app:orc"
KEY = "sk-test-fallback-0123456789"
FALLS_BACK = 'fallback_models = ["m2"]\nfallback_after_seconds = 5'


@pytest.fixture
def server() -> Iterator[llm.LocalLLM]:
    with llm.serve(api_key=KEY) as local:
        yield local


def env(server: llm.LocalLLM, config: Path) -> dict[str, Any]:
    """A worker process's settings: no test here is about zombies, so the sweep waits 10 s (the
    workers' 1.5 s took a running job whose heartbeat a loaded machine delayed, and it retried
    behind the pause the test then set)."""
    return {"ORCHESTRATOR_RETRY_CONFIG": config, "ANTHROPIC_BASE_URL": server.url,
            "ANTHROPIC_API_KEY": KEY, "ORCHESTRATOR_WORKER_CONCURRENCY": 5,
            "ORCHESTRATOR_ZOMBIE_THRESHOLD": "10"}  # fmt: skip


def ask(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 20}


async def running_of(db: psycopg.AsyncConnection[Any], key: str) -> int:
    cur = await db.execute(
        "SELECT count(*) FROM orc_jobs WHERE flow_key = %s AND status = 'RUNNING'", (key,)
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def provider_pause(db: psycopg.AsyncConnection[Any], key: str, seconds: float) -> None:
    """The key paused by its provider (a 429's hint), as a worker's retry pauses it."""
    await db.execute("SELECT orc_flow_throttled_v2(%s, %s, 'overloaded_error')", (key, seconds))


async def waiting(orc: Orchestrator, job_id: Any) -> bool:
    job = await orc.get_job(job_id)
    return job.waiting_for is not None and job.attempt == 0


async def finished(orc: Orchestrator, job_id: Any) -> bool:
    return (await orc.get_job(job_id)).finished_at is not None


async def test_an_operator_s_pause_stops_every_type_and_a_provider_s_lets_fallbacks_through(
    dsn: str, make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any],
    server: llm.LocalLLM,
) -> None:  # fmt: skip
    """One at a time per model; llm_generate falls back to m2 past a 5 s pause. An operator's
    pause of m holds a waiting llm_generate job when the running one ends (the pump handed it
    through, and it called m2). A provider's pause of n: a waiting ``chat`` job (no fallback)
    is first in line, an llm_generate job after it; when the running job ends, the llm_generate
    job goes to m2 at once (it stalled behind the chat job for the whole pause) while the chat
    job waits."""
    server.script("m", [llm.Text("slow answer", chunks=10, every=0.2)])
    server.script("n", [llm.Text("slow answer", chunks=10, every=0.2)])
    server.script("m2", [llm.Text("from the fallback")])
    config = flow_app.config("concurrency = 1", llm_generate=FALLS_BACK)
    orc = make_orc(retry_config=config)
    flow_app.register(orc)
    await orc.open()
    with WorkerProcess(dsn, APP, **env(server, config)):
        slow = await orc.submit("llm_generate", ask("m"))
        await wait_for(lambda: _calling(server, "m"), timeout=30)  # its call admitted, and sent
        held = await orc.submit("llm_generate", ask("m"))
        await wait_for(lambda: waiting(orc, held))
        await orc.pause_flow_key("anthropic:m", seconds=60, reason="incident", by="ops")
        await wait_for(lambda: finished(orc, slow), timeout=30)
        await asyncio.sleep(2)  # (it went through at once when it did)
        assert await waiting(orc, held)
        assert server.requests["m2"] == 0

        slow = await orc.submit("llm_generate", ask("n"))
        await wait_for(lambda: _calling(server, "n"), timeout=30)
        first = await orc.submit("chat", {"model": "n", "calls": 1})
        await wait_for(lambda: waiting(orc, first))
        second = await orc.submit("llm_generate", ask("n"))
        await wait_for(lambda: waiting(orc, second))
        await provider_pause(db, "anthropic:n", 60)
        await wait_for(lambda: finished(orc, second), timeout=20)
        assert await waiting(orc, first)
    job = await orc.get_job(second)
    assert (job.status.value, job.attempt) == ("COMPLETED", 1)
    assert server.requests["n"] == 1 and server.requests["m2"] == 1
    [moved] = [e.payload for e in await orc.job_events(second) if e.kind == "job.model_fallback"]
    assert (moved["from"], moved["to"], moved["reason"]) == ("n", "m2", "key_paused")


async def _calling(server: llm.LocalLLM, model: str) -> bool:
    """The running job's call reached the server: admitted before the pause that follows (a
    job merely RUNNING may not have admitted its call yet, and would park on that pause)."""
    return server.requests[model] == 1


async def test_the_fallback_threshold_is_the_database_s_and_a_fallback_call_meets_its_model_s_key(
    dsn: str, make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any],
    server: llm.LocalLLM,
) -> None:  # fmt: skip
    """Two calls per model a minute. The worker's file says fall back past 120 s, the fleet's
    (the last config applied, in the database) past 5 s. m2's window is spent; m is paused by
    its provider for 60 s. A job on m is let through by its claim (60 > 5); its worker reads
    the same threshold and moves to m2, not m (it called the paused m: its own 120 s said
    wait); its call is admitted against m2's key, which has no room: the job waits, m2 is not
    called a third time in its window (it was: m2's key was never checked)."""
    server.script("m", [llm.Text("ok")])
    server.script("m2", [llm.Text("from the fallback")])
    rate = "requests = 2\ninterval_seconds = 60"
    worker_config = flow_app.config(
        rate, llm_generate='fallback_models = ["m2"]\nfallback_after_seconds = 120'
    )
    fleet_config = flow_app.config(rate, llm_generate=FALLS_BACK)
    orc = make_orc(retry_config=fleet_config)
    flow_app.register(orc)
    await orc.open()
    with WorkerProcess(dsn, APP, **env(server, worker_config)):
        ids = [await orc.submit("llm_generate", ask(model)) for model in ("m", "m2", "m2")]
        for job_id in ids:
            await wait_for(lambda job_id=job_id: finished(orc, job_id), timeout=30)
        await orc.stores.flow.sync(
            load(fleet_config), orc.application
        )  # the fleet's config, applied last
        await provider_pause(db, "anthropic:m", 60)
        job_id = await orc.submit("llm_generate", ask("m"))

        async def parked() -> bool:
            job = await orc.get_job(job_id)
            return job.attempt == 1 and job.waiting_for is not None

        await wait_for(parked, timeout=20)
        await asyncio.sleep(1)
        assert server.requests["m"] == 1 and server.requests["m2"] == 2
        events = [e for e in await orc.job_events(job_id)]
        [moved] = [e.payload for e in events if e.kind == "job.model_fallback"]
        assert (moved["from"], moved["to"], moved["reason"]) == ("m", "m2", "key_paused")
        assert (await orc.get_job(job_id)).status.value == "PENDING"
        [m2] = await orc.flow_keys("anthropic:m2")
        assert m2.requests_used == 2
