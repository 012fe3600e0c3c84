"""``dlq``: the dead letters, listed and shown, requeued, or discarded by two reviewers (one
requests, another confirms)."""

from __future__ import annotations

import argparse

from orchestrator.app import Orchestrator
from orchestrator.interfaces import render
from orchestrator.interfaces.cli.shared import (
    MAX_LIMIT,
    Commands,
    UsageError,
    cli_actor,
    of_tenant,
    on_app,
    print_list,
    tenant,
    whole,
)

DEAD_LETTER_STATES = ["recorded", "discard_requested", "requeued", "discarded"]


def add_parsers(commands: Commands) -> None:
    dlq = commands.add_parser("dlq", help="dead letters").add_subparsers(
        dest="dlq_command", required=True, metavar="ACTION"
    )
    cmd = dlq.add_parser("list", help="list dead letters, newest first")
    cmd.add_argument("--state", type=str.lower, choices=DEAD_LETTER_STATES)
    cmd.add_argument("--tenant", type=tenant, help="only this tenant's dead letters")
    cmd.add_argument(
        "--limit", type=whole(1, MAX_LIMIT), default=50, help="most shown (default 50)"
    )
    cmd.set_defaults(handler=cmd_dlq_list)
    cmd = dlq.add_parser("show", help="one dead letter: its job, error, review and payload")
    cmd.add_argument("dead_letter_id")
    cmd.set_defaults(handler=cmd_dlq_show)
    cmd = dlq.add_parser("requeue", help="submit a new job from a dead letter")
    cmd.add_argument("dead_letter_id")
    cmd.set_defaults(handler=cmd_dlq_requeue)
    cmd = dlq.add_parser(
        "discard", help="request (with --reason) or confirm (by a second reviewer) a discard"
    )
    cmd.add_argument("dead_letter_id")
    cmd.add_argument("--by", required=True, help="the reviewer")
    cmd.add_argument("--reason", help="why (required to request)")
    cmd.set_defaults(handler=cmd_dlq_discard)


@on_app
async def cmd_dlq_list(args: argparse.Namespace, orc: Orchestrator) -> int:
    letters = await orc.dead_letters(state=args.state, tenant_id=args.tenant, limit=args.limit + 1)
    state = args.state + " " if args.state else ""
    empty = f"no {state}dead letters{of_tenant(args.tenant)}"
    print_list(
        letters, render.dead_letter_line, empty, head=render.DEAD_LETTER_HEAD, limit=args.limit
    )
    return 0


@on_app
async def cmd_dlq_show(args: argparse.Namespace, orc: Orchestrator) -> int:
    print(render.describe_dead_letter(await orc.dead_letter(args.dead_letter_id)))
    return 0


@on_app
async def cmd_dlq_requeue(args: argparse.Namespace, orc: Orchestrator) -> int:
    print(await orc.requeue_dead_letter(args.dead_letter_id))
    return 0


@on_app
async def cmd_dlq_discard(args: argparse.Namespace, orc: Orchestrator) -> int:
    """With --reason, the first review (the request); without, the second (the confirmation),
    which only a requested discard can have."""
    if args.reason is not None:
        await orc.request_discard(args.dead_letter_id, by=cli_actor(args.by), reason=args.reason)
        print(f"discard requested by {args.by}; a second reviewer must confirm it")
        return 0
    letter = await orc.dead_letter(args.dead_letter_id)
    if letter.state == "recorded":
        raise UsageError(
            f"--reason is required: it requests the discard of dead letter {letter.id}, "
            "which a second reviewer then confirms (without --reason)"
        )
    await orc.confirm_discard(letter.id, by=cli_actor(args.by))
    print(f"discarded (confirmed by {args.by})")
    return 0
