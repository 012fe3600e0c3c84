"""``python -m tests.support.solo_worker URL``: a fresh interpreter that submits one
``observed`` job (tests/support/observed_app.py) against the peers at URL, runs a worker until
nothing is left to do (``run_worker(wait=False)``, logging set up by nobody), and prints on
stdout, as JSON, the job's status and the ``opentelemetry`` modules it has imported. Settings
come from the environment (DATABASE_URL, ORCHESTRATOR_*)."""

from __future__ import annotations

import asyncio
import json
import sys

from tests.support import observed_app


async def main(url: str) -> None:
    orc = observed_app.orc
    async with orc:
        job_id = await orc.submit("observed", {"url": url})
        await orc.run_worker(wait=False, install_signal_handlers=False)
        job = await orc.get_job(job_id)
    loaded = sorted(name for name in sys.modules if name.split(".")[0] == "opentelemetry")
    print(json.dumps({"job_id": str(job_id), "status": job.status, "opentelemetry": loaded}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
