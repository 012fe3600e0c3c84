"""``schedules``: the users' schedules, listed with their next and last run (the default),
paused or resumed."""

from __future__ import annotations

import argparse
import os

from orchestrator.app import Orchestrator
from orchestrator.interfaces import render
from orchestrator.interfaces.cli.shared import Commands, cli_actor, on_app, print_list


def add_parsers(commands: Commands) -> None:
    schedules = commands.add_parser(
        "schedules", help="the schedules: list them (next and last run), pause or resume one"
    )
    schedules.set_defaults(handler=cmd_schedules_list)
    actions = schedules.add_subparsers(dest="schedules_command", metavar="ACTION")
    cmd = actions.add_parser("list", help="every schedule with its next and last run (default)")
    cmd.set_defaults(handler=cmd_schedules_list)
    for action in ("pause", "resume"):
        cmd = actions.add_parser(
            action, help="hold a schedule: none of its ticks runs" if action == "pause" else
            "let a paused schedule run again from its next tick",
        )  # fmt: skip
        cmd.add_argument("name")
        if action == "pause":
            cmd.add_argument("--by", default=os.environ.get("USER", "cli"), help="who holds it")
        cmd.set_defaults(handler=cmd_schedules_steer, action=action)


@on_app
async def cmd_schedules_list(args: argparse.Namespace, orc: Orchestrator) -> int:
    schedules = await orc.list_schedules()
    print_list(schedules, render.schedule_line, "no schedules", head=render.SCHEDULE_HEAD)
    return 0


@on_app
async def cmd_schedules_steer(args: argparse.Namespace, orc: Orchestrator) -> int:
    if args.action == "pause":
        view = await orc.pause_schedule(args.name, by=cli_actor(args.by))
    else:
        view = await orc.resume_schedule(args.name)
    print(render.schedule_line(view))
    return 0
