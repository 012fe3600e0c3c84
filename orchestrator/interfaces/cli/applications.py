"""``applications``: the applications sharing the database (docs/applications.md), each with its
live processes, config versions, job types, limits and schedules, the declarations of it that
were refused; and the waiting jobs that no live application serves."""

from __future__ import annotations

import argparse

from orchestrator.app import Orchestrator
from orchestrator.interfaces import render
from orchestrator.interfaces.cli.shared import Commands, on_app, tenant


def add_parsers(commands: Commands) -> None:
    cmd = commands.add_parser(
        "applications",
        help="the applications sharing the database, and the waiting jobs none of them serves",
    )
    cmd.add_argument("--tenant", type=tenant, help="only what names this tenant")
    cmd.add_argument("--json", action="store_true", help="print the API's JSON document")
    cmd.set_defaults(handler=cmd_applications)


@on_app
async def cmd_applications(args: argparse.Namespace, orc: Orchestrator) -> int:
    found = await orc.applications(tenants=None if args.tenant is None else [args.tenant])
    if args.json:
        print(found.model_dump_json(indent=2))
    else:
        print("\n".join(render.application_lines(found)))
    return 0
