"""``stats``: jobs finished per step and the queue depth over a time range, from the rollups."""

from __future__ import annotations

import argparse

from orchestrator.app import Orchestrator
from orchestrator.interfaces import render
from orchestrator.interfaces.cli.shared import (
    Commands,
    csv_list,
    duration,
    on_app,
    tenant,
    time_or_age,
)


def add_parsers(commands: Commands) -> None:
    cmd = commands.add_parser(
        "stats", help="jobs finished per step and the queue depth, from the rollups"
    )
    cmd.add_argument(
        "--from", dest="since", type=time_or_age,
        help="start: ISO 8601 with a timezone, or an age (30m, 24h, 7d); default: an hour ago",
    )  # fmt: skip
    cmd.add_argument("--to", dest="until", type=time_or_age, help="end, as --from (default: now)")
    cmd.add_argument(
        "--step", type=_step,
        help="per point: whole minutes, as seconds or 5m, 1h, 1d (default 1m; 1h past a day)",
    )  # fmt: skip
    cmd.add_argument(
        "--by", type=csv_list, default=[],
        help="split by any of job_type (or type), queue, tenant, comma-separated",
    )  # fmt: skip
    cmd.add_argument("--tenant", type=tenant, help="only this tenant's jobs")
    cmd.add_argument("--json", action="store_true", help="print the API's JSON document")
    cmd.set_defaults(handler=cmd_stats)


def _step(text: str) -> int:
    """A step: a duration of whole seconds, from a minute to a year (the rollups say whether
    they can answer it: whole minutes, whole hours past a day)."""
    value = duration(text)
    if not value.is_integer() or not 60 <= value <= 366 * 86400:
        raise argparse.ArgumentTypeError(
            f"must be whole seconds from 1m to 366d, got {text!r} (e.g. 60, 5m, 1h)"
        )
    return int(value)


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
