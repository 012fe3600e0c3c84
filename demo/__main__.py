"""``python -m demo [--real-llm] [--model M]``: the demo scenario (see the package docstring).

A Ctrl-C ends it quietly (exit 130), and a database it cannot reach or create is one line
(exit 1); its database is dropped either way.
"""

import argparse
import os
import sys

import psycopg

from demo import run
from orchestrator.domain.errors import DatabaseUnavailable

parser = argparse.ArgumentParser(prog="demo", description="the orchestrator's demo scenario")
parser.add_argument(
    "--real-llm",
    action="store_true",
    help="run the agent against Anthropic's API (needs ANTHROPIC_API_KEY) instead of the"
    " bundled local server",
)
parser.add_argument("--model", default="claude-sonnet-4-5", help="the agent's model")
args = parser.parse_args()
if args.real_llm and not os.environ.get("ANTHROPIC_API_KEY"):
    print("error: --real-llm needs ANTHROPIC_API_KEY in the environment", file=sys.stderr)
    raise SystemExit(2)
try:
    code = run(real_llm=args.real_llm, model=args.model)
except KeyboardInterrupt:
    code = 130
except (psycopg.Error, DatabaseUnavailable) as exc:
    print(f"error: the demo's database: {' '.join(str(exc).split())}", file=sys.stderr)
    code = 1
raise SystemExit(code)
