"""The previous release (the last one landed: migrations 0001-0032), run for real against today's
schema, as a rolling deploy runs it: its own code, extracted from git, started with this
interpreter. The rollout contract (docs/operations.md) is between a release and the one before
it, so this pin moves to each release as the next one begins. Without git or the commit the
test skips with a one-line reason; under CI=true it fails instead."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any, NoReturn

import pytest

PREVIOUS_RELEASE = "6a77f75f3ccb5c089b476c3cb0ba445a94ac662a"
REPOSITORY = Path(__file__).resolve().parent.parent.parent


def checkout(dest: Path, commit: str = PREVIOUS_RELEASE) -> Path:
    """That release's files (``git archive``) in ``dest``; ``commit``: an older one, for a test
    of an upgrade from it."""
    git = shutil.which("git")
    if git is None:
        _missing("git not found: the previous release is read from the repository's history")
    archive = subprocess.run(
        [git, "-C", str(REPOSITORY), "archive", "--format=tar", commit],
        capture_output=True, check=False,
    )  # fmt: skip
    if archive.returncode != 0:
        reason = archive.stderr.decode(errors="replace").strip().splitlines()
        _missing(
            f"the release {commit[:7]} is not in this clone "
            f"({reason[-1] if reason else 'git archive failed'}): fetch its history"
        )
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def run(root: Path, dsn: str, *argv: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``python -m orchestrator ARGV`` of the release in ``root``, on the database ``dsn``."""
    return python(root, dsn, "-m", "orchestrator", *argv, **kwargs)


def python(root: Path, dsn: str, *argv: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``python ARGV`` with the release in ``root`` importable, on the database ``dsn``."""
    kwargs.setdefault("timeout", 120)
    return subprocess.run(
        [sys.executable, *argv], cwd=root, env=_env(root, dsn, kwargs),
        capture_output=True, text=True, check=False, **kwargs,
    )  # fmt: skip


def start(root: Path, dsn: str, *argv: str, **kwargs: Any) -> subprocess.Popen[str]:
    """Like :func:`run`, but running on (a worker): stop it with ``terminate()``."""
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator", *argv], cwd=root, env=_env(root, dsn, kwargs),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs,
    )  # fmt: skip


def _env(root: Path, dsn: str, kwargs: dict[str, Any]) -> dict[str, str]:
    """That release reads its database from ``DATABASE_URL`` (its orchestrator/settings.py);
    ``env=`` in ``kwargs`` adds to the environment."""
    return {**os.environ, **kwargs.pop("env", {}), "PYTHONPATH": str(root), "DATABASE_URL": dsn}


def _missing(why: str) -> NoReturn:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}; CI=true requires it")
    pytest.skip(why)
