"""``applications``: the applications sharing the database (docs/applications.md), each with its
live processes, config versions, job types, limits and schedules, the declarations of it that
were refused; and the waiting jobs that no live application serves. ``applications forget
NAME``: withdraw all an application gone for good declares."""

from __future__ import annotations

import argparse

from orchestrator.app import Orchestrator
from orchestrator.interfaces import render
from orchestrator.interfaces.cli.shared import Commands, on_app, tenant


def add_parsers(commands: Commands) -> None:
    applications = commands.add_parser(
        "applications",
        help="the applications sharing the database, and the waiting jobs none of them serves",
    )
    applications.set_defaults(handler=cmd_applications, tenant=None, json=False)
    actions = applications.add_subparsers(dest="applications_command", metavar="ACTION")
    cmd = actions.add_parser("list", help="each application and the unserved jobs (default)")
    cmd.add_argument("--tenant", type=tenant, help="only what names this tenant")
    cmd.add_argument("--json", action="store_true", help="print the API's JSON document")
    cmd.set_defaults(handler=cmd_applications)
    cmd = actions.add_parser(
        "forget", help="withdraw all an application gone for good declares (none of it live)"
    )
    cmd.add_argument("name")
    cmd.set_defaults(handler=cmd_forget)


@on_app
async def cmd_applications(args: argparse.Namespace, orc: Orchestrator) -> int:
    found = await orc.applications(tenants=None if args.tenant is None else [args.tenant])
    if args.json:
        print(found.model_dump_json(indent=2))
    else:
        print("\n".join(render.application_lines(found)))
    return 0


@on_app
async def cmd_forget(args: argparse.Namespace, orc: Orchestrator) -> int:
    gone = await orc.forget_application(args.name)
    print(f"forgot application {args.name!r}: " + (", ".join(gone) or "it declared nothing"))
    return 0
