"""``prune``: one run of retention now (prune_finished), or with ``--dry-run`` what it would
delete."""

from __future__ import annotations

import argparse

from orchestrator.app import Orchestrator
from orchestrator.interfaces import render
from orchestrator.interfaces.cli.shared import Commands, UsageError, on_app


def add_parsers(commands: Commands) -> None:
    cmd = commands.add_parser(
        "prune", help="delete the finished jobs past their retention now (one run of"
        " prune_finished), and the bookkeeping that aged out",
    )  # fmt: skip
    cmd.add_argument(
        "--dry-run", action="store_true", help="delete nothing: show what the run would delete,"
        " by kind and by job type",
    )  # fmt: skip
    cmd.set_defaults(handler=cmd_prune)


@on_app
async def cmd_prune(args: argparse.Namespace, orc: Orchestrator) -> int:
    service = orc.maintenance.finished
    if args.dry_run:
        result = await service.preview()
    else:
        try:
            result = await service.run_once()
        except OSError as exc:  # the archive directory: missing rights, a full disk
            raise UsageError(
                f"cannot write the archive ({exc}): the jobs it would hold were not deleted"
            ) from None
    for line in render.prune_lines(result, dry_run=args.dry_run):
        print(line)
    return 0
