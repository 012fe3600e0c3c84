"""What the HTTP API costs: submit throughput (one job per request, and batches) and the latency
of reading a job, through a real ``orchestrator serve`` process and httpx, on a fresh database.

    ./dev bench api [--jobs 2000] [--batch 100] [--reads 2000] [--clients 8]

Baseline named: the same submits made in process with ``Orchestrator.submit`` /
``submit_many`` (no HTTP), in the same run, so the ratio is what the API adds. GET latency is
measured one request at a time on a keep-alive connection (p50, p99), against a job that
exists.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import httpx

from bench.common import api_token, fresh_database, machine, server_version, serving
from orchestrator import Orchestrator, Settings
from orchestrator.domain.principals import Scope

ROOT = Path(__file__).resolve().parent.parent
APP = "bench.api_app:orc"


async def submits_in_process(dsn: str, jobs: int, batch: int) -> tuple[float, float]:
    orc = Orchestrator(settings=Settings(pool_max_size=10), dsn=dsn)
    from bench.api_app import register

    register(orc)
    async with orc:
        started = time.perf_counter()
        for i in range(jobs):
            await orc.submit("noop", {"i": i})
        single = jobs / (time.perf_counter() - started)
        started = time.perf_counter()
        for start in range(0, jobs, batch):
            await orc.submit_many(
                [{"job_type": "noop", "payload": {"i": i}} for i in range(start, start + batch)]
            )
        batched = jobs / (time.perf_counter() - started)
    return single, batched


async def through_api(
    url: str, secret: str, jobs: int, batch: int, reads: int, clients: int
) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {secret}"}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits) as http:
        per_client = jobs // clients

        async def submitter(c: int) -> None:
            for i in range(per_client):
                r = await http.post("/api/v1/jobs", json={"job_type": "noop", "payload": {"i": i}})
                r.raise_for_status()

        started = time.perf_counter()
        await asyncio.gather(*(submitter(c) for c in range(clients)))
        single = per_client * clients / (time.perf_counter() - started)

        bodies = [
            {"jobs": [{"job_type": "noop", "payload": {"i": i}} for i in range(batch)]}
            for _ in range(jobs // batch)
        ]
        started = time.perf_counter()
        for body in bodies:
            (await http.post("/api/v1/jobs/batch", json=body)).raise_for_status()
        batched = len(bodies) * batch / (time.perf_counter() - started)

        job_id = (await http.post("/api/v1/jobs", json={"job_type": "noop"})).json()["job_id"]
        times = []
        for _ in range(reads):
            started = time.perf_counter()
            (await http.get(f"/api/v1/jobs/{job_id}")).raise_for_status()
            times.append((time.perf_counter() - started) * 1000)
    times.sort()
    return {
        "single": single,
        "batched": batched,
        "p50": statistics.median(times),
        "p99": times[int(len(times) * 0.99) - 1],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--reads", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    with fresh_database("orc_bench_api") as dsn:
        print(f"machine: {machine()}, PostgreSQL {asyncio.run(server_version(dsn))}")
        single_in, batched_in = asyncio.run(submits_in_process(dsn, args.jobs, args.batch))
        secret = asyncio.run(api_token(dsn, Scope.ADMIN))
        with serving(dsn, APP) as url:
            api = asyncio.run(
                through_api(url, secret, args.jobs, args.batch, args.reads, args.clients)
            )
    print(f"{args.jobs} jobs each way; batches of {args.batch}; {args.clients} API clients")
    print(f"  submit, one per call:  API {api['single']:7.0f} jobs/s   in process "
          f"{single_in:7.0f} jobs/s   ratio {api['single'] / single_in:.2f}")  # fmt: skip
    print(f"  submit, batched:       API {api['batched']:7.0f} jobs/s   in process "
          f"{batched_in:7.0f} jobs/s   ratio {api['batched'] / batched_in:.2f}")  # fmt: skip
    print(
        f"  GET /api/v1/jobs/{{id}}: p50 {api['p50']:.2f} ms, p99 {api['p99']:.2f} ms "
        f"({args.reads} reads, one at a time)"
    )


if __name__ == "__main__":
    main()
