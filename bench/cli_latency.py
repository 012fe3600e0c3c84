"""Read commands as a user types them: ``orchestrator jobs``, ``status ID`` and ``dlq list``,
each a process of its own, on the embedded server (or on DATABASE_URL's).

    ./dev bench cli_latency [--runs 10]

Each command runs ``--runs`` times, from spawn to exit; printed: min, median and max wall time
(target: median <= 0.5 s on the embedded server), beside what any process of this virtualenv
costs here: an empty interpreter, and one that only imports the command line as a plain
``python -c`` does. The commands' entry point imports it faster and leaves faster (its cyclic
garbage collector skips that heap: orchestrator/interfaces/start.py), so a whole command can
take less than that import line.
On the embedded server the commands find it the way a user's do (``ORCHESTRATOR_DATA_DIR``,
no DATABASE_URL), in a database of the benchmark's own.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

from psycopg import conninfo

import tasks
from bench.common import ROOT, fresh_database, machine, server_version
from orchestrator import Orchestrator, Settings


def timed(command: Sequence[str], env: dict[str, str], runs: int) -> list[float]:
    seconds = []
    for _ in range(runs):
        started = time.perf_counter()
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, check=False)
        seconds.append(time.perf_counter() - started)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command[2:])} failed: {done.stderr.decode()[-300:]}")
    return seconds


def line(label: str, seconds: list[float]) -> str:
    ms = [s * 1000 for s in seconds]
    return (
        f"{label:<34} min {min(ms):4.0f} ms  median {statistics.median(ms):4.0f} ms  "
        f"max {max(ms):4.0f} ms"
    )


async def seed(dsn: str) -> str:
    """Fifty jobs; the id of one of them."""
    orc = Orchestrator(settings=Settings(health_port=0), dsn=dsn)
    tasks.register_all(orc)
    async with orc:
        ids = await orc.submit_many(
            [{"job_type": "http_request", "payload": {"url": f"http://127.0.0.1:9/{n}"}}
             for n in range(50)]
        )  # fmt: skip
    return str(ids[0])


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench.cli_latency", description=__doc__)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    with fresh_database("orc_bench_cli") as dsn:
        job_id = asyncio.run(seed(dsn))
        print(f"machine: {machine()}, PostgreSQL {asyncio.run(server_version(dsn))}")
        env = dict(os.environ)
        if not env.get("DATABASE_URL"):
            env.update(
                ORCHESTRATOR_DATA_DIR=str(ROOT / ".orchestrator"),
                ORCHESTRATOR_EMBEDDED_DATABASE=conninfo.conninfo_to_dict(dsn)["dbname"] or "",
            )
        else:
            env["DATABASE_URL"] = dsn
        python = [sys.executable]
        print(line("python -c pass", timed([*python, "-c", "pass"], env, args.runs)))
        imports = [*python, "-c", "import orchestrator.interfaces.cli"]
        print(line("import orchestrator.interfaces.cli", timed(imports, env, args.runs)))
        for argv in (["jobs"], ["status", job_id], ["dlq", "list"]):
            command = [*python, "-m", "orchestrator", *argv]
            label = "orchestrator " + " ".join(argv).replace(job_id, "ID")
            print(line(label, timed(command, env, args.runs)))


if __name__ == "__main__":
    main()
