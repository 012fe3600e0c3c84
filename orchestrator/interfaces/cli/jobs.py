"""Jobs, one by one: ``submit`` one, read them (``status`` of one, ``jobs`` to list them),
``cancel`` one."""

from __future__ import annotations

import argparse
import json
import os

from orchestrator.app import Orchestrator
from orchestrator.domain.states import Status
from orchestrator.interfaces import render
from orchestrator.interfaces.cli.shared import (
    MAX_LIMIT,
    Commands,
    UsageError,
    cli_actor,
    iso_time,
    load_app,
    of_tenant,
    on_app,
    opened,
    print_list,
    tenant,
    time_or_age,
    whole,
)

#: What ``orchestrator jobs`` shows without ``--limit`` (as the API's page).
JOBS_SHOWN = 50


def add_parsers(commands: Commands) -> None:
    """``submit``, ``status`` and ``jobs``; ``cancel`` is added apart (add_cancel_parser), as
    ``--help`` has always listed it after ``stats`` and ``usage``."""
    cmd = commands.add_parser("submit", help="submit a job and print its id")
    cmd.add_argument("job_type")
    cmd.add_argument("--payload", default="null", help="the payload, as JSON")
    cmd.add_argument("--run-at", type=iso_time, help="ISO 8601 time with a timezone")
    cmd.add_argument("--priority", type=int, default=0, help="lower runs first (Graphile)")
    cmd.add_argument("--queue")
    cmd.add_argument("--max-retries", type=int)
    cmd.add_argument("--job-key")
    cmd.add_argument(
        "--job-key-mode", default="replace", choices=["replace", "preserve_run_at", "unsafe_dedupe"]
    )
    cmd.add_argument("--timeout-seconds", type=int)
    cmd.add_argument("--agent-id")
    cmd.add_argument("--tenant", type=tenant, help="the tenant the job belongs to (default: none)")
    cmd.add_argument(
        "--token-budget", type=int, help="the most tokens its LLM calls may spend (default: none)"
    )
    cmd.set_defaults(handler=cmd_submit)

    cmd = commands.add_parser(
        "status",
        help="one job: state, counters, last error, history; without JOB_ID, the fleet at a"
        " glance (jobs by status, workers, what waits and why, what is wrong and what to do),"
        " then the applications (as `orchestrator applications`)",
    )
    cmd.add_argument("job_id", nargs="?")
    cmd.add_argument("--tenant", type=tenant, help="without JOB_ID: only this tenant's")
    cmd.add_argument("--json", action="store_true", help="without JOB_ID: the API's summary")
    cmd.set_defaults(handler=cmd_status)

    listed = (
        f"list jobs, newest first ({JOBS_SHOWN} unless --limit; stderr says when more match),"
        " by the API's filters"
    )
    cmd = commands.add_parser("jobs", help=listed, description=listed)
    cmd.add_argument(
        "--status", type=str.upper, choices=[s.value for s in Status], help="in any case"
    )
    cmd.add_argument("--type", dest="job_type", help="only jobs of this type")
    cmd.add_argument("--tenant", type=tenant, help="only this tenant's jobs")
    cmd.add_argument("--agent", dest="agent_id", help="only this agent's jobs")
    cmd.add_argument(
        "--job-key", help="only jobs with this key (keys are per tenant: give --tenant for one)"
    )
    cmd.add_argument(
        "--since", type=time_or_age,
        help="created at or after: ISO 8601 with a timezone, or an age (30m, 24h, 7d)",
    )  # fmt: skip
    cmd.add_argument("--until", type=time_or_age, help="created before, as --since")
    cmd.add_argument(
        "--limit", type=whole(1, MAX_LIMIT), default=JOBS_SHOWN,
        help=f"most jobs shown (default {JOBS_SHOWN})",
    )  # fmt: skip
    cmd.set_defaults(handler=cmd_jobs)


def add_cancel_parser(commands: Commands) -> None:
    cmd = commands.add_parser("cancel", help="cancel a job that has not finished")
    cmd.add_argument("job_id")
    cmd.add_argument("--reason", default="")
    cmd.add_argument("--by", default=os.environ.get("USER", "cli"))
    cmd.set_defaults(handler=cmd_cancel)


def cmd_submit(args: argparse.Namespace) -> int:
    """The payload is read before the application is opened: a mistake in it is said even
    where the database cannot be reached."""
    try:
        payload = json.loads(args.payload)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--payload is not valid JSON: {exc}") from None
    except RecursionError:
        raise UsageError("--payload is nested too deeply to read") from None

    async def body(orc: Orchestrator) -> int:
        job_id = await orc.submit(
            args.job_type, payload, run_at=args.run_at, priority=args.priority,
            queue=args.queue, max_retries=args.max_retries, job_key=args.job_key,
            job_key_mode=args.job_key_mode, timeout_seconds=args.timeout_seconds,
            agent_id=args.agent_id, tenant_id=args.tenant, token_budget=args.token_budget,
        )  # fmt: skip
        print(job_id)
        return 0

    return opened(load_app(args.app), body)


#: The children ``status JOB`` lists (the API pages through them all).
SHOWN_CHILDREN = 20


@on_app
async def cmd_status(args: argparse.Namespace, orc: Orchestrator) -> int:
    if args.job_id is None:
        tenants = None if args.tenant is None else [args.tenant]
        summary = await orc.summary(tenants=tenants)
        if args.json:
            print(summary.model_dump_json(indent=2))
            return 0
        print("\n".join(render.summary_lines(summary)))
        print("\n".join(render.application_lines(await orc.applications(tenants=tenants))))
        return 0
    if args.tenant is not None or args.json:
        raise UsageError("--tenant and --json: only without a job id (the fleet summary)")
    job = await orc.get_job(args.job_id)
    print(render.describe(job, await orc.job_events(job.id), await orc.job_steps(job.id)))
    children = await orc.children(job.id, limit=SHOWN_CHILDREN + 1)
    for line in render.graph_lines(
        await orc.parents(job.id), children[:SHOWN_CHILDREN], len(children) > SHOWN_CHILDREN
    ):
        print(line)
    usage = await orc.job_usage(job.id)
    if usage.calls or usage.token_budget is not None or usage.descendant_calls:
        print(render.job_usage_line(usage))
    return 0


@on_app
async def cmd_jobs(args: argparse.Namespace, orc: Orchestrator) -> int:
    jobs = await orc.list_jobs(
        status=args.status, job_type=args.job_type, tenant_id=args.tenant,
        job_key=args.job_key, agent_id=args.agent_id, created_after=args.since,
        created_before=args.until, limit=args.limit + 1,
    )  # fmt: skip
    kind = f" of type {args.job_type}" if args.job_type else ""
    key = f" with key {args.job_key}" if args.job_key else ""
    agent = f" of agent {args.agent_id}" if args.agent_id else ""
    status = args.status + " " if args.status else ""
    empty = f"no {status}jobs{kind}{key}{agent}{of_tenant(args.tenant)}{_created(args)}"
    print_list(jobs, render.job_line, empty, head=render.JOB_HEAD, limit=args.limit)
    return 0


def _created(args: argparse.Namespace) -> str:
    since = f" since {args.since.isoformat()}" if args.since else ""
    return f"{since} until {args.until.isoformat()}" if args.until else since


@on_app
async def cmd_cancel(args: argparse.Namespace, orc: Orchestrator) -> int:
    await orc.cancel(args.job_id, reason=args.reason, by=cli_actor(args.by))
    print(f"cancelled {args.job_id}")
    return 0
