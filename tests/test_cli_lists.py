"""The CLI's lists through the real command (a process of its own, on the test database): a
list cut at ``--limit`` says so, ``jobs`` takes the API's filters, a person at a terminal reads
a header row over each table (a script reading a pipe gets the rows alone), ``stats`` takes
durations and the natural names of what it splits by, ``usage`` says when its groups are cut."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

import tasks
from orchestrator import Orchestrator
from orchestrator.domain.principals import Scope

ROOT = Path(__file__).resolve().parent.parent
URL = '{"url": "http://127.0.0.1:9/"}'


@pytest.fixture
def cli(empty_dsn: str) -> Callable[..., tuple[int, str, str]]:
    """``orchestrator ARGS``, run as an operator runs it: its exit code, stdout and stderr."""

    def run(*argv: str) -> tuple[int, str, str]:
        done = subprocess.run(
            [sys.executable, "-m", "orchestrator", *argv], capture_output=True, text=True,
            env={**os.environ, "DATABASE_URL": empty_dsn}, cwd=ROOT, timeout=120,
        )  # fmt: skip
        return done.returncode, done.stdout, done.stderr

    return run


def on_a_terminal(dsn: str, *argv: str) -> str:
    """What ``orchestrator ARGS`` prints to a terminal (a pseudo-terminal as its stdout)."""
    reader, writer = pty.openpty()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", *argv], stdout=writer,
            stderr=subprocess.DEVNULL, env={**os.environ, "DATABASE_URL": dsn}, cwd=ROOT,
        )  # fmt: skip
        os.close(writer)
        writer = -1
        chunks = []
        while True:
            try:
                chunk = os.read(reader, 4096)
            except OSError:  # EIO: the terminal's other end closed with the process
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert process.wait(timeout=120) == 0
    finally:
        os.close(reader)
        if writer != -1:
            os.close(writer)
    return b"".join(chunks).decode().replace("\r\n", "\n")


async def submitted(orc: Orchestrator, n: int, **options: object) -> list[str]:
    return [str(await orc.submit("http_request", {"url": "http://127.0.0.1:9/"}, **options))
            for _ in range(n)]  # fmt: skip


async def test_jobs_says_when_cut_and_takes_the_api_s_filters(
    cli: Callable[..., tuple[int, str, str]], make_orc: Callable[..., Orchestrator]
) -> None:
    orc = make_orc()
    tasks.register_all(orc)
    async with orc:
        acme = await submitted(orc, 3, tenant_id="acme", agent_id="triage")
        other = await submitted(orc, 2, tenant_id="globex", agent_id="billing")
    newest_first = [*reversed(other), *reversed(acme)]

    code, out, err = cli("jobs", "--limit", "3")
    assert (code, [line.split()[0] for line in out.splitlines()]) == (0, newest_first[:3])
    assert err == "the first 3 shown; more match (--limit to see more)\n"
    code, out, err = cli("jobs", "--limit", "5")  # all of them: nothing more to say
    assert (code, len(out.splitlines()), err) == (0, 5, "")
    code, out, err = cli("jobs", "--help")
    said = " ".join(out.split())
    assert code == 0 and "(50 unless --limit;" in said and "most jobs shown (default 50)" in said

    code, out, err = cli("jobs", "--agent", "triage", "--status", "pending")  # any case
    assert (code, [line.split()[0] for line in out.splitlines()], err) == (
        0, list(reversed(acme)), "",
    )  # fmt: skip
    code, out, _ = cli("jobs", "--since", "1h", "--until", "2099-01-01T00:00:00Z")
    assert (code, len(out.splitlines())) == (0, 5)
    assert cli("jobs", "--agent", "triage", "--tenant", "globex") == (
        0, "", "no jobs of agent triage for tenant globex\n",
    )  # fmt: skip
    later = datetime.now(UTC) + timedelta(hours=1)
    code, out, err = cli("jobs", "--since", later.isoformat())
    assert (code, out) == (0, "") and err.startswith("no jobs since ")

    code, out, err = cli("jobs", "--since", "yesterday")
    assert (code, out) == (2, "") and err.startswith("error: argument --since: not an ISO 8601")
    code, out, err = cli("jobs", "--since", "1h", "--until", "2h")
    assert (code, out) == (2, "") and err.startswith("error: created_after: ")
    assert err.count("\n") == 1


async def test_a_person_reads_a_header_over_each_table(
    empty_dsn: str, make_orc: Callable[..., Orchestrator]
) -> None:
    orc = make_orc()
    tasks.register_all(orc)
    async with orc:
        (job_id,) = await submitted(orc, 1, tenant_id="acme")
        await orc.stores.tokens.create("ops", [Scope.READ], None, by="test")
    jobs = on_a_terminal(empty_dsn, "jobs").splitlines()
    assert jobs[0].split() == ["ID", "TYPE", "STATUS", "ATTEMPT", "RETRIES", "CREATED"]
    assert jobs[1].startswith(job_id) and len(jobs) == 2
    assert jobs[1].index("PENDING") == jobs[0].index("STATUS")  # the columns line up
    tokens = on_a_terminal(empty_dsn, "tokens", "list").splitlines()
    assert tokens[0].split() == ["NAME", "SCOPES", "TENANTS", "STATE"]
    assert tokens[1].split() == ["ops", "read", "every", "tenant", "live"]


def test_stats_takes_durations_and_the_names_it_splits_by(
    cli: Callable[..., tuple[int, str, str]],
) -> None:
    code, out, err = cli("stats", "--step", "5m", "--by", "type", "--from", "2h")
    assert (code, err) == (0, "") and ", per 300 s " in out.splitlines()[0]
    code, out, err = cli("stats", "--step", "90s")  # the rollups' minutes
    assert (code, out) == (2, "")
    assert err == "error: step: 90 s is not a whole number of minutes (60, 300, ...)\n"
    code, out, err = cli("stats", "--step", "soon")
    assert (code, out) == (2, "")
    assert err.startswith("error: argument --step: not a duration: 'soon' (e.g. 90, 30s, 10m")
    code, out, err = cli("stats", "--by", "colour")
    assert (code, out) == (2, "")
    assert err == "error: by: 'colour' is not one of job_type, queue, tenant (or type)\n"


async def test_usage_says_when_its_groups_are_cut(
    cli: Callable[..., tuple[int, str, str]],
    make_orc: Callable[..., Orchestrator],
    db: psycopg.AsyncConnection[Any],
) -> None:
    orc = make_orc()
    tasks.register_all(orc)
    async with orc:
        (job_id,) = await submitted(orc, 1)
    for n, model in enumerate(("small", "medium", "large")):
        await db.execute(
            "INSERT INTO orc_llm_usage (job_id, call_id, attempt, job_type, model, input_tokens,"
            " output_tokens, cache_read_tokens, cache_creation_tokens)"
            " VALUES (%s, %s, 1, 'http_request', %s, %s, 0, 0, 0)",
            (job_id, f"call-{n}", model, 10 ** (n + 1)),
        )
    code, out, err = cli("usage", "--by", "model", "--limit", "2")
    assert code == 0 and [line.split()[0] for line in out.splitlines()[2:4]] == ["large", "medium"]
    assert err == "the 2 largest groups shown; more match (--limit to see more)\n"
    code, out, err = cli("usage", "--by", "model", "--limit", "3")
    assert (code, err) == (0, "") and "small" in out
