"""The run's check that no process it started outlives it (tests/support/leftovers.py), on a
pytest run of its own: a test that leaves a process running fails the run, and the process is
killed; a run that leaves none passes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.support.workers import ROOT

LEAKY = """
import subprocess, sys
from pathlib import Path

def test_starts_a_process_and_forgets_it():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path("{pid_file}").write_text(str(sleeper.pid))
"""
TIDY = """
import subprocess, sys

def test_starts_a_process_and_ends_it():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    sleeper.kill()
    sleeper.wait()
"""


def run(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_inner.py").write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         "-p", "tests.support.leftovers", "--rootdir", str(tmp_path), "-c",
         str(tmp_path / "pytest.ini"), str(tmp_path / "test_inner.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), "ORCHESTRATOR_LEFTOVER_GRACE": "1"},
    )  # fmt: skip


def test_a_process_left_running_fails_the_run_and_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    done = run(tmp_path, LEAKY.format(pid_file=pid_file))
    pid = int(pid_file.read_text())
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout + done.stderr
    assert "outlived it (killed)" in done.stdout and f"{pid} " in done.stdout, done.stdout
    deadline = time.monotonic() + 30
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"process {pid} still runs"
        time.sleep(0.05)


def test_a_run_that_ends_its_processes_passes(tmp_path: Path) -> None:
    done = run(tmp_path, TIDY)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "outlived" not in done.stdout
