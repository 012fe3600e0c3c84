"""``stats``: jobs finished per step and the queue depth over a time range, from the rollups."""

from __future__ import annotations

import argparse

from orchestrator.app import Orchestrator
from orchestrator.interfaces import render
from orchestrator.interfaces.cli.shared import (
    Commands,
    csv_list,
    iso_time,
    on_app,
    tenant,
    whole,
)


def add_parsers(commands: Commands) -> None:
    cmd = commands.add_parser(
        "stats", help="jobs finished per step and the queue depth, from the rollups"
    )
    cmd.add_argument("--from", dest="since", type=iso_time, help="start (default: an hour ago)")
    cmd.add_argument("--to", dest="until", type=iso_time, help="end (default: now)")
    cmd.add_argument(
        "--step", type=whole(60, 366 * 86400),
        help="seconds per point, whole minutes (default 60; 3600 past a day)",
    )  # fmt: skip
    cmd.add_argument("--by", type=csv_list, default=[], help="split by job_type, queue, tenant")
    cmd.add_argument("--tenant", type=tenant, help="only this tenant's jobs")
    cmd.add_argument("--json", action="store_true", help="print the API's JSON document")
    cmd.set_defaults(handler=cmd_stats)


@on_app
async def cmd_stats(args: argparse.Namespace, orc: Orchestrator) -> int:
    stats = await orc.stats(
        since=args.since, until=args.until, step=args.step, by=args.by,
        tenants=None if args.tenant is None else [args.tenant],
    )  # fmt: skip
    if args.json:
        print(stats.model_dump_json(by_alias=True, indent=2))
    else:
        print("\n".join(render.stats_lines(stats)))
    return 0
