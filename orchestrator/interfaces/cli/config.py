"""``config``: the retry config, checked (``validate``), shown with the version each live process
runs (``show``), and an edit compared with it before a reload applies it (``diff``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import retry_config
from orchestrator.app import Orchestrator
from orchestrator.interfaces.cli.shared import Commands, UsageError, load_app, nothing, opened
from orchestrator.settings import Settings
from orchestrator.storage.config_versions import WorkerConfig


def add_parsers(commands: Commands) -> None:
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
                for w in opened(orc, live)
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
        nothing(f"{args.path}: no change against {running.path}")
    return 1 if changes else 0


def _configured_config_path() -> Path | None:
    return Settings().retry_config
