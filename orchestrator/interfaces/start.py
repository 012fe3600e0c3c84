"""The command line's entry point, which loads nothing heavy before it handles signals.

A worker must exit 0 on SIGTERM at any moment, also while Python is still importing the
application (a second or more): so ``orchestrator worker`` (and ``exporter``, ``serve``) first
makes SIGTERM and SIGINT end the process at once, with 0; the worker's drain (uvicorn's
graceful shutdown, for ``serve``) takes them over as soon as it starts, and nothing can have
been claimed before.

Importing the command line builds a large heap of modules that lives as long as the process. The
cyclic garbage collector is off while it is built and never looks at it again (``gc.freeze``),
at the exit neither: collecting it while it grew, and once more at the exit, took about a fifth
of a read command's time (bench/cli_latency.py).
"""

from __future__ import annotations

import gc
import os
import signal
import sys
from collections.abc import Sequence


def stop_before_start(signum: int, frame: object) -> None:
    """Ends the process at once, with 0. Not by raising, as KeyboardInterrupt does: an exception
    raised by a signal handler is lost where Python cannot raise it (a weakref callback or a
    destructor run during an import: "Exception ignored in ...") or where it is caught (a
    callback of the event loop, which asyncio logs and swallows): the process then ran on."""
    os._exit(0)


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
    finally:
        gc.freeze()
