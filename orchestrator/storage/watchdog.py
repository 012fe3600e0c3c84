"""``python -m orchestrator.storage.watchdog DATA_DIR``: stops the embedded server once no
process registered as its user is alive (orchestrator.storage.embedded), then exits.

Started with the server, in a session of its own. It looks every second, under the same lock a
process takes to register, so a process that registers while it stops the server finds the
server stopped and starts it again. It also exits when the server was stopped by someone else
(``orchestrator db stop``).
"""

from __future__ import annotations

import os
import sys
import time
from datetime import datetime
from pathlib import Path

from orchestrator.storage.embedded import Embedded

CHECK_EVERY = 1.0  # seconds


def watch(embedded: Embedded) -> str:
    """Wait until the server should stop or has stopped; say which."""
    while True:
        time.sleep(CHECK_EVERY)
        with embedded.locked():
            postmaster = embedded.postmaster()
            if postmaster is None:
                outcome = "the server was stopped"
            elif embedded.users():
                continue
            else:
                embedded.prune()
                embedded.stop(postmaster)
                outcome = f"no process uses the server any more: stopped it (pid {postmaster})"
            if (watchdog := embedded.watchdog()) is not None and watchdog.pid == os.getpid():
                embedded.watchdog_file.unlink()
            return outcome


def main(argv: list[str]) -> int:
    embedded = Embedded(Path(argv[0]))
    say(f"watching {embedded.pgdata}")
    say(watch(embedded))
    return 0


def say(line: str) -> None:
    print(f"{datetime.now().isoformat(timespec='seconds')} watchdog {os.getpid()}: {line}",
          flush=True)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
