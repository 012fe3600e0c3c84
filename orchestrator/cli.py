"""``orchestrator``: the command line.

Every command works on an application (``--app module:attribute``, or ``ORCHESTRATOR_APP``;
default ``tasks.app:orc``, the built-in job types). A user mistake prints one ``error:`` line
and exits 2; nothing prints a traceback for it.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from pydantic import ValidationError

import retry_config
from orchestrator.app import Orchestrator
from orchestrator.errors import OrchestratorError
from orchestrator.models import Job, JobEvent
from orchestrator.secrets import RedactingFilter
from orchestrator.states import Status

DEFAULT_APP = "tasks.app:orc"


class UsageError(Exception):
    """A mistake in what the user typed."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter())
    try:
        result: int = args.handler(args)
        return result
    except (UsageError, OrchestratorError, retry_config.ConfigError, ValidationError) as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except psycopg.OperationalError as exc:
        print(f"error: cannot reach the database: {_one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orchestrator", description=__doc__.split("\n")[0])
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
    cmd.add_argument("--concurrency", type=int, help="jobs run at once (default from settings)")
    cmd.add_argument("--queues", type=_csv, help="comma-separated queues to listen to")
    cmd.add_argument("--job-types", type=_csv, help="comma-separated job types to run")
    cmd.add_argument("--name", help="worker name, for logs")
    cmd.set_defaults(handler=cmd_worker)

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
    cmd.set_defaults(handler=cmd_submit)

    cmd = commands.add_parser("status", help="one job: state, counters, last error, history")
    cmd.add_argument("job_id")
    cmd.set_defaults(handler=cmd_status)

    cmd = commands.add_parser("jobs", help="list jobs, newest first")
    cmd.add_argument("--status", choices=[s.value for s in Status])
    cmd.add_argument("--type", dest="job_type")
    cmd.add_argument("--limit", type=int, default=50)
    cmd.set_defaults(handler=cmd_jobs)

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
    cmd.set_defaults(handler=cmd_config_show)

    dlq = commands.add_parser("dlq", help="dead letters").add_subparsers(
        dest="dlq_command", required=True, metavar="ACTION"
    )
    cmd = dlq.add_parser("list", help="list dead letters")
    cmd.add_argument("--state", choices=["recorded", "discard_requested", "requeued", "discarded"])
    cmd.add_argument("--limit", type=int, default=50)
    cmd.set_defaults(handler=cmd_dlq_list)
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
    cmd.add_argument(
        "--status", default="pending",
        choices=["pending", "approved", "rejected", "expired", "cancelled", "all"],
    )  # fmt: skip
    cmd.add_argument("--limit", type=int, default=50)
    cmd.set_defaults(handler=cmd_approvals_list)
    for action in ("approve", "reject"):
        cmd = approvals.add_parser(action, help=f"{action} a waiting step")
        cmd.add_argument("approval_id")
        cmd.add_argument("--by", required=True, help="who decides")
        cmd.add_argument("--reason", default="", required=action == "reject", help="why")
        cmd.set_defaults(handler=cmd_approvals_decide, action=action)

    cmd = commands.add_parser("demo", help="run the demo scenario on the embedded database")
    cmd.add_argument(
        "--real-llm",
        action="store_true",
        help="run the agent against Anthropic's API (needs ANTHROPIC_API_KEY) instead of the"
        " bundled local server",
    )
    cmd.add_argument("--model", default="claude-sonnet-4-5", help="the agent's model")
    cmd.set_defaults(handler=cmd_demo)
    return parser


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
    orc = load_app(args.app)

    async def go() -> int:
        async with orc:
            result: int = await body(orc)
            return result

    return asyncio.run(go())


def cmd_migrate(args: argparse.Namespace) -> int:
    orc = load_app(args.app)
    print(asyncio.run(orc.migrate()))
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        await orc.run_worker(
            concurrency=args.concurrency, queues=args.queues, job_types=args.job_types,
            name=args.name,
        )  # fmt: skip
        return 0

    return _run(args, body)


def cmd_submit(args: argparse.Namespace) -> int:
    try:
        payload = json.loads(args.payload)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--payload is not valid JSON: {exc}") from None

    async def body(orc: Orchestrator) -> int:
        job_id = await orc.submit(
            args.job_type, payload, run_at=args.run_at, priority=args.priority,
            queue=args.queue, max_retries=args.max_retries, job_key=args.job_key,
            job_key_mode=args.job_key_mode, timeout_seconds=args.timeout_seconds,
            agent_id=args.agent_id,
        )  # fmt: skip
        print(job_id)
        return 0

    return _run(args, body)


def cmd_status(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        job = await orc.get_job(args.job_id)
        print(describe(job, await orc.job_events(job.id), await orc.job_steps(job.id)))
        return 0

    return _run(args, body)


def describe(job: Job, events: list[JobEvent], steps: list[dict[str, Any]] | None = None) -> str:
    """A job as an operator wants to read it."""
    lines = [
        f"job {job.id}  {job.job_type}  {job.status.value}",
        f"  attempt {job.attempt} (run {job.dispatch_attempt}/{job.max_attempts} of this "
        f"dispatch), retries {job.retry_count}/{job.max_retries}",
    ]
    if job.next_retry_at is not None:
        wait = (job.next_retry_at - datetime.now(UTC)).total_seconds()
        lines.append(f"  next retry at {job.next_retry_at.isoformat()} (in {max(0, wait):.1f}s)")
    if job.last_error is not None:
        e = job.last_error
        lines.append(f"  last error: [{e.classification.value} {e.code}] {_first_line(e.message)}")
    if job.result is not None:
        lines.append(f"  result: {_clip(json.dumps(job.result), 160)}")
    lines.append("  history:")
    start = events[0].at if events else None
    for event in events:
        offset = (event.at - start).total_seconds() if start else 0.0
        lines.append(f"    +{offset:8.3f}s  {event.kind:<24} {_event_detail(event)}")
    if steps:
        lines.append("  steps:")
        lines.extend(f"    {_step_line(row)}" for row in steps)
    return "\n".join(lines)


def _step_line(row: dict[str, Any]) -> str:
    if row["kind"] == "checkpoint":
        state = _clip(json.dumps(row["detail"]), 90)
        return f"step {row['step']}  checkpoint (attempt {row['attempt']})  {state}"
    detail = row["detail"]
    how = "reconciled" if detail.get("reconciled") else f"attempt {row['attempt']}"
    return (
        f"step {row['step']}  side effect {row['name']} {row['status']} ({how})  "
        f"{row['invocation_id']}"
    )


def _event_detail(event: JobEvent) -> str:
    p = event.payload
    match event.kind:
        case "job.running":
            return f"attempt {p['attempt']} on {p['worker']}"
        case "job.failed":
            error = p["error"]
            tail = "terminal" if p["terminal"] else f"{p.get('layer')} retry"
            message = _clip(_first_line(error["message"]), 70)
            return f"{error['classification']} {error['code']}: {message} ({tail})"
        case "job.retry_scheduled":
            return f"{p['layer']} backoff {p['backoff_ms'] / 1000:.2f}s, retry {p['retry_count']}"
        case "job.dead_lettered":
            return f"dead letter {p['dead_letter_id']}"
        case "job.checkpointed":
            return f"step {p['step']}" + (" (final)" if p.get("final") else "")
        case "job.zombie_detected":
            return f"attempt {p['attempt']} on {p['worker']}: {p['reason']}"
        case "job.waiting_approval":
            return f"step {p['step']}: {p['question']}"
        case "job.approved" | "job.rejected" | "job.approval_expired":
            return f"by {p['decided_by']}: {p['reason']}"
    return ""


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else text


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def cmd_jobs(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        jobs = await orc.list_jobs(status=args.status, job_type=args.job_type, limit=args.limit)
        for job in jobs:
            print(
                f"{job.id}  {job.job_type:<20} {job.status.value:<10} attempt {job.attempt:<3} "
                f"retries {job.retry_count}/{job.max_retries}  {job.created_at:%Y-%m-%d %H:%M:%S}"
            )
        return 0

    return _run(args, body)


def cmd_cancel(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        await orc.cancel(args.job_id, reason=args.reason, by=args.by)
        print(f"cancelled {args.job_id}")
        return 0

    return _run(args, body)


def cmd_config_validate(args: argparse.Namespace) -> int:
    path = args.path or _configured_config_path()
    config = retry_config.load(path)
    print(f"{config.path}: ok ({len(config.job_types)} job types)")
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    config = retry_config.load(_configured_config_path())
    if args.job_type:
        shown: dict[str, Any] = config.for_type(args.job_type).model_dump(mode="json")
    else:
        shown = {
            "file": str(config.path),
            "defaults": config.defaults.model_dump(mode="json"),
            "job_types": {n: c.model_dump(mode="json") for n, c in config.job_types.items()},
        }
    print(json.dumps(shown, indent=2))
    return 0


def _configured_config_path() -> Path | None:
    from orchestrator.settings import Settings

    return Settings().retry_config


def cmd_dlq_list(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        for letter in await orc.dead_letters(state=args.state, limit=args.limit):
            print(
                f"{letter.id}  job {letter.job_id}  {letter.job_type:<20} {letter.state:<18} "
                f"[{letter.error.classification.value} {letter.error.code}] "
                f"{_clip(_first_line(letter.error.message), 60)}"
            )
        return 0

    return _run(args, body)


def cmd_dlq_requeue(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        print(await orc.requeue_dead_letter(args.dead_letter_id))
        return 0

    return _run(args, body)


def cmd_dlq_discard(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        if args.reason:
            await orc.request_discard(args.dead_letter_id, by=args.by, reason=args.reason)
            print(f"discard requested by {args.by}; a second reviewer must confirm it")
        else:
            await orc.confirm_discard(args.dead_letter_id, by=args.by)
            print(f"discarded (confirmed by {args.by})")
        return 0

    return _run(args, body)


def cmd_approvals_list(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        status = None if args.status == "all" else args.status
        for a in await orc.approvals(status=status, limit=args.limit):
            decided = (
                f"  {a['status']} by {a['decided_by']}: {a['reason']}" if a["decided_by"] else ""
            )
            print(
                f"{a['id']}  job {a['job_id']}  step {a['step']}  {a['status']:<9} "
                f"expires {a['expires_at']:%Y-%m-%d %H:%M:%S}  {a['question']}{decided}"
            )
        return 0

    return _run(args, body)


def cmd_approvals_decide(args: argparse.Namespace) -> int:
    async def body(orc: Orchestrator) -> int:
        if args.action == "approve":
            await orc.approve(args.approval_id, by=args.by, reason=args.reason)
        else:
            await orc.reject(args.approval_id, by=args.by, reason=args.reason)
        print(f"{args.action}d {args.approval_id} (by {args.by})")
        return 0

    return _run(args, body)


def cmd_demo(args: argparse.Namespace) -> int:
    from orchestrator import demo

    if args.real_llm and not os.environ.get("ANTHROPIC_API_KEY"):
        raise UsageError("--real-llm needs ANTHROPIC_API_KEY in the environment")
    return asyncio.run(demo.main(real_llm=args.real_llm, model=args.model))
