"""The fleet's own processes: ``migrate`` (the schema it needs), ``worker`` and ``exporter`` (its
metrics, one per fleet)."""

from __future__ import annotations

import argparse
import asyncio
import json

from orchestrator.interfaces.cli.shared import Commands, UsageError, csv_list, load_app, whole


def add_parsers(commands: Commands) -> None:
    cmd = commands.add_parser("migrate", help="apply Procrastinate's and our schema migrations")
    cmd.add_argument(
        "--plan", action="store_true",
        help="print what migrate would do to this database, changing nothing (exit 0)",
    )  # fmt: skip
    cmd.add_argument(
        "--check", action="store_true",
        help=f"as --plan, but exit {PENDING} when migrate has something to do",
    )  # fmt: skip
    cmd.add_argument("--json", action="store_true", help="with --plan or --check: print JSON")
    cmd.set_defaults(handler=cmd_migrate)

    cmd = commands.add_parser("worker", help="run a worker until SIGTERM/SIGINT")
    cmd.add_argument(
        "--concurrency", type=whole(1, 100_000), help="jobs run at once (default from settings)"
    )
    cmd.add_argument("--queues", type=csv_list, help="comma-separated queues to listen to")
    cmd.add_argument("--job-types", type=csv_list, help="comma-separated job types to run")
    cmd.add_argument("--name", help="worker name, for logs")
    cmd.add_argument(
        "--migrate", action="store_true", help="apply the schema migrations first (as migrate)"
    )
    cmd.set_defaults(handler=cmd_worker)

    cmd = commands.add_parser(
        "exporter", help="serve the fleet's metrics, read from the database (one per fleet)"
    )
    cmd.add_argument("--port", type=whole(1, 65535), help="default: ORCHESTRATOR_EXPORTER_PORT")
    cmd.set_defaults(handler=cmd_exporter)


#: ``migrate --check``'s exit code when migrate has something to do (2 stays a refusal: a
#: database migrate would refuse, as migrate itself exits).
PENDING = 3


def cmd_migrate(args: argparse.Namespace) -> int:
    """``--plan``/``--check``: what migrate would do, read in a read-only transaction."""
    if args.json and not (args.plan or args.check):
        raise UsageError("--json goes with --plan or --check")
    orc = load_app(args.app)
    if not (args.plan or args.check):
        print(asyncio.run(orc.migrate()))
        return 0
    plan = asyncio.run(orc.plan_migrate())
    if args.json:
        print(json.dumps(plan.as_json(), indent=2))
    else:
        print("\n".join(plan.lines()))
    return PENDING if args.check and not plan.nothing_to_do else 0


def cmd_worker(args: argparse.Namespace) -> int:
    """Until the worker drains on a signal, a signal ends the process quietly (interfaces.start,
    the entry point, arranged it before anything was imported)."""
    orc = load_app(args.app)

    async def go() -> None:
        await orc.wait_for_database(probe_port=orc.settings.health_port)
        if args.migrate:
            print(await orc.migrate())
        async with orc:
            await orc.run_worker(
                concurrency=args.concurrency, queues=args.queues, job_types=args.job_types,
                name=args.name,
            )  # fmt: skip

    asyncio.run(go())
    return 0


def cmd_exporter(args: argparse.Namespace) -> int:
    """Until SIGTERM/SIGINT, which end it with 0."""
    orc = load_app(args.app)

    async def go() -> None:
        async with orc:
            await orc.run_exporter(port=args.port)

    asyncio.run(go())
    return 0
