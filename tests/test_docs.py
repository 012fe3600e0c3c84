"""The docs are true to the code: the configuration reference names every setting and every retry
config field there is, and every Python example runs as written."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator import Settings
from retry_config import BackoffConfig, JobRetryConfig
from tests.support.api_server import ApiServer
from tests.support.harness import clear_tables

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = (ROOT / "docs" / "configuration.md").read_text()


@pytest.mark.parametrize("name", sorted(Settings.model_fields))
def test_every_setting_is_documented(name: str) -> None:
    variable = "DATABASE_URL" if name == "database_url" else f"ORCHESTRATOR_{name.upper()}"
    if name in ("pool_min_size", "pool_max_size"):
        variable = "ORCHESTRATOR_POOL_MIN_SIZE"  # documented together with _MAX_SIZE
    assert f"`{variable}" in REFERENCE


def test_every_variable_the_code_reads_is_documented() -> None:
    """Settings' fields and the variables read outside them (the built-in job types')."""
    sources = [*(ROOT / "orchestrator").rglob("*.py"), *(ROOT / "tasks").rglob("*.py")]
    named = {
        v for path in sources for v in re.findall(r"ORCHESTRATOR_[A-Z0-9_]+", path.read_text())
    }
    assert {v for v in named if f"`{v}`" not in REFERENCE} == set()


@pytest.mark.parametrize(
    "field",
    sorted(JobRetryConfig.model_fields.keys() - {"backoff"})
    + [f"backoff.{name}" for name in sorted(BackoffConfig.model_fields)],
)
def test_every_retry_config_field_is_documented(field: str) -> None:
    assert f"| `{field}` |" in REFERENCE


def python_examples() -> list[tuple[str, str]]:
    """Every ```python block of README.md and docs/*.md, named by file and position."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        blocks = re.findall(r"^```python\n(.*?)^```", path.read_text(), re.MULTILINE | re.DOTALL)
        found += [(f"{path.name}#{n}", code) for n, code in enumerate(blocks, 1)]
    return found


@contextlib.contextmanager
def api_server(dsn: str) -> Iterator[dict[str, str]]:
    """A live API server and a token, for an example that uses the API's client."""
    with ApiServer(dsn, app="tasks.app:orc") as server:  # the built-in job types
        created = subprocess.run(
            [sys.executable, "-m", "orchestrator", "tokens", "create", "docs", "--scope", "admin"],
            cwd=ROOT, env={**os.environ, "DATABASE_URL": dsn}, capture_output=True, text=True,
            check=True,
        )  # fmt: skip
        yield {"ORCHESTRATOR_URL": server.url, "ORCHESTRATOR_TOKEN": created.stdout.strip()}


@pytest.mark.parametrize(("where", "code"), python_examples(), ids=lambda v: str(v)[:30])
def test_every_python_example_runs_as_written(where: str, code: str, dsn: str) -> None:
    """Each example is a whole module: it runs in a fresh interpreter as it is printed, on the
    test database's empty tables (a job one example leaves waiting, as the API's does, is not
    run by the next one's worker, which does not know its type), with an API server where it
    calls the API."""
    clear_tables(dsn)
    with contextlib.ExitStack() as stack:
        api = stack.enter_context(api_server(dsn)) if "ORCHESTRATOR_URL" in code else {}
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
            check=False, timeout=120,
            env={**os.environ, "DATABASE_URL": dsn, "ORCHESTRATOR_HEALTH_PORT": "0", **api},
        )  # fmt: skip
    assert done.returncode == 0, f"{where}:\n{done.stderr}"


def test_the_readme_example_shows_what_happened(dsn: str) -> None:
    [(_, code)] = [(where, code) for where, code in python_examples() if where == "README.md#1"]
    clear_tables(dsn)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False,
        env={**os.environ, "DATABASE_URL": dsn, "ORCHESTRATOR_HEALTH_PORT": "0"}, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("COMPLETED {'summary': 'https://example.com, summarised on")
    assert "started: database " in done.stderr and ", concurrency 10" in done.stderr
    assert "attempt 1: retried" in done.stderr and "attempt 2: completed" in done.stderr
