"""Flow control (docs/flow-control.md, migration 0029): fleet-wide limits per key, enforced at
the claim in the database. Real PostgreSQL, real workers (in process here; several worker
processes and the local LLM server's rate limit in the tests further down)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg

from orchestrator import Orchestrator
from tests.support import flow_app
from tests.support.harness import WorkerRun, wait_for


def flow_orc(make_orc: Callable[..., Orchestrator], **settings: Any) -> Orchestrator:
    orc = make_orc(retry_config=flow_app.CONFIG, **settings)
    flow_app.register(orc)
    return orc


async def running_of(db: psycopg.AsyncConnection[Any], key: str) -> int:
    cur = await db.execute(
        "SELECT count(*) FROM orc_jobs WHERE flow_key = %s AND status = 'RUNNING'", (key,)
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def test_a_key_never_runs_more_than_its_concurrency_and_waiting_jobs_say_why(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = flow_orc(make_orc)
    await orc.open()
    ids = [await orc.submit("hold", {"pool": "a", "seconds": 0.4}) for _ in range(6)]
    other = await orc.submit("hold", {"pool": "b", "seconds": 0.1})
    seen: list[int] = []
    async with WorkerRun(orc, concurrency=10) as run:

        async def sampled() -> bool:
            seen.append(await running_of(db, "hold:a"))
            waiting = [j for j in await orc.list_jobs(job_type="hold") if j.waiting_for]
            return bool(waiting) and max(seen) == 2

        await wait_for(sampled, timeout=10)
        waiting = [j for j in await orc.list_jobs(job_type="hold") if j.waiting_for]
        reasons = {j.waiting_for for j in waiting}
        # the first to wait waits for the limit; those after it, in line behind it
        assert "waiting for capacity on hold:a (its concurrency limit is reached)" in reasons
        assert reasons <= {
            "waiting for capacity on hold:a (its concurrency limit is reached)",
            "waiting for capacity on hold:a (in line behind other jobs of the key)",
        }
        assert all(j.attempt == 0 and j.status.value == "PENDING" for j in waiting)
        await run.until_finished(*ids, other, timeout=20)
    assert max(seen) == 2
    for job_id in ids:
        job = await orc.get_job(job_id)
        assert job.status.value == "COMPLETED" and job.attempt == 1 and job.waiting_for is None
