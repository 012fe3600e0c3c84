"""The release before the redesign (migrations 0001-0009), run for real: its tree extracted from
git, its command line run as a process on a test database. Upgrade tests populate a database
with it, then migrate with today's code. Without git or the commit, the test skips with a
one-line reason; under CI=true it fails instead (CI must run it)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any, NoReturn

import pytest

#: The previous release: its package layout differs (migrations at orchestrator/sql/migrations).
PREVIOUS_RELEASE = "532b0c2964ebbee5c46eb0cf86d21da83e1b621f"

ROOT = Path(__file__).resolve().parents[2]


def checkout(dest: Path) -> Path:
    """The previous release's files (``git archive`` of its commit) extracted into ``dest``."""
    try:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", PREVIOUS_RELEASE],
            capture_output=True, timeout=120, check=False,
        )  # fmt: skip
    except FileNotFoundError:
        _missing("git not found")
    if archive.returncode != 0:
        _missing(f"commit {PREVIOUS_RELEASE[:7]} not in this clone (a shallow clone?)")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def run(root: Path, dsn: str, *argv: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``python -m orchestrator *argv`` of the release extracted at ``root``, on ``dsn`` (that
    release reads ``DATABASE_URL``); ``kwargs`` go to subprocess.run."""
    env = {**os.environ, "PYTHONPATH": str(root), "DATABASE_URL": dsn, **kwargs.pop("env", {})}
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *argv], cwd=root, env=env, capture_output=True,
        text=True, check=False, **kwargs,
    )  # fmt: skip


def _missing(why: str) -> NoReturn:
    reason = f"the previous release is needed: {why}"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI=true requires it")
    pytest.skip(reason)
