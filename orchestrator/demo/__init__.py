"""``./dev demo``: the orchestrator on the embedded database, against a local HTTP server.

Three ``http_request`` jobs: one meets two HTTP 429s (with ``Retry-After: 1``) and then
succeeds; one gets a 400 and fails permanently; one gets 503 until its retry budget is spent.
The worker runs in this process; each job's final state and history are printed.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import tasks
from orchestrator.app import Orchestrator
from orchestrator.cli import describe
from orchestrator.demo.http_server import serve
from orchestrator.settings import Settings

CONFIG = Path(__file__).with_name("retry_config.toml")


async def main() -> int:
    orc = Orchestrator(settings=Settings(retry_config=CONFIG))
    tasks.register_all(orc)
    print("Starting the database (embedded PostgreSQL unless DATABASE_URL is set) ...")
    report = await orc.migrate()
    print(f"migrate: {report}")
    with serve() as base:
        async with orc:
            jobs = {
                "meets two 429s, then succeeds": f"{base}/flaky",
                "fails permanently (400)": f"{base}/bad",
                "exhausts its retry budget (503)": f"{base}/down",
            }
            ids = {label: await orc.submit("http_request", {"url": u}) for label, u in jobs.items()}
            print(f"submitted {len(ids)} jobs; running a worker ...\n")
            worker = asyncio.create_task(orc.run_worker(install_signal_handlers=False))
            started = time.monotonic()
            while True:
                finished = [(await orc.get_job(i)).finished_at for i in ids.values()]
                if all(finished) or time.monotonic() - started > 60:
                    break
                await asyncio.sleep(0.1)
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)
            for label, job_id in ids.items():
                print(f"== {label}")
                print(describe(await orc.get_job(job_id), await orc.job_events(job_id)))
                print()
    return 0
