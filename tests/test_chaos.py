"""Chaos, with real processes (slow: ``./dev test -m slow``): three workers run forty agent jobs,
submitted as they go, while every second or two one of them is killed (SIGKILL) or drained
(SIGTERM) and replaced.
Every job must complete with the transcript of an uninterrupted run, each step committed once,
no message delivered twice. ``CHAOS_SEED`` replays a run; ``CHAOS_SECONDS`` sets its length."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import Callable, Iterator
from contextlib import ExitStack

import pytest

from orchestrator import Orchestrator, Status
from tests.support import agent_app
from tests.support.external import MessageService, message_service
from tests.support.harness import config_with, wait_for
from tests.support.workers import WorkerProcess

pytestmark = pytest.mark.slow


@pytest.fixture
def service() -> Iterator[MessageService]:
    with message_service() as svc:
        yield svc


async def test_jobs_survive_workers_killed_and_drained_at_random(
    make_orc: Callable[..., Orchestrator], dsn: str, service: MessageService
) -> None:
    seed = int(os.environ.get("CHAOS_SEED", random.randrange(1_000_000)))
    seconds = float(os.environ.get("CHAOS_SECONDS", 45))
    rng = random.Random(seed)
    print(f"CHAOS_SEED={seed}")
    orc = make_orc(retry_config=config_with(agent_app.TABLE))
    agent_app.register(orc)
    await orc.open()
    plan = {"service": service.url, "steps": 6, "step_seconds": 1.0, "send_at": [2, 4, 5]}
    env = {"ORCHESTRATOR_DRAIN_SECONDS": 1}

    with ExitStack() as stack:
        workers = [stack.enter_context(WorkerProcess(dsn, **env)) for _ in range(3)]
        job_ids = [await orc.submit("agent", plan) for _ in range(10)]
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while loop.time() < end:
            await asyncio.sleep(rng.uniform(1.0, 2.0))
            if len(job_ids) < 40:
                job_ids += [await orc.submit("agent", plan) for _ in range(3)]
            victim = rng.randrange(len(workers))
            sig = rng.choice([signal.SIGKILL, signal.SIGTERM])
            workers[victim].signal(sig)
            await asyncio.to_thread(workers[victim].wait, 30)
            workers[victim] = stack.enter_context(WorkerProcess(dsn, **env))

        async def all_finished() -> bool:
            return all([(await orc.get_job(j)).finished_at is not None for j in job_ids])

        await wait_for(all_finished, timeout=120, interval=0.5)

    expected = {
        "log": [f"step {n}" + (f" sent 'step {n}'" if n in (2, 4, 5) else "") for n in range(1, 7)]
    }
    interruptions = 0
    for job_id in job_ids:
        job = await orc.get_job(job_id)
        assert job.status is Status.COMPLETED, (seed, job_id, job.last_error)
        assert job.result == expected, seed
        steps = [s["step"] for s in await orc.job_steps(job_id) if s["kind"] == "checkpoint"]
        assert steps == [1, 2, 3, 4, 5, 6], (seed, steps)
        kinds = [e.kind for e in await orc.job_events(job_id)]
        interruptions += kinds.count("job.zombie_detected") + kinds.count("job.interrupted")
    assert service.duplicates() == {}, seed
    assert len(service.deliveries) == 3 * len(job_ids)
    assert interruptions >= 10, interruptions  # the chaos did reach the jobs
    print(f"{len(job_ids)} jobs, {interruptions} interruptions")
