"""``flow``: flow control's keys, listed with their limits, running and waiting jobs and pauses
(the default), paused for a while or resumed."""

from __future__ import annotations

import argparse
import os

from orchestrator.app import Orchestrator
from orchestrator.interfaces import render
from orchestrator.interfaces.cli.shared import (
    Commands,
    cli_actor,
    duration,
    on_app,
    print_list,
)


def add_parsers(commands: Commands) -> None:
    flow = commands.add_parser(
        "flow",
        help="flow control: the keys (limits, running, waiting, pauses); pause or resume one",
    )
    flow.set_defaults(handler=cmd_flow_list)
    actions = flow.add_subparsers(dest="flow_command", metavar="ACTION")
    cmd = actions.add_parser("list", help="every key with its use, waiters and pause (default)")
    cmd.set_defaults(handler=cmd_flow_list)
    cmd = actions.add_parser("pause", help="no job of a key starts for a while")
    cmd.add_argument("key")
    cmd.add_argument(
        "--for", dest="seconds", type=_seconds, required=True, help="how long: 90, 30s, 10m, 2h"
    )
    cmd.add_argument("--reason", default="", help="why")
    cmd.add_argument("--by", default=os.environ.get("USER", "cli"), help="who pauses it")
    cmd.set_defaults(handler=cmd_flow_steer, action="pause")
    cmd = actions.add_parser("resume", help="lift a key's pause: its waiting jobs start at once")
    cmd.add_argument("key")
    cmd.set_defaults(handler=cmd_flow_steer, action="resume")


def _seconds(text: str) -> float:
    """A pause's length: a duration of 30 days at most."""
    value = duration(text)
    if value > 86_400 * 30:
        raise argparse.ArgumentTypeError(f"{text!r} is not between 0 and 30 days")
    return value


@on_app
async def cmd_flow_list(args: argparse.Namespace, orc: Orchestrator) -> int:
    empty = "no flow keys (no job under a limit has been claimed yet)"
    print_list(await orc.flow_keys(), render.flow_key_line, empty, head=render.FLOW_KEY_HEAD)
    return 0


@on_app
async def cmd_flow_steer(args: argparse.Namespace, orc: Orchestrator) -> int:
    if args.action == "pause":
        key = await orc.pause_flow_key(
            args.key, seconds=args.seconds, reason=args.reason, by=cli_actor(args.by)
        )
    else:
        key = await orc.resume_flow_key(args.key)
    print(render.flow_key_line(key))
    return 0
