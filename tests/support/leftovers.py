"""No process a test starts outlives the test run: a pytest plugin that fails the run otherwise.

The run's first process (pytest itself, or the xdist controller) marks its environment with a
run id before anything starts; every process started during the run (workers, servers, browsers,
the embedded PostgreSQL and its watchdog) inherits it. When the run ends, the processes that
still carry the mark are given GRACE seconds to end by themselves (the embedded server stops
once its last user is gone, orchestrator.storage.embedded), then killed, and the run fails with
one line naming each. The embedded server and its watchdog are left alone while this process
is one of its users (a run without xdist): they stop once it exits (tests/test_embedded.py).
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid

import psutil
import pytest

from orchestrator.storage.embedded import Embedded
from tests.support.workers import ROOT

MARK = "ORCHESTRATOR_TEST_RUN"
#: Seconds they have to end by themselves: the embedded server's watchdog looks every second, and
#: a stop takes 30 s at most (a test of this plugin sets less).
GRACE = float(os.environ.get("ORCHESTRATOR_LEFTOVER_GRACE", "45"))


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the run's first process: xdist's workers inherit
        os.environ[MARK] = uuid.uuid4().hex


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):
        return  # the controller checks, once every worker has ended
    exempt = _embedded_waiting_for_me()
    left = _ended_or_killed([p for p in carrying(os.environ[MARK]) if p.pid not in exempt])
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = [f"{p.pid} {' '.join(cmdline)[:200]}" for p, cmdline in left]
        message = "processes the test run started outlived it (killed): " + "; ".join(lines)
        if reporter is not None:
            reporter.write_line(message, red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def carrying(run: str) -> list[psutil.Process]:
    """Every other process whose environment holds this run's mark."""
    found = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        try:
            if process.environ().get(MARK) == run:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _embedded_waiting_for_me() -> set[int]:
    """The embedded server's processes and its watchdog, if this process is among its users."""
    embedded = Embedded(ROOT / ".orchestrator")
    if os.getpid() not in {user.pid for user in embedded.users()}:
        return set()
    postmaster = embedded.postmaster()
    watchdog = embedded.watchdog()
    pids = {watchdog.pid} if watchdog is not None else set()
    if postmaster is not None:
        with contextlib.suppress(psutil.NoSuchProcess):
            server = psutil.Process(postmaster)
            pids |= {postmaster, *(child.pid for child in server.children(recursive=True))}
    return pids


def _ended_or_killed(processes: list[psutil.Process]) -> list[tuple[psutil.Process, list[str]]]:
    """Those of ``processes`` still alive after GRACE seconds, killed, with their command lines."""
    deadline = time.monotonic() + GRACE
    alive = processes
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if _running(p)]
    killed = []
    for process in alive:
        try:
            cmdline = process.cmdline()
            process.kill()
        except psutil.NoSuchProcess:
            continue
        killed.append((process, cmdline))
    return killed


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
