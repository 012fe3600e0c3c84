"""``usage``: token accounting, the LLM calls and their tokens over a time range, grouped."""

from __future__ import annotations

import argparse
import json

from orchestrator.app import Orchestrator
from orchestrator.interfaces import render
from orchestrator.interfaces.cli.shared import (
    Commands,
    nothing,
    on_app,
    tenant,
    time_or_age,
    whole,
)


def add_parsers(commands: Commands) -> None:
    cmd = commands.add_parser(
        "usage", help="LLM calls and their tokens over a time range, grouped (token accounting)"
    )
    cmd.add_argument(
        "--since", type=time_or_age,
        help="start: ISO 8601 with a timezone, or an age (30m, 24h, 7d); default: everything"
        " recorded",
    )  # fmt: skip
    cmd.add_argument("--until", type=time_or_age, help="end, as --since (default: now)")
    cmd.add_argument(
        "--by", default="tenant,model",
        help="group by any of job, tenant, agent, model, job_type (default tenant,model;"
        " '' for one total)",
    )  # fmt: skip
    cmd.add_argument("--tenant", type=tenant, help="only this tenant's jobs")
    cmd.add_argument("--agent", help="only this agent's jobs")
    cmd.add_argument("--model", help="only calls to this model")
    cmd.add_argument("--type", dest="job_type", help="only jobs of this type")
    cmd.add_argument("--job", dest="job_id", help="only this job's calls")
    cmd.add_argument(
        "--limit", type=whole(1, 99_999), default=1000, help="most groups shown (default 1000)"
    )
    cmd.add_argument("--json", action="store_true", help="print the totals as JSON")
    cmd.set_defaults(handler=cmd_usage)


@on_app
async def cmd_usage(args: argparse.Namespace, orc: Orchestrator) -> int:
    totals = await orc.llm_usage(
        by=args.by, since=args.since, until=args.until, tenant_id=args.tenant,
        agent_id=args.agent, model=args.model, job_type=args.job_type, job_id=args.job_id,
        limit=args.limit + 1,
    )  # fmt: skip
    cut = len(totals) > args.limit
    totals = totals[: args.limit]
    if args.json:
        print(json.dumps([t.model_dump(mode="json") for t in totals], indent=2))
    else:
        print("\n".join(render.usage_lines(totals, args.by, args.since, args.until)))
    if cut:  # the largest groups were shown; "all" sums those only
        nothing(f"the {args.limit} largest groups shown; more match (--limit to see more)")
    return 0
