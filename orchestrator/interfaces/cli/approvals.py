"""``approvals``: the approval gates, listed (pending ones by default), approved or rejected."""

from __future__ import annotations

import argparse

from orchestrator.app import Orchestrator
from orchestrator.interfaces import render
from orchestrator.interfaces.cli.shared import (
    MAX_LIMIT,
    Commands,
    cli_actor,
    on_app,
    print_list,
    whole,
)

APPROVAL_STATUSES = ["pending", "approved", "rejected", "expired", "cancelled", "all"]


def add_parsers(commands: Commands) -> None:
    approvals = commands.add_parser("approvals", help="approval gates").add_subparsers(
        dest="approvals_command", required=True, metavar="ACTION"
    )
    cmd = approvals.add_parser("list", help="list approvals (pending ones by default)")
    cmd.add_argument("--status", default="pending", type=str.lower, choices=APPROVAL_STATUSES)
    cmd.add_argument(
        "--limit", type=whole(1, MAX_LIMIT), default=50, help="most shown (default 50)"
    )
    cmd.set_defaults(handler=cmd_approvals_list)
    for action, done in (("approve", "approved"), ("reject", "rejected")):
        cmd = approvals.add_parser(action, help=f"{action} a waiting step")
        cmd.add_argument("approval_id")
        cmd.add_argument("--by", required=True, help="who decides")
        cmd.add_argument("--reason", default="", required=action == "reject", help="why")
        cmd.set_defaults(handler=cmd_approvals_decide, action=action, done=done)


@on_app
async def cmd_approvals_list(args: argparse.Namespace, orc: Orchestrator) -> int:
    status = None if args.status == "all" else args.status
    approvals = await orc.approvals(status=status, limit=args.limit + 1)
    empty = f"no {status + ' ' if status else ''}approvals"
    print_list(approvals, render.approval_line, empty, head=render.APPROVAL_HEAD, limit=args.limit)
    return 0


@on_app
async def cmd_approvals_decide(args: argparse.Namespace, orc: Orchestrator) -> int:
    if args.action == "approve":
        await orc.approve(args.approval_id, by=cli_actor(args.by), reason=args.reason)
    else:
        await orc.reject(args.approval_id, by=cli_actor(args.by), reason=args.reason)
    print(f"{args.done} {args.approval_id} (by {args.by})")
    return 0
