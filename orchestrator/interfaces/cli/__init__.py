"""``orchestrator``: the command line.

Every command works on an application (``--app module:attribute``, or ``ORCHESTRATOR_APP``;
default ``tasks.app:orc``, the built-in job types), except ``db``, which looks at the embedded
server only. A user mistake, argparse's included, prints one ``error:`` line and exits 2; an
unreachable database exits 1; nothing prints a traceback for either. Output cut short by its
reader (``orchestrator jobs | head -1``) ends the command quietly with 141, as SIGPIPE would.

Each group of commands is a module of this package holding its sub-parsers and its handlers;
what they share is in ``shared``. This module puts the parser together and dispatches.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from orchestrator.interfaces.cli import (
    api,
    applications,
    approvals,
    config,
    db,
    demo,
    dlq,
    fleet,
    flow,
    jobs,
    prune,
    schedules,
    stats,
    tail,
    tokens,
    usage,
)
from orchestrator.interfaces.cli.shared import Parser, is_utf8, reported
from orchestrator.runtime import logs
from orchestrator.settings import Settings

DEFAULT_APP = "tasks.app:orc"
#: What adds each group's commands, in the order ``orchestrator --help`` lists them.
GROUPS = (
    fleet.add_parsers,
    applications.add_parsers,
    api.add_parsers,
    tokens.add_parsers,
    jobs.add_parsers,
    tail.add_parsers,
    stats.add_parsers,
    usage.add_parsers,
    jobs.add_cancel_parser,
    config.add_parsers,
    prune.add_parsers,
    dlq.add_parsers,
    approvals.add_parsers,
    schedules.add_parsers,
    flow.add_parsers,
    demo.add_parsers,
    db.add_parsers,
)


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    for argument in arguments:
        if not is_utf8(argument):
            print(
                f"error: an argument is not UTF-8 text: {os.fsencode(argument)!r}", file=sys.stderr
            )
            return 2
    args = build_parser().parse_args(arguments)

    def dispatch() -> int:
        _log_to_stderr(args)
        result: int = args.handler(args)
        return result

    return reported(dispatch)


def _log_to_stderr(args: argparse.Namespace) -> None:
    """Records go to stderr, secrets redacted, from WARNING up (INFO with ``-v``). A worker (the
    exporter, ``serve``) says what it does (its start, each job's outcome, each request) in
    ``ORCHESTRATOR_LOG_FORMAT``, read before its application is imported: importing it may log
    already."""
    server = args.command in ("worker", "exporter", "serve")
    log_format = Settings().log_format if server else "text"
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        handlers=[logs.OrchestratorHandler(log_format)],
    )  # nothing when the process has its own handlers already (it is not ours to change)
    if server:
        logging.getLogger("orchestrator").setLevel(logging.INFO)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="orchestrator", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--app",
        default=os.environ.get("ORCHESTRATOR_APP", DEFAULT_APP),
        help=f"the Orchestrator to use, as module:attribute (default {DEFAULT_APP})",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_parsers in GROUPS:
        add_parsers(commands)
    return parser
