"""Worker processes for crash, freeze and drain tests: the real CLI, real signals.

Intervals are shortened through the environment (the settings every deployment reads), never by
patching: heartbeats every 0.2 s, zombies after 1.5 s, the sweep every second.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support import agent_app, log_guard
from tests.support.harness import config_with

ROOT = Path(__file__).resolve().parents[2]

FAST = {
    "ORCHESTRATOR_HEARTBEAT_INTERVAL": "0.2",
    "ORCHESTRATOR_ZOMBIE_THRESHOLD": "1.5",
    "ORCHESTRATOR_SWEEP_CRON": "* * * * * *",
    "ORCHESTRATOR_FETCH_POLLING_INTERVAL": "0.5",
    "ORCHESTRATOR_HEALTH_PORT": "0",
    "ORCHESTRATOR_RETRY_CONFIG": str(config_with(agent_app.TABLE)),  # the default app's
}


class WorkerProcess:
    """``orchestrator --app APP worker`` in its own process, logging to a temporary file."""

    def __init__(self, dsn: str, app: str = "tests.support.agent_app:orc", **env: Any) -> None:
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - kept open for the process
            prefix="worker-", suffix=".log", delete=False
        )
        environment = {**os.environ, **FAST, "DATABASE_URL": dsn, "PYTHONUNBUFFERED": "1"}
        environment.update({key: str(value) for key, value in env.items()})
        self.process = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "--app", app, "-v", "worker"],
            cwd=ROOT,
            env=environment,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        log_guard.watch(f"worker {app}", self.process, self.log.name)

    @property
    def pid(self) -> int:
        return self.process.pid

    def signal(self, sig: signal.Signals) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout: float = 30) -> int:
        return self.process.wait(timeout=timeout)

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait(timeout=10)

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.log.close()
        os.unlink(self.log.name)


def wait_until(condition: Any, timeout: float = 30, what: str = "condition") -> None:
    """Blocking poll, for conditions observed from outside the workers."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s")
        time.sleep(0.05)


def until_it_handles_sigterm(pid: int, timeout: float = 30) -> None:
    """Until the process catches SIGTERM (its SigCgt mask in /proc): the interpreter has
    started and run the entry point's first lines; under load that can take a while."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = Path(f"/proc/{pid}/status").read_text()
        caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:"))
                     .split()[1], 16)  # fmt: skip
        if caught & (1 << (signal.SIGTERM - 1)):
            return
        time.sleep(0.002)
    raise AssertionError(f"process {pid} never caught SIGTERM")
