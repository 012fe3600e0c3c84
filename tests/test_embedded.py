"""The embedded PostgreSQL's lifecycle, with real processes in a data directory of this module's
own (never the suite's server): the server stops once no process using it is alive, one killed
by SIGKILL included; ``orchestrator db status`` says what runs and who uses it; ``db stop``
refuses while the server is in use, unless forced; a folder without one is told a new one is
made."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from orchestrator.storage.embedded import Embedded
from tests.support.workers import wait_until

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("embedded")
    yield path
    postmaster = Embedded(path).postmaster()
    if postmaster is not None:  # a failed test's leftover
        Embedded(path).stop(postmaster)


def environment(data_dir: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "ORCHESTRATOR_DATABASE_URL")
    }
    return {**env, "ORCHESTRATOR_DATA_DIR": str(data_dir), "ORCHESTRATOR_HEALTH_PORT": "0"}


def orchestrator(data_dir: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *argv],
        env=environment(data_dir), cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@contextmanager
def worker(data_dir: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``orchestrator worker`` on the embedded server, once it runs and counts it as a user."""
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "worker", "--migrate"],
            env=environment(data_dir), cwd=ROOT, stdout=log, stderr=log,
        )  # fmt: skip
        try:
            embedded = Embedded(data_dir)
            try:
                wait_until(
                    lambda: embedded.running() is not None and process.pid in user_pids(embedded),
                    timeout=120, what="the worker using a running server",
                )  # fmt: skip
            except AssertionError as exc:
                log.seek(0)
                said = log.read().decode(errors="replace")[-4000:]
                raise AssertionError(f"{exc} (exit {process.poll()}): {said}") from None
            yield process
        finally:
            process.kill()
            process.wait(timeout=30)


def user_pids(embedded: Embedded) -> list[int]:
    return [user.pid for user in embedded.users()]


def test_a_sigkilled_user_leaves_no_server_behind(data_dir: Path) -> None:
    embedded = Embedded(data_dir)
    with worker(data_dir) as user:
        postmaster = embedded.postmaster()
        status = orchestrator(data_dir, "db", "status")
        assert status.returncode == 0, status.stderr
        lines = status.stdout.splitlines()
        assert lines[0] == f"embedded PostgreSQL: running (pid {postmaster})"
        assert f"  data:     {data_dir / 'pgdata'}" in lines
        assert "  used by:  1 process(es)" in lines
        assert any(line.startswith(f"    {user.pid}  ") and "worker" in line for line in lines)
        assert any(line.startswith("  watchdog: pid ") for line in lines)

        user.send_signal(signal.SIGKILL)
        user.wait(timeout=10)
        wait_until(lambda: embedded.postmaster() is None, timeout=15, what="the server stopped")
    wait_until(lambda: embedded.watchdog() is None, timeout=5, what="the watchdog gone")
    status = orchestrator(data_dir, "db", "status")
    assert status.returncode == 3
    assert status.stdout == f"embedded PostgreSQL: not running (data {data_dir / 'pgdata'})\n"


def test_db_stop_refuses_while_the_server_is_in_use_and_force_stops_it(data_dir: Path) -> None:
    embedded = Embedded(data_dir)
    with worker(data_dir) as user:
        postmaster = embedded.postmaster()
        refused = orchestrator(data_dir, "db", "stop")
        assert refused.returncode == 2 and refused.stdout == ""
        assert refused.stderr == (
            f"error: the embedded PostgreSQL is in use by process(es) {user.pid} "
            "(orchestrator db status); stop them first, or use --force\n"
        )
        assert embedded.running() is not None

        forced = orchestrator(data_dir, "db", "stop", "--force")
        assert forced.returncode == 0, forced.stderr
        assert forced.stdout == f"embedded PostgreSQL: stopped (pid {postmaster})\n"
        assert embedded.postmaster() is None
        wait_until(lambda: embedded.watchdog() is None, timeout=5, what="the watchdog gone")
    again = orchestrator(data_dir, "db", "stop")
    assert (again.returncode, again.stdout) == (0, "embedded PostgreSQL: not running\n")


def test_the_server_runs_while_any_user_lives_and_stops_after_the_last(data_dir: Path) -> None:
    embedded = Embedded(data_dir)
    with worker(data_dir) as first:
        listed = orchestrator(data_dir, "jobs")  # a second user, come and gone
        assert listed.returncode == 0 and listed.stderr == "no jobs\n", listed.stderr
        time.sleep(2.5)  # the watchdog looked twice since
        assert embedded.running() is not None
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0
        wait_until(lambda: embedded.postmaster() is None, timeout=15, what="the server stopped")


def test_a_folder_without_a_server_is_told_a_new_one_is_made(tmp_path: Path) -> None:
    """A command that finds no embedded server where it looks says that it makes a new, empty
    one, where, and what names another (never silently); once made, not."""
    try:
        first = orchestrator(tmp_path, "jobs")
        assert (
            f"creating a new embedded PostgreSQL in {tmp_path.resolve() / 'pgdata'} (no"
            " .orchestrator with one here or above; DATABASE_URL or ORCHESTRATOR_DATA_DIR name"
        ) in first.stderr, first.stderr
        again = orchestrator(tmp_path, "jobs")
        assert "creating a new embedded" not in again.stderr, again.stderr
        embedded = Embedded(tmp_path)
        wait_until(lambda: embedded.postmaster() is None, timeout=30, what="the server stopped")
    finally:
        postmaster = Embedded(tmp_path).postmaster()
        if postmaster is not None:
            Embedded(tmp_path).stop(postmaster)
