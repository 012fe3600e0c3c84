"""``dlq``: the dead letters, listed (those awaiting review by default) and shown, requeued, or
discarded by two reviewers (one requests, another confirms); one letter, several, or every open
one matching filters (``--all-matching``), at most BULK_MAX a run."""

from __future__ import annotations

import argparse
from uuid import UUID

from orchestrator.app import Orchestrator
from orchestrator.domain.dead_letters import BULK_MAX, SHOWN, BulkReview
from orchestrator.domain.errors import DeadLetterNotFound
from orchestrator.facade.arguments import uuid_of
from orchestrator.interfaces import render
from orchestrator.interfaces.cli.shared import (
    MAX_LIMIT,
    Commands,
    UsageError,
    cli_actor,
    nothing,
    of_tenant,
    on_app,
    print_list,
    tenant,
    whole,
)


def add_parsers(commands: Commands) -> None:
    dlq = commands.add_parser("dlq", help="dead letters").add_subparsers(
        dest="dlq_command", required=True, metavar="ACTION"
    )
    cmd = dlq.add_parser("list", help="list dead letters, newest first (open ones by default)")
    cmd.add_argument(
        "--state", type=str.lower, choices=list(SHOWN), default="open",
        help="open (default: awaiting review), all, or one state",
    )  # fmt: skip
    _filters(cmd)
    cmd.add_argument(
        "--limit", type=whole(1, MAX_LIMIT), default=50, help="most shown (default 50)"
    )
    cmd.set_defaults(handler=cmd_dlq_list)
    cmd = dlq.add_parser("show", help="one dead letter: its job, error, review and payload")
    cmd.add_argument("dead_letter_id")
    cmd.set_defaults(handler=cmd_dlq_show)
    cmd = dlq.add_parser(
        "requeue", help="submit a new job from each dead letter given (or --all-matching)"
    )
    _selection(cmd)
    cmd.set_defaults(handler=cmd_dlq_requeue)
    cmd = dlq.add_parser(
        "discard", help="request (with --reason) or confirm (by a second reviewer) discards"
    )
    _selection(cmd)
    cmd.add_argument("--by", required=True, help="the reviewer")
    cmd.add_argument("--reason", help="why (required to request)")
    cmd.set_defaults(handler=cmd_dlq_discard)


def _filters(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--type", dest="job_type", help="only letters of this job type")
    cmd.add_argument("--tenant", type=tenant, help="only this tenant's dead letters")
    cmd.add_argument(
        "--error", help="only letters whose error has this in its code, message or class "
        "(any case: HTTP_400, timeout, transient, ...)",
    )  # fmt: skip


def _selection(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("dead_letter_ids", nargs="*", metavar="DEAD_LETTER_ID")
    cmd.add_argument(
        "--all-matching", action="store_true",
        help=f"every letter the action can take matching --type/--tenant/--error (none: all), "
        f"newest first, at most {BULK_MAX} a run",
    )  # fmt: skip
    _filters(cmd)


@on_app
async def cmd_dlq_list(args: argparse.Namespace, orc: Orchestrator) -> int:
    letters = await orc.dead_letters(
        state=args.state, job_type=args.job_type, tenant_id=args.tenant, error=args.error,
        limit=args.limit + 1,
    )  # fmt: skip
    state = "" if args.state == "all" else args.state + " "
    empty = f"no {state}dead letters{of_tenant(args.tenant)}"
    print_list(
        letters, render.dead_letter_line, empty, head=render.DEAD_LETTER_HEAD, limit=args.limit
    )
    return 0


@on_app
async def cmd_dlq_show(args: argparse.Namespace, orc: Orchestrator) -> int:
    print(
        render.describe_dead_letter(
            await orc.dead_letter(await _letter_id(orc, args.dead_letter_id))
        )
    )
    return 0


@on_app
async def cmd_dlq_requeue(args: argparse.Namespace, orc: Orchestrator) -> int:
    if (single := await _single(args, orc)) is not None:
        print(await orc.requeue_dead_letter(single))
        return 0
    ids = await _ids(args, orc)
    review = await orc.requeue_dead_letters(
        ids, job_type=args.job_type, tenant_id=args.tenant, error=args.error
    )
    return _said(review, args)


@on_app
async def cmd_dlq_discard(args: argparse.Namespace, orc: Orchestrator) -> int:
    """With --reason, the first review (the request); without, the second (the confirmation),
    which only a requested discard can have."""
    by = cli_actor(args.by)
    if (single := await _single(args, orc)) is not None:
        return await _discard_one(args, orc, single, by)
    ids = await _ids(args, orc)
    if args.reason is not None:
        review = await orc.request_discards(
            ids, by=by, reason=args.reason, job_type=args.job_type, tenant_id=args.tenant,
            error=args.error,
        )  # fmt: skip
    else:
        review = await orc.confirm_discards(
            ids, by=by, job_type=args.job_type, tenant_id=args.tenant, error=args.error
        )
    return _said(review, args)


async def _discard_one(
    args: argparse.Namespace, orc: Orchestrator, letter_id: UUID, by: str
) -> int:
    if args.reason is not None:
        await orc.request_discard(letter_id, by=by, reason=args.reason)
        print(f"discard requested by {args.by}; a second reviewer must confirm it")
        return 0
    letter = await orc.dead_letter(letter_id)
    if letter.state == "recorded":
        raise UsageError(
            f"--reason is required: it requests the discard of dead letter {letter.id}, "
            "which a second reviewer then confirms (without --reason)"
        )
    await orc.confirm_discard(letter.id, by=by)
    print(f"discarded (confirmed by {args.by})")
    return 0


async def _single(args: argparse.Namespace, orc: Orchestrator) -> UUID | None:
    """The one letter given by id, without --all-matching (None: several, or a filter)."""
    if args.all_matching and args.dead_letter_ids:
        raise UsageError("give dead letter ids or --all-matching, not both")
    filtered = (args.job_type, args.tenant, args.error) != (None, None, None)
    if filtered and not args.all_matching:
        raise UsageError("--type, --tenant and --error choose letters with --all-matching")
    if not args.all_matching and not args.dead_letter_ids:
        raise UsageError("give one or more dead letter ids, or --all-matching (with filters)")
    if len(args.dead_letter_ids) == 1:
        return await _letter_id(orc, args.dead_letter_ids[0])
    return None


async def _ids(args: argparse.Namespace, orc: Orchestrator) -> list[UUID] | None:
    if args.all_matching:
        return None
    if len(args.dead_letter_ids) > BULK_MAX:
        raise UsageError(
            f"at most {BULK_MAX} dead letter ids a run, got {len(args.dead_letter_ids)}"
        )
    return [await _letter_id(orc, given) for given in args.dead_letter_ids]


async def _letter_id(orc: Orchestrator, given: str) -> UUID:
    """A dead letter's id; a dead job's id is refused, naming its letter's id to use."""
    letter_id = uuid_of(given, "dead letter")
    try:
        return (await orc.dead_letter(letter_id)).id
    except DeadLetterNotFound:
        letter = await orc.dead_letter_of_job(letter_id)
        if letter is None:
            raise
        raise UsageError(
            f"{letter_id} is a job's id, not a dead letter's: its dead letter is {letter.id} "
            f"(orchestrator dlq show {letter.id})"
        ) from None


def _said(review: BulkReview, args: argparse.Namespace) -> int:
    """Each letter's outcome on a line, then how many: 0 when every letter was acted on, 1
    when one was refused or not found (the others are done all the same)."""
    for outcome in review.outcomes:
        done = f"requeued as job {outcome.job_id}" if outcome.job_id else outcome.outcome
        print(f"{outcome.dead_letter_id}  {outcome.detail if outcome.detail else done}")
    action = "requeued" if args.dlq_command == "requeue" else (
        "discard requested" if args.reason is not None else "discarded"
    )  # fmt: skip
    total = len(review.outcomes)
    if not total:
        nothing(f"no dead letter matches{of_tenant(args.tenant)}")
        return 0
    summary = f"{action}: {review.done} of {total} dead letter{'s' * (total != 1)}"
    if review.refused:
        summary += f", {review.refused} refused or not found"
    if review.more:
        summary += f"; more match (at most {BULK_MAX} a run): run it again"
    print(summary)
    return 1 if review.refused else 0
