"""``demo``: the demo scenario, run as ``./dev demo`` runs it."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from orchestrator.interfaces.cli.shared import Commands, UsageError


def add_parsers(commands: Commands) -> None:
    cmd = commands.add_parser("demo", help="run the demo scenario, in a database of its own")
    cmd.add_argument(
        "--real-llm",
        action="store_true",
        help="run the agent against Anthropic's API (needs ANTHROPIC_API_KEY) instead of the"
        " bundled local server",
    )
    cmd.add_argument("--model", default="claude-sonnet-4-5", help="the agent's model")
    cmd.set_defaults(handler=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    """The demo is an application of its own (the top-level ``demo`` package): it runs in a
    process of its own, as ``./dev demo`` runs it."""
    if args.real_llm and not os.environ.get("ANTHROPIC_API_KEY"):
        raise UsageError("--real-llm needs ANTHROPIC_API_KEY in the environment")
    command = [sys.executable, "-m", "demo", "--model", args.model]
    if args.real_llm:
        command.append("--real-llm")
    return subprocess.run(command, check=False).returncode
