"""Schemathesis, the tool API users run, against a live ``orchestrator serve``: generated
requests to every operation of its OpenAPI document, with a token and without; no answer is a
5xx, and every answer's status, content type and body are ones the document declares."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.api_server import ApiServer
from tests.support.harness import ROOT

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


@pytest.fixture(scope="module")
def live(dsn: str) -> Iterator[tuple[ApiServer, str]]:
    with ApiServer(dsn, ORCHESTRATOR_API_WAIT_MAX_SECONDS="0.2") as server:
        created = subprocess.run(
            [sys.executable, "-m", "orchestrator", "tokens", "create", "schemathesis",
             "--scope", "admin"],
            cwd=ROOT, env={**os.environ, "DATABASE_URL": dsn}, capture_output=True, text=True,
            check=True,
        )  # fmt: skip
        yield server, created.stdout.strip()


def schemathesis(server: ApiServer, *args: str) -> subprocess.CompletedProcess[str]:
    cli = Path(sys.executable).parent / "schemathesis"
    return subprocess.run(
        [str(cli), "run", f"{server.url}/api/v1/openapi.json", "--checks", CHECKS,
         "--seed", "17",
         "--generation-database", "none", "--request-timeout", "10", *args],
        capture_output=True, text=True, timeout=600, check=False,
        cwd=tempfile.gettempdir(),  # where it keeps its cache (.schemathesis/)
    )  # fmt: skip


# With a token, also Schemathesis's coverage phase (each schema's edge values: it found the
# undocumented 400 of an unreadable body); without one, every request stops at the 401.
@pytest.mark.parametrize(
    ("authenticated", "examples", "phases"),
    [(True, 25, "examples,coverage,fuzzing"), (False, 5, "examples,fuzzing")],
    ids=["token", "no-token"],
)
def test_every_answer_is_declared_and_none_is_a_server_error(
    live: tuple[ApiServer, str], authenticated: bool, examples: int, phases: str
) -> None:
    server, secret = live
    auth = ["-H", f"Authorization: Bearer {secret}"] if authenticated else []
    done = schemathesis(server, "--max-examples", str(examples), "--phases", phases, *auth)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "passed" in done.stdout.lower()
