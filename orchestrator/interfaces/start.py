"""The command line's entry point, which loads nothing heavy before it handles signals.

A worker must exit 0 on SIGTERM at any moment, also while Python is still importing the
application (a second or more): so ``orchestrator worker`` (and ``exporter``, ``serve``) first
makes SIGTERM and SIGINT end the process quietly; the worker replaces that with its drain as soon
as it starts (nothing can have been claimed before).

Importing the command line builds a large heap of modules that lives as long as the process. The
cyclic garbage collector is off while it is built and never looks at it again (``gc.freeze``),
at the exit neither: collecting it while it grew, and once more at the exit, took about a fifth
of a read command's time (bench/cli_latency.py).
"""

from __future__ import annotations

import gc
import signal
import sys
from collections.abc import Sequence


class StoppedBeforeStart(SystemExit):
    """SIGTERM or SIGINT came before the worker could drain: nothing was claimed yet.

    A SystemExit, because the signal may land while the event loop runs a callback (the
    start-up's connections, before the drain takes the signal over): asyncio lets SystemExit
    and KeyboardInterrupt out of the loop, and logs and swallows any other exception, which left
    the worker running on after the SIGTERM."""

    def __init__(self) -> None:
        super().__init__(0)


def stop_before_start(signum: int, frame: object) -> None:
    raise StoppedBeforeStart


def main(argv: Sequence[str] | None = None) -> int:
    if {"worker", "exporter", "serve"} & set(sys.argv[1:] if argv is None else argv):
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop_before_start)
    gc.disable()
    try:
        from orchestrator.interfaces import cli

        gc.freeze()
        gc.enable()
        return cli.main(argv)
    except StoppedBeforeStart:
        return 0
    finally:
        gc.freeze()
