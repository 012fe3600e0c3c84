"""A new user's first hour, through the real command line (each command a process of its own):
a database that is missing, misnamed, unreachable or not migrated is one line naming what to
do; a busy health port is one line naming its setting; a worker stopped in its first moments
exits 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import conninfo

from orchestrator.storage.database import drop_database, ensure_database, with_database
from orchestrator.storage.migrate import migrate, own_migrations
from tests.support.workers import until_it_handles_sigterm

ROOT = Path(__file__).resolve().parent.parent


def orchestrator(
    *argv: str, dsn: str, timeout: float = 60, **env: str
) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "DATABASE_URL": dsn, "ORCHESTRATOR_HEALTH_PORT": "0", **env}
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *argv],
        capture_output=True, text=True, env=environment, cwd=ROOT, timeout=timeout, check=False,
    )  # fmt: skip


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


@pytest.fixture
def empty_database(server_dsn: str) -> Iterator[str]:
    name = f"orc_empty_{uuid.uuid4().hex[:8]}"
    ensure_database(server_dsn, name)
    yield with_database(server_dsn, name)
    drop_database(server_dsn, name)


@pytest.mark.parametrize(
    "argv",
    [
        ("jobs",),
        ("status", "01a2c0de-0000-7000-8000-000000000000"),
        ("submit", "http_request", "--payload", '{"url": "http://127.0.0.1:9/"}'),
        ("dlq", "list"),
        ("worker",),
    ],
    ids=lambda argv: argv[0],
)
def test_a_database_without_the_schema_says_run_migrate(
    empty_database: str, argv: tuple[str, ...]
) -> None:
    done = orchestrator(*argv, dsn=empty_database)
    assert done.returncode == 2
    assert one_error_line(done) == (
        "error: the database has no orchestrator schema: run `orchestrator migrate` first"
    )


async def test_an_older_schema_says_run_migrate(empty_database: str, tmp_path: Path) -> None:
    older = own_migrations()[:9]
    for migration in older:
        (tmp_path / f"{migration.version}_{migration.name}.sql").write_text(migration.sql)
    async with await psycopg.AsyncConnection.connect(empty_database, autocommit=True) as conn:
        await migrate(conn, folder=tmp_path)  # type: ignore[arg-type]
    done = orchestrator("jobs", dsn=empty_database)
    newest = own_migrations()[-1].version
    assert one_error_line(done) == (
        f"error: the database schema is at 0009; this version needs {newest}: run "
        "`orchestrator migrate`"
    )
    assert orchestrator("migrate", dsn=empty_database).returncode == 0
    assert orchestrator("jobs", dsn=empty_database).returncode == 0


def test_worker_migrate_applies_the_schema_first(empty_database: str) -> None:
    env = {**os.environ, "DATABASE_URL": empty_database, "ORCHESTRATOR_HEALTH_PORT": "0"}
    worker = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "worker", "--migrate"],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while orchestrator("jobs", dsn=empty_database).returncode != 0:
        assert time.monotonic() < deadline and worker.poll() is None
        time.sleep(0.2)
    worker.send_signal(signal.SIGTERM)
    out, err = worker.communicate(timeout=30)
    assert worker.returncode == 0, err
    assert out.startswith("applied: procrastinate schema, 0001_core")


def test_a_misnamed_database_is_reported_at_once_with_the_servers_reason(server_dsn: str) -> None:
    started = time.monotonic()
    done = orchestrator("jobs", dsn=with_database(server_dsn, "no_such_database"))
    assert done.returncode == 1 and time.monotonic() - started < 10
    line = one_error_line(done)
    assert line.startswith("error: cannot reach the database: ")
    assert 'database "no_such_database" does not exist' in line


def test_an_unreachable_server_is_reported_within_the_connect_timeout(server_dsn: str) -> None:
    with socket.socket() as listener:  # accepts nothing: a connection attempt just hangs
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        params = {**conninfo.conninfo_to_dict(server_dsn), "host": "127.0.0.1", "port": str(port)}
        started = time.monotonic()
        done = orchestrator(
            "status", "01a2c0de-0000-7000-8000-000000000000",
            dsn=conninfo.make_conninfo("", **params), ORCHESTRATOR_CONNECT_TIMEOUT="2",
        )  # fmt: skip
        elapsed = time.monotonic() - started
    assert done.returncode == 1 and elapsed < 8, (elapsed, done.stderr)
    assert one_error_line(done).startswith("error: cannot reach the database: ")


def test_a_health_port_in_use_is_one_line_naming_its_setting(dsn: str) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = orchestrator("worker", dsn=dsn, ORCHESTRATOR_HEALTH_PORT=str(port))
    assert done.returncode == 2
    line = one_error_line(done)
    assert line.startswith(f"error: ORCHESTRATOR_HEALTH_PORT: cannot listen on port {port}: ")


@pytest.mark.parametrize("after", [0.05, 0.1, 0.2, 0.5, 1.0, 2.0])
def test_a_worker_stopped_in_its_first_moments_exits_0(empty_dsn: str, after: float) -> None:
    """From the entry point's first line on: before it, for the few tens of milliseconds the
    interpreter takes to start, no Python code can handle a signal. (On empty tables: a job a
    test before left, of a type this worker does not know, would be an error of its own.)"""
    env = {**os.environ, "DATABASE_URL": empty_dsn, "ORCHESTRATOR_HEALTH_PORT": "0"}
    worker = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "worker"],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    until_it_handles_sigterm(worker.pid)  # its entry point's first line has run
    time.sleep(after)
    worker.send_signal(signal.SIGTERM)
    _, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err
    assert "Traceback" not in err
