"""Shared set-up for the benchmarks: a fresh, migrated database on the configured server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import psycopg
from procrastinate.schema import SchemaManager
from psycopg import conninfo

from orchestrator import Orchestrator
from orchestrator.domain.principals import Scope
from orchestrator.storage.database import (
    drop_database,
    ensure_database,
    start_embedded,
    with_database,
)
from orchestrator.storage.migrate import migrate

ROOT = Path(__file__).resolve().parent.parent
GRAPHILE = ROOT / "bench" / "graphile"
LIBPQ_ENV = {"host": "PGHOST", "port": "PGPORT", "user": "PGUSER", "password": "PGPASSWORD"}


def quiet_orchestrator() -> None:
    """Log as an application that set up its logging would: no line per job. Left alone, a
    worker logs each job's outcome at INFO (to show a new user what it does), which a bench
    would measure as well."""
    logging.getLogger("orchestrator").setLevel(logging.WARNING)


@contextlib.contextmanager
def fresh_database(
    prefix: str = "orc_bench",
    *,
    schema: Literal["orchestrator", "procrastinate"] | None = "orchestrator",
) -> Iterator[str]:
    """A new database (dropped afterwards) on DATABASE_URL's server, or the embedded one, with
    the orchestrator's schema, Procrastinate's alone, or none."""
    server = os.environ.get("DATABASE_URL") or start_embedded(ROOT / ".orchestrator")
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    ensure_database(server, name)
    dsn = with_database(server, name)

    async def apply() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            if schema == "orchestrator":
                await migrate(conn)
            else:
                await conn.execute(SchemaManager.get_schema().encode())

    if schema is not None:
        asyncio.run(apply())
    try:
        yield dsn
    finally:
        drop_database(server, name)


def graphile_node() -> str:
    """The path of ``node``, with the graphile-worker pinned in bench/graphile/package.json
    installed there (by npm, when it is missing or another version). Raises RuntimeError saying
    why Graphile Worker cannot be measured."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        raise RuntimeError("Node.js and npm are not installed")
    pinned = json.loads((GRAPHILE / "package.json").read_text())["dependencies"]["graphile-worker"]
    installed = GRAPHILE / "node_modules" / "graphile-worker" / "package.json"
    if not installed.is_file() or json.loads(installed.read_text())["version"] != pinned:
        install = subprocess.run(
            [npm, "install", "--no-package-lock", "--no-audit", "--no-fund", "--silent"],
            cwd=GRAPHILE, capture_output=True, text=True, check=False,
        )  # fmt: skip
        if install.returncode != 0:
            raise RuntimeError(f"npm install failed: {install.stderr.strip()[-300:]}")
    return node


def run_graphile(script: str, args: list[str], dsn: str, timeout: float) -> dict[str, Any]:
    """Run bench/graphile/``script`` with ``args`` on ``dsn``'s database (passed as the libpq
    environment, PGHOST, PGDATABASE, ...) and return the JSON object its last line prints.
    Raises RuntimeError saying why it could not be measured."""
    node = graphile_node()
    params = conninfo.conninfo_to_dict(dsn)
    env = {var: str(params[key]) for key, var in LIBPQ_ENV.items() if params.get(key)}
    try:
        run = subprocess.run(
            [node, str(GRAPHILE / script), *args],
            env={**os.environ, **env, "PGDATABASE": str(params["dbname"])},
            capture_output=True, text=True, check=False, timeout=timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{script} took over {timeout:.0f} s") from exc
    if run.returncode != 0:
        raise RuntimeError(f"{script} failed: {run.stderr.strip()[-300:]}")
    try:
        result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError) as exc:
        raise RuntimeError(f"{script} printed no result: {run.stdout.strip()[-300:]}") from exc
    return result


def machine() -> str:
    server = "DATABASE_URL" if os.environ.get("DATABASE_URL") else "embedded PostgreSQL"
    python = f"{platform.python_implementation()} {platform.python_version()}"
    return f"{os.cpu_count()} cores, {python}, {server}"


async def server_version(dsn: str) -> str:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute("SHOW server_version")
        row = await cur.fetchone()
        return str(row[0]) if row else "?"


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


class CpuMeter:
    """CPU time spent over stretches of a run: by this process, and by the server processes
    serving one database, to show where each system's time goes. It drifts with the machine's
    speed as the latency does. The server's share is read from ``/proc``, so only when the
    server runs on this machine (the embedded one, or a local one); otherwise it is None."""

    def __init__(self) -> None:
        self.python = 0.0  # seconds
        self.server: float | None = 0.0  # seconds
        self.jobs = 0
        self._started: tuple[float, dict[int, int] | None] | None = None

    async def start(self, dsn: str) -> None:
        self._started = (time.process_time(), await backend_cpu(dsn))

    async def stop(self, dsn: str, jobs: int) -> None:
        assert self._started is not None, "stop() before start()"
        python, before = self._started
        after = await backend_cpu(dsn)
        self.python += time.process_time() - python
        if self.server is not None and before is not None and after is not None:
            # A backend that started meanwhile counts in full; one that ended is not counted.
            self.server += sum(ns - before.get(pid, 0) for pid, ns in after.items()) / 1e9
        else:
            self.server = None
        self.jobs += jobs

    def per_job(self) -> str:
        server = None if self.server is None else self.server / self.jobs * 1e6
        return cpu_per_job(self.python / self.jobs * 1e6, server)


def cpu_per_job(process_us: float, server_us: float | None) -> str:
    server = "not measured" if server_us is None else f"{server_us:.0f} us"
    return f"CPU per job: the measuring process {process_us:.0f} us, the server {server}"


async def backend_cpu(dsn: str) -> dict[int, int] | None:
    """Nanoseconds of CPU used so far by each server process connected to ``dsn``'s database
    (but this query's own), or None when they are not processes of this machine."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT pid FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        pids = [row[0] for row in await cur.fetchall()]
    used = {}
    for pid in pids:
        proc = Path(f"/proc/{pid}")
        try:
            if not proc.joinpath("cmdline").read_bytes().startswith(b"postgres"):
                return None  # a process of this machine, but not the server's: it is elsewhere
            used[pid] = int(proc.joinpath("schedstat").read_text().split()[0])
        except FileNotFoundError:
            continue  # ended since the query, or the server is elsewhere (then all are missing)
        except (OSError, ValueError, IndexError):
            return None
    return used if used or not pids else None


@contextlib.contextmanager
def serving(dsn: str, app: str | None = None) -> Iterator[str]:
    """``orchestrator serve`` (of ``app``: ``module:attribute``, default the built-in job types)
    on ``dsn``'s database, in a process of its own; its URL once it answers /readyz."""
    with served(dsn, app) as (url, _):
        yield url


@contextlib.contextmanager
def served(dsn: str, app: str | None = None) -> Iterator[tuple[str, int]]:
    """As :func:`serving`, with the server's process id (to read its CPU time)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "DATABASE_URL": dsn, "ORCHESTRATOR_API_PORT": str(port)}
    server = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", *(["--app", app] if app else []), "serve"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not _answers(f"{url}/readyz"):
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("orchestrator serve did not become ready")
            time.sleep(0.1)
        yield url, server.pid
    finally:
        server.terminate()
        server.wait(timeout=30)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url).status_code == 200
    except httpx.TransportError:
        return False


async def api_token(dsn: str, *scopes: Scope) -> str:
    """A token for the benches' API clients (as ``orchestrator tokens create bench``)."""
    orc = Orchestrator(dsn=dsn)
    async with orc:
        return (await orc.stores.tokens.create("bench", scopes, None, by="bench")).token
