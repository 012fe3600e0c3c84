"""``orchestrator``: the command line.

Every command works on an application (``--app module:attribute``, or ``ORCHESTRATOR_APP``;
default ``tasks.app:orc``, the built-in job types), except ``db``, which looks at the embedded
server only. A user mistake, argparse's included, prints one ``error:`` line and exits 2; an
unreachable database exits 1; nothing prints a traceback for either. Output cut short by its
reader (``orchestrator jobs | head -1``) ends the command quietly with 141, as SIGPIPE would.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import getpass
import importlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import psycopg
from pydantic import ValidationError

import retry_config
from orchestrator.app import Orchestrator
from orchestrator.domain.errors import DatabaseUnavailable, OrchestratorError
from orchestrator.domain.principals import Scope, name_of
from orchestrator.domain.states import Status
from orchestrator.interfaces import render
from orchestrator.runtime import logs
from orchestrator.settings import Settings
from orchestrator.storage.config_versions import WorkerConfig
from orchestrator.storage.database import check_database, describe_database
from orchestrator.storage.embedded import Embedded

DEFAULT_APP = "tasks.app:orc"
MAX_LIMIT = 100_000  # rows a list command prints at most
DEAD_LETTER_STATES = ["recorded", "discard_requested", "requeued", "discarded"]
APPROVAL_STATUSES = ["pending", "approved", "rejected", "expired", "cancelled", "all"]
T = TypeVar("T")


class UsageError(Exception):
    """A mistake in what the user typed."""


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    for argument in arguments:
        if not _is_utf8(argument):
            print(
                f"error: an argument is not UTF-8 text: {os.fsencode(argument)!r}", file=sys.stderr
            )
            return 2
    args = build_parser().parse_args(arguments)
    try:
        _log_to_stderr(args)
        result: int = args.handler(args)
        sys.stdout.flush()  # a reader that went away shows here, not at the interpreter's exit
        return result
    except DatabaseUnavailable as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 1
    except ValidationError as exc:
        for problem in _invalid(exc):
            print(f"error: {problem}", file=sys.stderr)
        return 2
    except (UsageError, OrchestratorError, retry_config.ConfigError) as exc:
        for problem in str(exc).splitlines() or [type(exc).__name__]:  # one problem per line
            print(f"error: {_one_line(problem)}", file=sys.stderr)
        return 2
    except psycopg.OperationalError as exc:
        print(f"error: cannot reach the database: {_one_line(exc)}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # What is still buffered goes nowhere, so the interpreter's exit cannot fail on it.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        return 130


def _log_to_stderr(args: argparse.Namespace) -> None:
    """Records go to stderr, secrets redacted, from WARNING up (INFO with ``-v``). A worker (and
    the exporter) says what it does (its start, each job's outcome) in
    ``ORCHESTRATOR_LOG_FORMAT``, read before its application is imported: importing it may log
    already."""
    server = args.command in ("worker", "exporter")
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING)
    if server:
        logging.getLogger("orchestrator").setLevel(logging.INFO)
    log_format = Settings().log_format if server else "text"
    for handler in logging.getLogger().handlers:
        logs.prepare(handler, log_format)


def _invalid(exc: ValidationError) -> list[str]:
    """One line per problem; a setting is named as it is set, ``ORCHESTRATOR_...``."""
    problems = []
    for error in exc.errors(include_url=False):
        message = _one_line(error["msg"]).removeprefix("Value error, ")
        if not error["loc"]:  # the model as a whole: its message names the fields
            problems.append(f"{exc.title}: {message}")
            continue
        where = ".".join(str(part) for part in error["loc"])
        if exc.title == "Settings":
            where = "DATABASE_URL" if where == "database_url" else f"ORCHESTRATOR_{where.upper()}"
        problems.append(f"{where}: {message} (got {error['input']!r})")
    return problems


def _is_utf8(argument: str) -> bool:
    """False for an argument holding bytes that are not UTF-8 (Python keeps them as lone
    surrogates, which nothing downstream could print or store)."""
    try:
        argument.encode()
    except UnicodeEncodeError:
        return False
    return True


def _one_line(what: object) -> str:
    return " ".join(str(what).split()) or type(what).__name__


class Parser(argparse.ArgumentParser):
    """argparse, with its usage errors on one line like every other mistake."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {_one_line(message)} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="orchestrator", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--app",
        default=os.environ.get("ORCHESTRATOR_APP", DEFAULT_APP),
        help=f"the Orchestrator to use, as module:attribute (default {DEFAULT_APP})",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    cmd = commands.add_parser("migrate", help="apply Procrastinate's and our schema migrations")
    cmd.set_defaults(handler=cmd_migrate)

    cmd = commands.add_parser("worker", help="run a worker until SIGTERM/SIGINT")
    cmd.add_argument(
        "--concurrency", type=_whole(1, 100_000), help="jobs run at once (default from settings)"
    )
    cmd.add_argument("--queues", type=_csv, help="comma-separated queues to listen to")
    cmd.add_argument("--job-types", type=_csv, help="comma-separated job types to run")
    cmd.add_argument("--name", help="worker name, for logs")
    cmd.add_argument(
        "--migrate", action="store_true", help="apply the schema migrations first (as migrate)"
    )
    cmd.set_defaults(handler=cmd_worker)

    cmd = commands.add_parser(
        "exporter", help="serve the fleet's metrics, read from the database (one per fleet)"
    )
    cmd.add_argument("--port", type=_whole(1, 65535), help="default: ORCHESTRATOR_EXPORTER_PORT")
    cmd.set_defaults(handler=cmd_exporter)

    cmd = commands.add_parser(
        "serve", help="serve the HTTP API (/api/v1) until SIGTERM/SIGINT (docs/api.md)"
    )
    cmd.add_argument("--host", help="default: ORCHESTRATOR_API_HOST")
    cmd.add_argument("--port", type=_whole(0, 65535), help="default: ORCHESTRATOR_API_PORT")
    cmd.set_defaults(handler=cmd_serve)

    cmd = commands.add_parser(
        "openapi", help="print the API's OpenAPI document (docs/openapi.json holds it)"
    )
    cmd.set_defaults(handler=cmd_openapi)

    tokens = commands.add_parser("tokens", help="API tokens").add_subparsers(
        dest="tokens_command", required=True, metavar="ACTION"
    )
    cmd = tokens.add_parser("create", help="create a token and print it (shown only once)")
    cmd.add_argument("name", help="who or what uses it: the API records it as who acted")
    cmd.add_argument(
        "--scope", dest="scopes", action="append", required=True, type=str.lower,
        choices=[s.value for s in Scope], help="what it may do (repeat for several)",
    )  # fmt: skip
    cmd.add_argument(
        "--tenant", dest="tenants", action="append",
        help="limit it to this tenant's jobs (repeat for several; default: every tenant)",
    )  # fmt: skip
    cmd.set_defaults(handler=cmd_tokens_create)
    cmd = tokens.add_parser("list", help="list tokens (never their secrets)")
    cmd.set_defaults(handler=cmd_tokens_list)
    cmd = tokens.add_parser("revoke", help="revoke a token by name")
    cmd.add_argument("name")
    cmd.set_defaults(handler=cmd_tokens_revoke)

    cmd = commands.add_parser("submit", help="submit a job and print its id")
    cmd.add_argument("job_type")
    cmd.add_argument("--payload", default="null", help="the payload, as JSON")
    cmd.add_argument("--run-at", type=_datetime, help="ISO 8601 time with a timezone")
    cmd.add_argument("--priority", type=int, default=0, help="lower runs first (Graphile)")
    cmd.add_argument("--queue")
    cmd.add_argument("--max-retries", type=int)
    cmd.add_argument("--job-key")
    cmd.add_argument(
        "--job-key-mode", default="replace", choices=["replace", "preserve_run_at", "unsafe_dedupe"]
    )
    cmd.add_argument("--timeout-seconds", type=int)
    cmd.add_argument("--agent-id")
    cmd.add_argument("--tenant", help="the tenant the job belongs to (default: none)")
    cmd.add_argument(
        "--token-budget", type=int, help="the most tokens its LLM calls may spend (default: none)"
    )
    cmd.set_defaults(handler=cmd_submit)

    cmd = commands.add_parser("status", help="one job: state, counters, last error, history")
    cmd.add_argument("job_id")
    cmd.set_defaults(handler=cmd_status)

    cmd = commands.add_parser("jobs", help="list jobs, newest first")
    cmd.add_argument("--status", type=str.upper, choices=[s.value for s in Status])
    cmd.add_argument("--type", dest="job_type")
    cmd.add_argument("--tenant", help="only this tenant's jobs")
    cmd.add_argument(
        "--job-key", help="only jobs with this key (keys are per tenant: give --tenant for one)"
    )
    cmd.add_argument("--limit", type=_whole(1, MAX_LIMIT), default=50)
    cmd.set_defaults(handler=cmd_jobs)

    cmd = commands.add_parser(
        "stats", help="jobs finished per step and the queue depth, from the rollups"
    )
    cmd.add_argument("--from", dest="since", type=_datetime, help="start (default: an hour ago)")
    cmd.add_argument("--to", dest="until", type=_datetime, help="end (default: now)")
    cmd.add_argument(
        "--step", type=_whole(60, 366 * 86400),
        help="seconds per point, whole minutes (default 60; 3600 past a day)",
    )  # fmt: skip
    cmd.add_argument("--by", type=_csv, default=[], help="split by job_type, queue, tenant")
    cmd.add_argument("--tenant", help="only this tenant's jobs")
    cmd.add_argument("--json", action="store_true", help="print the API's JSON document")
    cmd.set_defaults(handler=cmd_stats)

    cmd = commands.add_parser(
        "usage", help="LLM calls and their tokens over a time range, grouped (token accounting)"
    )
    cmd.add_argument(
        "--since", type=_since, help="start: ISO 8601 with a timezone, or an age (30m, 24h, 7d);"
        " default: everything recorded",
    )  # fmt: skip
    cmd.add_argument("--until", type=_since, help="end, as --since (default: now)")
    cmd.add_argument(
        "--by", default="tenant,model",
        help="group by any of job, tenant, agent, model, job_type (default tenant,model;"
        " '' for one total)",
    )  # fmt: skip
    cmd.add_argument("--tenant", help="only this tenant's jobs")
    cmd.add_argument("--agent", help="only this agent's jobs")
    cmd.add_argument("--model", help="only calls to this model")
    cmd.add_argument("--type", dest="job_type", help="only jobs of this type")
    cmd.add_argument("--job", dest="job_id", help="only this job's calls")
    cmd.add_argument("--limit", type=_whole(1, 100_000), default=1000, help="most groups shown")
    cmd.add_argument("--json", action="store_true", help="print the totals as JSON")
    cmd.set_defaults(handler=cmd_usage)

    cmd = commands.add_parser("cancel", help="cancel a job that has not finished")
    cmd.add_argument("job_id")
    cmd.add_argument("--reason", default="")
    cmd.add_argument("--by", default=os.environ.get("USER", "cli"))
    cmd.set_defaults(handler=cmd_cancel)

    config = commands.add_parser("config", help="the retry config").add_subparsers(
        dest="config_command", required=True, metavar="ACTION"
    )
    cmd = config.add_parser("validate", help="check a retry config file")
    cmd.add_argument("path", nargs="?", type=Path, help="default: the configured file")
    cmd.set_defaults(handler=cmd_config_validate)
    cmd = config.add_parser("show", help="print the effective config (of one type)")
    cmd.add_argument("job_type", nargs="?")
    cmd.add_argument(
        "--workers", action="store_true",
        help="also the version each live worker and API server runs (from the database)",
    )  # fmt: skip
    cmd.set_defaults(handler=cmd_config_show)
    cmd = config.add_parser(
        "diff", help="what an edit would change against the configured file, per type and field",
        description="Exit 0: nothing changes; 1: fields change (listed); 2: FILE is not valid.",
    )  # fmt: skip
    cmd.add_argument("path", type=Path, metavar="FILE", help="the edited file")
    cmd.set_defaults(handler=cmd_config_diff)

    cmd = commands.add_parser(
        "prune", help="delete the finished jobs past their retention now (one run of"
        " prune_finished), and the bookkeeping that aged out",
    )  # fmt: skip
    cmd.add_argument(
        "--dry-run", action="store_true", help="delete nothing: show what the run would delete,"
        " by kind and by job type",
    )  # fmt: skip
    cmd.set_defaults(handler=cmd_prune)

    dlq = commands.add_parser("dlq", help="dead letters").add_subparsers(
        dest="dlq_command", required=True, metavar="ACTION"
    )
    cmd = dlq.add_parser("list", help="list dead letters, newest first")
    cmd.add_argument("--state", type=str.lower, choices=DEAD_LETTER_STATES)
    cmd.add_argument("--tenant", help="only this tenant's dead letters")
    cmd.add_argument("--limit", type=_whole(1, MAX_LIMIT), default=50)
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

    approvals = commands.add_parser("approvals", help="approval gates").add_subparsers(
        dest="approvals_command", required=True, metavar="ACTION"
    )
    cmd = approvals.add_parser("list", help="list approvals (pending ones by default)")
    cmd.add_argument("--status", default="pending", type=str.lower, choices=APPROVAL_STATUSES)
    cmd.add_argument("--limit", type=_whole(1, MAX_LIMIT), default=50)
    cmd.set_defaults(handler=cmd_approvals_list)
    for action in ("approve", "reject"):
        cmd = approvals.add_parser(action, help=f"{action} a waiting step")
        cmd.add_argument("approval_id")
        cmd.add_argument("--by", required=True, help="who decides")
        cmd.add_argument("--reason", default="", required=action == "reject", help="why")
        cmd.set_defaults(handler=cmd_approvals_decide, action=action)

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

    cmd = commands.add_parser("demo", help="run the demo scenario, in a database of its own")
    cmd.add_argument(
        "--real-llm",
        action="store_true",
        help="run the agent against Anthropic's API (needs ANTHROPIC_API_KEY) instead of the"
        " bundled local server",
    )
    cmd.add_argument("--model", default="claude-sonnet-4-5", help="the agent's model")
    cmd.set_defaults(handler=cmd_demo)

    db = commands.add_parser(
        "db", help="the embedded PostgreSQL (used when DATABASE_URL is unset)"
    ).add_subparsers(dest="db_command", required=True, metavar="ACTION")
    cmd = db.add_parser("status", help="whether it runs, where, and which processes use it")
    cmd.set_defaults(handler=cmd_db_status)
    cmd = db.add_parser("stop", help="stop it (refused while processes use it, unless --force)")
    cmd.add_argument(
        "--force", action="store_true", help="stop it even while processes use it (their"
        " connections close; a worker waits for the database to come back)",
    )  # fmt: skip
    cmd.set_defaults(handler=cmd_db_stop)
    return parser


def _whole(low: int, high: int) -> Callable[[str], int]:
    def whole(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = low - 1
        if not low <= number <= high:
            raise argparse.ArgumentTypeError(
                f"must be a whole number from {low} to {high}, got {_clip_arg(value)}"
            )
        return number

    return whole


def _clip_arg(value: str) -> str:
    return repr(value) if len(value) <= 40 else repr(value[:40]) + "..."


def _csv(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def _datetime(value: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {value!r}") from None
    if parsed.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{value!r} has no timezone (add Z or +00:00)")
    return parsed


_AGE = re.compile(r"(\d+)([smhd])")
_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _since(value: str) -> datetime:
    """An ISO 8601 time with a timezone, or an age before now: ``30m``, ``24h``, ``7d``."""
    if age := _AGE.fullmatch(value.strip()):
        seconds = int(age.group(1)) * _AGE_UNITS[age.group(2)]
        if seconds > 100 * 366 * 86400:
            raise argparse.ArgumentTypeError(f"{value!r} is more than a hundred years ago")
        return datetime.now(UTC) - timedelta(seconds=seconds)
    try:
        return _datetime(value)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc}; or give an age such as 30m, 24h, 7d") from None


def load_app(path: str) -> Orchestrator:
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise UsageError(f"--app must look like module:attribute, got {path!r}")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise UsageError(f"cannot import {module_name!r} for --app: {exc}") from None
    app = getattr(module, attribute, None)
    if not isinstance(app, Orchestrator):
        raise UsageError(f"{path} is not an Orchestrator")
    return app


def _run(args: argparse.Namespace, body: Any) -> int:
    result: int = _opened(load_app(args.app), body)
    return result


def _opened(orc: Orchestrator, body: Callable[[Orchestrator], Awaitable[T]]) -> T:
    """``body(orc)`` with ``orc`` open."""

    async def go() -> T:
        async with orc:
            return await body(orc)

    return asyncio.run(go())


def cmd_migrate(args: argparse.Namespace) -> int:
    orc = load_app(args.app)
    print(asyncio.run(orc.migrate()))
    return 0


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


def cmd_serve(args: argparse.Namespace) -> int:
    """Until SIGTERM/SIGINT: uvicorn finishes the requests under way, then it ends with 0."""
    import uvicorn

    from orchestrator.interfaces.api.app import create_app

    orc = load_app(args.app)
    settings = orc.settings
    host = args.host or settings.api_host
    port = settings.api_port if args.port is None else args.port
    # Its probes answer on its own port while it waits (none on port 0: nobody probes that).
    asyncio.run(
        orc.wait_for_database(
            probe_port=port, probe_host=host, probe_setting="ORCHESTRATOR_API_PORT"
        )
    )
    asyncio.run(_refuse_a_schema_it_cannot_serve(orc.dsn))  # once it answers
    config = uvicorn.Config(
        create_app(orc), host=host, port=port, log_config=None, lifespan="on",
        server_header=False, proxy_headers=True,
    )  # fmt: skip
    server = uvicorn.Server(config)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then raises the signal again for the
    # handler that was there before it: after a graceful shutdown, that ends nothing.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    asyncio.run(server.serve())
    return 0 if server.started else 1


async def _refuse_a_schema_it_cannot_serve(dsn: str) -> None:
    """A database migrated for another version is refused here, in one line (SchemaOutdated,
    SchemaTooNew), where uvicorn would print the start-up's traceback; a database lost again
    since the wait is left to the server's own start."""
    with contextlib.suppress(DatabaseUnavailable):
        await check_database(dsn)


def cmd_openapi(args: argparse.Namespace) -> int:
    from orchestrator.interfaces.api.app import create_app

    print(json.dumps(create_app(load_app(args.app)).openapi(), indent=2))
    return 0


def cmd_tokens_create(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        token = await orc.stores.tokens.create(
            args.name, [Scope(s) for s in args.scopes], args.tenants, by=cli_actor("tokens")
        )
        print(token.token)
        print(  # the name as stored (its normal form), which `tokens list` and revoke show
            f"token {name_of(args.name)!r} created; this is the only time it is shown",
            file=sys.stderr,
        )
        return 0

    return _run(args, body)


def cmd_tokens_list(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        tokens = await orc.stores.tokens.list_tokens()
        for t in tokens:
            tenants = ",".join(t.tenants) if t.tenants is not None else "every tenant"
            state = f"revoked {t.revoked_at:%Y-%m-%d %H:%M}" if t.revoked_at else "live"
            print(f"{t.name:<24} {','.join(t.scopes):<28} {tenants:<24} {state}")
        if not tokens:
            _nothing("no tokens")
        return 0

    return _run(args, body)


def cmd_tokens_revoke(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        await orc.stores.tokens.revoke(args.name)
        print(f"token {args.name!r} revoked")
        return 0

    return _run(args, body)


def cli_actor(by: str) -> str:
    """Who acted from the command line, as records name it: the name given with ``--by``, in
    normal form (principals.name_of: the person a token of that name is too), and the
    operating-system user who ran the command. The command line acts with the database's own
    rights: it is trusted (the API is where principals are enforced)."""
    return f"{name_of(by)} (cli:{getpass.getuser()})"


def cmd_submit(args: argparse.Namespace) -> int:
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

    return _run(args, body)


def cmd_status(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        job = await orc.get_job(args.job_id)
        print(render.describe(job, await orc.job_events(job.id), await orc.job_steps(job.id)))
        usage = await orc.job_usage(job.id)
        if usage.calls or usage.token_budget is not None:
            print(render.job_usage_line(usage))
        return 0

    return _run(args, body)


def cmd_jobs(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        jobs = await orc.list_jobs(
            status=args.status, job_type=args.job_type, tenant_id=args.tenant,
            job_key=args.job_key, limit=args.limit,
        )  # fmt: skip
        for job in jobs:
            print(render.job_line(job))
        if not jobs:
            kind = f" of type {args.job_type}" if args.job_type else ""
            key = f" with key {args.job_key}" if args.job_key else ""
            status = args.status + " " if args.status else ""
            _nothing(f"no {status}jobs{kind}{key}{_of(args.tenant)}")
        return 0

    return _run(args, body)


def _of(tenant: str | None) -> str:
    return f" for tenant {tenant}" if tenant is not None else ""


def _nothing(line: str) -> None:
    """An empty list says so, on stderr: a script reading stdout sees no rows."""
    print(line, file=sys.stderr)


def cmd_stats(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        stats = await orc.stats(
            since=args.since, until=args.until, step=args.step, by=args.by,
            tenants=None if args.tenant is None else [args.tenant],
        )  # fmt: skip
        if args.json:
            print(stats.model_dump_json(by_alias=True, indent=2))
        else:
            print("\n".join(render.stats_lines(stats)))
        return 0

    return _run(args, body)


def cmd_usage(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        totals = await orc.llm_usage(
            by=args.by, since=args.since, until=args.until, tenant_id=args.tenant,
            agent_id=args.agent, model=args.model, job_type=args.job_type, job_id=args.job_id,
            limit=args.limit,
        )  # fmt: skip
        if args.json:
            print(json.dumps([t.model_dump(mode="json") for t in totals], indent=2))
        else:
            print("\n".join(render.usage_lines(totals, args.by, args.since, args.until)))
        return 0

    return _run(args, body)


def cmd_cancel(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        await orc.cancel(args.job_id, reason=args.reason, by=cli_actor(args.by))
        print(f"cancelled {args.job_id}")
        return 0

    return _run(args, body)


def cmd_config_validate(args: argparse.Namespace) -> int:
    """The file (default: the configured one), checked against the application as a worker
    checks it at start-up and a reload checks a new version."""
    orc = load_app(args.app)
    config = retry_config.load(args.path or _configured_config_path())
    orc.check_config(config)
    print(f"{config.path}: ok ({len(config.job_types)} job types)")
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    """The file's config (of one type); with ``--workers``, which version each live process
    runs, those not on the file's flagged (a refused edit, or one not read yet)."""
    path = _configured_config_path() or retry_config.DEFAULT_PATH
    try:
        orc = load_app(args.app)  # the application reads the file too
        shown = _config_shown(orc, retry_config.load(path), args.job_type)
    except retry_config.ConfigError as exc:
        if not args.workers:
            raise
        # Which version each process runs matters most now: the registry is read without
        # the application, which cannot be built on this file.
        orc = Orchestrator(retry_config_path=retry_config.DEFAULT_PATH)
        shown = {"file": str(path), "error": str(exc)}
    if args.workers:
        version = retry_config.version_of(retry_config.read(path))

        async def live(orc: Orchestrator) -> list[WorkerConfig]:
            return await orc.stores.config_versions.live(
                seconds=orc.settings.stalled_worker_seconds
            )

        shown = {
            "config": shown,
            "version": version,
            "workers": [
                {
                    "worker": w.worker, "worker_id": w.worker_id, "version": w.version,
                    "applied_at": w.applied_at.isoformat() if w.applied_at else None,
                    "on_file_version": w.version == version,
                }
                for w in _opened(orc, live)
            ],
        }  # fmt: skip
    print(json.dumps(shown, indent=2))
    return 0


def _config_shown(
    orc: Orchestrator, config: retry_config.RetryConfig, job_type: str | None
) -> dict[str, Any]:
    if job_type:
        known = orc.known_job_types()
        if job_type not in known:
            raise UsageError(retry_config.unknown_type(job_type, known))
        shown: dict[str, Any] = config.for_type(job_type).model_dump(mode="json")
        return shown
    return {
        "file": str(config.path),
        "version": config.version,
        "defaults": config.defaults.model_dump(mode="json"),
        "job_types": {n: c.model_dump(mode="json") for n, c in config.job_types.items()},
        "limits": {n: limit.model_dump(mode="json") for n, limit in config.limits.items()},
        "token_budgets": {t: b.model_dump(mode="json") for t, b in config.token_budgets.items()},
    }


def cmd_config_diff(args: argparse.Namespace) -> int:
    """Per scope and field, old -> new, of FILE against the configured file, FILE checked as a
    reload checks it; fields a reload holds until a restart are marked."""
    orc = load_app(args.app)
    running = retry_config.load(_configured_config_path())
    edited = retry_config.load(args.path)
    orc.check_config(edited)
    changes = retry_config.diff(running, edited)
    _, fixed = orc.hold_fixed(edited, running)
    for scope, fields in changes.items():
        print(scope if scope.startswith("[") else f"job type {scope!r}")  # [defaults], ...
        for path, (old, new) in fields.items():
            restart = "  (fixed at start-up: applied at the next restart)"
            held = restart if path in fixed.get(scope, []) else ""
            print(f"  {path}: {retry_config.shown(old)} -> {retry_config.shown(new)}{held}")
    if not changes:
        _nothing(f"{args.path}: no change against {running.path}")
    return 1 if changes else 0


def _configured_config_path() -> Path | None:
    from orchestrator.settings import Settings

    return Settings().retry_config


def cmd_prune(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        service = orc.maintenance.finished
        if args.dry_run:
            result = await service.preview()
        else:
            try:
                result = await service.run_once()
            except OSError as exc:  # the archive directory: missing rights, a full disk
                raise UsageError(
                    f"cannot write the archive ({exc}): the jobs it would hold were not deleted"
                ) from None
        for line in render.prune_lines(result, dry_run=args.dry_run):
            print(line)
        return 0

    return _run(args, body)


def cmd_dlq_list(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        letters = await orc.dead_letters(state=args.state, tenant_id=args.tenant, limit=args.limit)
        for letter in letters:
            print(render.dead_letter_line(letter))
        if not letters:
            state = args.state + " " if args.state else ""
            _nothing(f"no {state}dead letters{_of(args.tenant)}")
        return 0

    return _run(args, body)


def cmd_dlq_show(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        print(render.describe_dead_letter(await orc.dead_letter(args.dead_letter_id)))
        return 0

    return _run(args, body)


def cmd_dlq_requeue(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        print(await orc.requeue_dead_letter(args.dead_letter_id))
        return 0

    return _run(args, body)


def cmd_dlq_discard(args: argparse.Namespace) -> int:
    """With --reason, the first review (the request); without, the second (the confirmation),
    which only a requested discard can have."""

    async def body(orc: Orchestrator) -> int:
        if args.reason is not None:
            await orc.request_discard(
                args.dead_letter_id, by=cli_actor(args.by), reason=args.reason
            )
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

    return _run(args, body)


def cmd_approvals_list(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        status = None if args.status == "all" else args.status
        approvals = await orc.approvals(status=status, limit=args.limit)
        for approval in approvals:
            print(render.approval_line(approval))
        if not approvals:
            _nothing(f"no {status + ' ' if status else ''}approvals")
        return 0

    return _run(args, body)


def cmd_approvals_decide(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        if args.action == "approve":
            await orc.approve(args.approval_id, by=cli_actor(args.by), reason=args.reason)
        else:
            await orc.reject(args.approval_id, by=cli_actor(args.by), reason=args.reason)
        print(f"{args.action}d {args.approval_id} (by {args.by})")
        return 0

    return _run(args, body)


def cmd_schedules_list(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        views = await orc.list_schedules()
        for view in views:
            print(render.schedule_line(view))
        if not views:
            _nothing("no schedules")
        return 0

    return _run(args, body)


def cmd_schedules_steer(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        if args.action == "pause":
            view = await orc.pause_schedule(args.name, by=cli_actor(args.by))
        else:
            view = await orc.resume_schedule(args.name)
        print(render.schedule_line(view))
        return 0

    return _run(args, body)


def _seconds(text: str) -> float:
    """A duration: seconds, or a number with s, m, h or d."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = (text[:-1], units[text[-1]]) if text[-1:] in units else (text, 1)
    try:
        value = float(number) * unit
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a duration: {text!r} (e.g. 90, 30s, 10m, 2h)"
        ) from None
    if not 0 < value <= 86_400 * 30:
        raise argparse.ArgumentTypeError(f"{text!r} is not between 0 and 30 days")
    return value


def cmd_flow_list(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        keys = await orc.flow_keys()
        for key in keys:
            print(render.flow_key_line(key))
        if not keys:
            _nothing("no flow keys (no job under a limit has been claimed yet)")
        return 0

    return _run(args, body)


def cmd_flow_steer(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        if args.action == "pause":
            key = await orc.pause_flow_key(
                args.key, seconds=args.seconds, reason=args.reason, by=cli_actor(args.by)
            )
        else:
            key = await orc.resume_flow_key(args.key)
        print(render.flow_key_line(key))
        return 0

    return _run(args, body)


def cmd_demo(args: argparse.Namespace) -> int:
    """The demo is an application of its own (the top-level ``demo`` package): it runs in a
    process of its own, as ``./dev demo`` runs it."""
    if args.real_llm and not os.environ.get("ANTHROPIC_API_KEY"):
        raise UsageError("--real-llm needs ANTHROPIC_API_KEY in the environment")
    command = [sys.executable, "-m", "demo", "--model", args.model]
    if args.real_llm:
        command.append("--real-llm")
    return subprocess.run(command, check=False).returncode


def cmd_db_status(args: argparse.Namespace) -> int:
    """Exits 0 when the server runs, 3 when it does not (as ``pg_ctl status``)."""
    settings = Settings()
    embedded = Embedded(settings.data_dir)
    if settings.database_url:
        where = describe_database(settings.database_url)
        print(f"DATABASE_URL is set: commands use {where}, not the embedded server")
    server = embedded.running()
    if server is None:
        print(f"embedded PostgreSQL: not running (data {embedded.pgdata})")
        return 3
    print(f"embedded PostgreSQL: running (pid {server.pid})")
    print(f"  data:     {embedded.pgdata}")
    print(f"  socket:   {server.socket_dir}, port {server.port}")
    users = embedded.users()
    print(f"  used by:  {len(users)} process(es)" + ("" if users else ": stops within seconds"))
    for user in users:
        print(f"    {user.pid}  {render.clip(user.command, 100)}")
    watchdog = embedded.watchdog()
    if watchdog is None:
        print("  watchdog: not running: the server stops only with `orchestrator db stop`")
    else:
        print(f"  watchdog: pid {watchdog.pid}: stops the server once no process uses it")
    return 0


def cmd_db_stop(args: argparse.Namespace) -> int:
    embedded = Embedded(Settings().data_dir)
    postmaster = embedded.postmaster()
    if postmaster is not None:
        with embedded.locked():
            postmaster = embedded.postmaster()
            users = embedded.users()
            if postmaster is not None and users and not args.force:
                pids = ", ".join(str(user.pid) for user in users)
                raise UsageError(
                    f"the embedded PostgreSQL is in use by process(es) {pids} "
                    "(orchestrator db status); stop them first, or use --force"
                )
            if postmaster is not None:
                embedded.stop(postmaster)
    print(
        "embedded PostgreSQL: "
        + ("not running" if postmaster is None else f"stopped (pid {postmaster})")
    )
    return 0
