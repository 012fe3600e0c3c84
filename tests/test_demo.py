"""The demo (``python -m demo``) as a user runs it, pointed by DATABASE_URL at a database that
holds someone's jobs: it works in a database of its own, which it drops at the end, a Ctrl-C
included; its output explains what it shows, and a normal run logs no warning."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

import tasks
from orchestrator import Orchestrator, Status

ROOT = Path(__file__).resolve().parent.parent


def demo_databases(dsn: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT datname FROM pg_database WHERE datname LIKE 'orc_demo_%'")
        return [row[0] for row in rows]


def start_demo(dsn: str) -> subprocess.Popen[str]:
    env = {**os.environ, "DATABASE_URL": dsn, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "demo"], env=env, cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


@pytest.fixture
async def users_jobs(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> dict[str, Any]:
    """A job due now, and one RUNNING whose worker died an hour ago (a sweep would take it)."""
    orc = make_orc()
    tasks.register_all(orc)
    await orc.open()
    due = await orc.submit("http_request", {"url": "http://127.0.0.1:9/due"})
    zombie = await orc.submit("http_request", {"url": "http://127.0.0.1:9/zombie"})
    await db.execute(
        "UPDATE orc_jobs SET status = 'RUNNING', lease_token = gen_random_uuid(), "
        "locked_by = 'gone', heartbeat_at = now() - interval '1 hour' WHERE id = %s",
        (zombie,),
    )
    return {"orc": orc, "due": due, "zombie": zombie}


async def test_the_demo_keeps_to_a_database_of_its_own(
    dsn: str, users_jobs: dict[str, Any]
) -> None:
    demo = start_demo(dsn)
    out, err = await asyncio.to_thread(demo.communicate, timeout=240)
    assert demo.returncode == 0, err[-3000:]

    orc = users_jobs["orc"]
    due, zombie = await orc.get_job(users_jobs["due"]), await orc.get_job(users_jobs["zombie"])
    assert (due.status, due.attempt) == (Status.PENDING, 0)  # never run
    assert (zombie.status, zombie.attempt) == (Status.RUNNING, 0)  # never swept
    assert [e.kind for e in await orc.job_events(due.id)] == ["job.created"]
    assert demo_databases(dsn) == []

    assert "Creating the demo's own database on the server DATABASE_URL names" in out
    assert "  run n/m of this dispatch   the infrastructure layer" in out
    assert "  job.degraded               what followed a failure for good" in out
    assert "job.degraded             a person is notified (job " in out
    assert "WARNING" not in out + err and "Traceback" not in out + err
    assert "INFO orchestrator.runtime.drain: worker cancelled: draining (0 job(s)" in err


async def test_a_ctrl_c_drops_the_demos_database_and_ends_quietly(dsn: str) -> None:
    demo = start_demo(dsn)
    assert demo.stdout is not None
    line = ""
    while "#### Part 1" not in line:
        line = await asyncio.to_thread(demo.stdout.readline)
        assert line, "the demo ended before its first part"
    assert len(demo_databases(dsn)) == 1
    demo.send_signal(signal.SIGINT)
    _, err = await asyncio.to_thread(demo.communicate, timeout=60)
    assert demo.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert demo_databases(dsn) == []
