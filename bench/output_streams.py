"""Live output (docs/output.md): jobs streaming text deltas, several readers each.

    ./dev bench output_streams [--jobs 200] [--readers 5] [--rate 50] [--seconds 10]

One worker process (the real CLI, ``bench.output_app:orc``, concurrency = jobs) runs ``--jobs``
jobs that each write a text delta ``--rate`` times a second for ``--seconds``, every delta the
time it was made; ``orchestrator serve`` serves their output as Server-Sent Events to
``--readers`` readers a job, all connected (in this process, see ``_read``) before the jobs are
submitted. Printed:

- delta made -> delta read, p50 and p99 over every delta every reader read (goal: p50 <= 100
  ms, p99 <= 500 ms), and whether each reader read each delta once, in order;
- rows and WAL bytes written per delta (``pg_current_wal_lsn()`` before and after: every
  writer's, the jobs' own claims and completions included, so an upper bound);
- CPU per delta (``/proc``) of the worker process, of the API server's process, of the
  PostgreSQL backends, and of this process (the readers: they share the machine, so what they
  spend is CPU the others lack).

Jobs that stream nothing: ``./dev bench paired`` against the release before.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg

from bench import output_app
from bench.common import (
    ROOT,
    api_token,
    backend_cpu,
    fresh_database,
    machine,
    percentile,
    served,
    server_version,
)  # fmt: skip
from bench.liveness import free_port, until_ready
from orchestrator import Orchestrator
from orchestrator.domain.principals import Scope
from orchestrator.settings import Settings

APP = "bench.output_app:orc"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--readers", type=int, default=5)
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    with fresh_database("orc_bench_out") as dsn:
        print(f"machine: {machine()}, PostgreSQL {asyncio.run(server_version(dsn))}")
        token = asyncio.run(api_token(dsn, Scope.READ))
        with served(dsn, APP) as (url, api):
            port = free_port()
            env = {
                **os.environ, "DATABASE_URL": dsn, "ORCHESTRATOR_HEALTH_PORT": str(port),
                "ORCHESTRATOR_WORKER_CONCURRENCY": str(args.jobs),
            }  # fmt: skip
            worker = subprocess.Popen(
                [sys.executable, "-m", "orchestrator", "--app", APP, "worker"],
                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            try:
                asyncio.run(until_ready(port))
                report = asyncio.run(measure(dsn, url, token, (worker.pid, api), args))
            finally:
                worker.terminate()
                worker.wait(timeout=60)
    print(report)


async def measure(
    dsn: str, url: str, token: str, pids: tuple[int, int], args: argparse.Namespace
) -> str:
    """The figures of one run; ``pids``: the worker's process and the API server's."""
    worker, api = pids
    orc = Orchestrator(settings=Settings(), dsn=dsn)
    output_app.register(orc)
    async with orc, await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        payload = {"rate": args.rate, "seconds": args.seconds}
        # The jobs are submitted for later, so that every reader is connected first.
        start_at = datetime.fromtimestamp(time.time() + 3 + args.jobs * args.readers / 200, UTC)
        ids = await orc.submit_many([
            {"job_type": "ticker", "payload": payload, "run_at": start_at.isoformat()}
        ] * args.jobs)  # fmt: skip
        wal_before, rows_before = await _wal_and_rows(conn)
        server_before, worker_before = await backend_cpu(dsn), _process_cpu(worker)
        api_before, readers_before = _process_cpu(api), _process_cpu(os.getpid())
        reads = await asyncio.gather(*(
            _read(url, token, job_id, round(args.rate * args.seconds))
            for job_id in ids for _ in range(args.readers)
        ))  # fmt: skip
        server_after, worker_after = await backend_cpu(dsn), _process_cpu(worker)
        api_after, readers_after = _process_cpu(api), _process_cpu(os.getpid())
        wal_after, rows_after = await _wal_and_rows(conn)
    deltas = round(args.rate * args.seconds) * args.jobs
    ages = [age for read in reads for age in read[0]]
    whole = sum(1 for _, complete in reads if complete)
    server = "not measured"
    if server_before is not None and server_after is not None:
        used = sum(ns - server_before.get(pid, 0) for pid, ns in server_after.items())
        server = f"{used / 1e3 / deltas:.1f} us"
    return (
        f"{args.jobs} jobs, each {round(args.rate * args.seconds)} text deltas at "
        f"{args.rate:g} a second, {args.readers} readers a job ({len(reads)} streams):\n"
        f"  delta made -> delta read: p50 {percentile(ages, 50) * 1000:.0f} ms, "
        f"p99 {percentile(ages, 99) * 1000:.0f} ms, max {max(ages) * 1000:.0f} ms over "
        f"{len(ages):,} reads (goal: p50 <= 100 ms, p99 <= 500 ms)\n"
        f"  readers that read every delta of their job once, in order: {whole} of {len(reads)}\n"
        f"  written per delta: {(rows_after - rows_before) / deltas:.3f} output rows, "
        f"{(wal_after - wal_before) / deltas:.0f} WAL bytes (all writers')\n"
        f"  CPU per delta: the worker process {(worker_after - worker_before) / deltas * 1e6:.1f} "
        f"us, the API server {(api_after - api_before) / deltas * 1e6:.1f} us, PostgreSQL "
        f"{server}, this process's {len(reads)} readers "
        f"{(readers_after - readers_before) / deltas * 1e6:.1f} us"
    )


async def _read(url: str, token: str, job_id: UUID, deltas: int) -> tuple[list[float], bool]:
    """One reader of a job's output, to its end: each delta's age when read (seconds), and
    whether it read each of the job's ``deltas`` once, in order. A plain HTTP/1.1 request on
    an asyncio stream, its chunked body split by hand: the readers share the machine with the
    worker, the server and PostgreSQL, and a full client (httpx: h11 and httpcore per read)
    spent a core of it on 1,000 streams, which showed as latency that was the reader's own."""
    ages: list[float] = []
    made: list[float] = []
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"GET /api/v1/jobs/{job_id}/output HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {token}\r\nAccept: text/event-stream\r\n\r\n".encode()
    )
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower(), head
    rest = b""
    try:
        while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
            data = (await reader.readexactly(size + 2))[:-2]
            now = time.time()
            *events, rest = (rest + data).split(b"\n\n")
            for event in events:
                if b"\nevent: text\n" not in event:  # a progress record, a marker, the end
                    continue
                chunk = json.loads(event[event.index(b"\ndata: ") + 7 :])
                for stamp in chunk["body"].split(";")[:-1]:
                    made.append(float(stamp))
                    ages.append(now - made[-1])
    finally:
        writer.close()
    return ages, len(made) == deltas and made == sorted(set(made))


async def _wal_and_rows(conn: psycopg.AsyncConnection[Any]) -> tuple[int, int]:
    cur = await conn.execute(
        "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn, (SELECT count(*) FROM orc_job_output)"
    )
    wal, rows = await cur.fetchone() or (0, 0)
    return int(wal), int(rows)


def _process_cpu(pid: int) -> float:
    """Seconds of CPU ``pid`` has used (user and system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
