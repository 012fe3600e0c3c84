"""The fleet at a glance (``GET /api/v1/summary``, ``orchestrator status`` without a job id),
through a real ``orchestrator serve`` and the real command line: what runs, what waits unserved
and is due, the letters to review, nobody notified; and, as an attacker holding another
tenant's token would try, none of one tenant's counts or letters in another's answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import psycopg
import pytest

from orchestrator import Orchestrator
from orchestrator.domain.applications import UnservedJobs
from orchestrator.domain.principals import Scope
from orchestrator.domain.summary import HeldKey, Notifications, problems
from tests.support import log_guard, ui_app
from tests.support.api_server import ApiServer, token
from tests.support.harness import ROOT, WorkerRun, wait_for

APP = "tests.support.ui_app:orc"


@pytest.fixture(scope="module")
def server(dsn: str) -> Iterator[ApiServer]:
    with ApiServer(dsn, app=APP, ORCHESTRATOR_RETRY_CONFIG=ui_app.CONFIG) as running:
        yield running


@pytest.fixture
async def orc(make_orc: Callable[..., Orchestrator]) -> AsyncIterator[Orchestrator]:
    made = make_orc(retry_config=ui_app.CONFIG)
    ui_app.register(made)
    await made.open()
    yield made


def cli(dsn: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``orchestrator --app APP ARGV`` as an operator runs it: a real process."""
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "--app", APP, *argv],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
        env={**os.environ, "DATABASE_URL": dsn, "ORCHESTRATOR_RETRY_CONFIG": str(ui_app.CONFIG)},
    )  # fmt: skip


async def summary_of(server: ApiServer, secret: str) -> dict[str, Any]:
    async with httpx.AsyncClient(
        base_url=server.url, headers={"Authorization": f"Bearer {secret}"}, timeout=30
    ) as client:
        answer = await client.get("/api/v1/summary")
    assert answer.status_code == 200, answer.text
    found: dict[str, Any] = answer.json()
    return found


@log_guard.fails_jobs("HTTP_400")
async def test_the_summary_says_what_waits_and_what_is_wrong_each_tenant_its_own(
    orc: Orchestrator, server: ApiServer, dsn: str
) -> None:
    async with WorkerRun(orc) as worker:  # a worker, then stopped: the jobs after wait unserved
        doomed = await orc.submit("scripted", {"script": ["permanent"]}, tenant_id="a")
        await worker.until_finished(doomed)
    for _ in range(2):
        await orc.submit("scripted", {"script": ["ok"]}, tenant_id="a")
    await orc.submit("scripted", {"script": ["ok"]}, tenant_id="b")
    fleet = await token(orc.stores.tokens, "fleet", Scope.READ)
    mine = await token(orc.stores.tokens, "mine", Scope.READ, tenants=["a"])
    theirs = await token(orc.stores.tokens, "theirs", Scope.READ, tenants=["b"])
    nobody = await token(orc.stores.tokens, "nobody", Scope.READ, tenants=["c"])

    async def settled() -> bool:
        """The stopped worker is gone from the registry, and ``serve`` is in it (again: each
        test empties the tables, and it registers anew at its next heartbeat) as a server."""
        found = await summary_of(server, fleet)
        return found["runners"] == [] and [s["runs"] for s in found["servers"]] == ["external"]

    await wait_for(settled, 30)
    everything = await summary_of(server, fleet)
    assert everything["jobs"]["PENDING"] == 3
    assert everything["stalled"] == []
    (unserved,) = everything["unserved"]
    assert (unserved["job_type"], unserved["due"], unserved["queues"]) == (
        "scripted", 3, ["scripted"]
    )  # fmt: skip
    assert everything["letters_to_review"] == {"recorded": 1, "discard_requested": 0}
    assert everything["notifications"] == {"failures": None, "approvals": None}
    kinds = [p["kind"] for p in everything["problems"]]
    assert kinds == ["unserved", "dead_letters", "notifications"], kinds
    said = {p["kind"]: p for p in everything["problems"]}
    assert said["unserved"]["text"].startswith("3 scripted job(s) due on queue scripted")
    assert said["unserved"]["link"] == "/ui/applications"
    assert said["dead_letters"]["link"] == "/ui/dead-letters"

    own = await summary_of(server, mine)
    assert own["jobs"]["PENDING"] == 2 and own["unserved"][0]["due"] == 2
    assert own["letters_to_review"]["recorded"] == 1
    other = await summary_of(server, theirs)  # tenant b: none of a's counts or letters
    assert other["jobs"]["PENDING"] == 1 and other["unserved"][0]["due"] == 1
    assert other["letters_to_review"] == {"recorded": 0, "discard_requested": 0}
    assert "dead_letters" not in [p["kind"] for p in other["problems"]]
    stranger = await summary_of(server, nobody)
    assert sum(stranger["jobs"].values()) == 0 and stranger["unserved"] == []
    assert [p["kind"] for p in stranger["problems"]] == ["notifications"]
    for text in (json.dumps(other), json.dumps(stranger)):
        assert str(doomed) not in text

    # The command line: the same read, and --tenant as a token's tenants.
    done = cli(dsn, "status")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert (
        "jobs unfinished: 3 PENDING, 0 RUNNING, 0 RETRY, 0 WAITING_APPROVAL, 0 BLOCKED" in lines
    ), lines
    assert "workers alive that run jobs: 0; API servers: 1; stalled: 0" in lines, lines
    assert "jobs waiting that no live worker runs: scripted (3 due, queue scripted)" in lines
    assert "dead letters to review: 1 (1 recorded, 0 discard requested)" in lines
    assert "failures notified to: nobody; approvals notified to: nobody" in lines
    assert any(line.startswith("PROBLEM 3 scripted job(s) due") for line in lines), lines
    scoped = cli(dsn, "status", "--tenant", "b", "--json")
    assert scoped.returncode == 0, scoped.stderr
    shown = json.loads(scoped.stdout)
    assert shown["jobs"]["PENDING"] == 1
    assert shown["letters_to_review"] == {"recorded": 0, "discard_requested": 0}
    wrong = cli(dsn, "status", str(doomed), "--json")
    assert (wrong.returncode, wrong.stdout) == (2, "") and "Traceback" not in wrong.stderr
    assert wrong.stderr.startswith("error: --tenant and --json: only without a job id")


async def test_a_stalled_process_and_a_notification_target_are_said_as_they_are(
    orc: Orchestrator, dsn: str, db: psycopg.AsyncConnection[Any]
) -> None:
    """A registry entry silent past the stalled-worker timeout is a problem; a server with an
    escalation target says where failures go (its channel, never its address)."""
    target = '{"channel": "webhook", "url": "https://hooks.example/secret-path"}'
    with ApiServer(dsn, app=APP, ORCHESTRATOR_RETRY_CONFIG=ui_app.CONFIG,
                   ORCHESTRATOR_ESCALATION_TARGET=target,
                   ORCHESTRATOR_ESCALATION_JOB_TYPE="shaped",
                   ORCHESTRATOR_APPROVAL_JOB_TYPE="shaped") as told:  # fmt: skip
        secret = await token(orc.stores.tokens, "t", Scope.READ)
        read: dict[str, Any] = {}

        async def stalled_shown() -> bool:
            # (planted again if a process registering meanwhile pruned it, as it should)
            await db.execute(
                "INSERT INTO procrastinate_workers (last_heartbeat) SELECT now() - interval"
                " '1 hour' WHERE NOT EXISTS (SELECT FROM procrastinate_workers"
                " WHERE last_heartbeat < now() - interval '30 minutes')"
            )
            read.update(await summary_of(told, secret))
            return any(p["kind"] == "stalled" for p in read["problems"])

        await wait_for(stalled_shown, 30)
        found = read
    assert found["notifications"] == {"failures": "webhook", "approvals": "webhook"}
    assert "secret-path" not in json.dumps(found)
    assert [p["kind"] for p in found["problems"]] == ["stalled"]
    (stalled,) = found["stalled"]
    assert stalled["runs"] is None and stalled["stalled"] is True
    assert "no heartbeat for" in found["problems"][0]["text"]


def test_each_problem_says_what_and_what_to_do_the_most_urgent_first() -> None:
    """The pure rule (orchestrator.domain.summary.problems): a key whose pause ended while its
    rate is still low is slowed, not paused; nothing wrong, no problem."""
    at = datetime(2026, 1, 1, 12, tzinfo=UTC)
    key = HeldKey(key="provider:m", limit_name="provider", paused=False,
                  paused_until=at - timedelta(minutes=1), paused_by="alice", pause_reason="x",
                  rate_factor=0.25, waiting=3)  # fmt: skip
    told = Notifications(failures="webhook", approvals=None)
    found = problems(
        processes=[], unserved=[UnservedJobs(job_type="t", pending=1, retry=1, due=2,
                                             queues=["q"])],
        held_keys=[key], letters_to_review={"recorded": 0, "discard_requested": 2},
        notifications=told, at=at,
    )  # fmt: skip
    assert [p.kind for p in found] == ["unserved", "flow_key", "dead_letters", "notifications"]
    assert (
        found[1].text == "Flow key provider:m (3 waiting) is slowed to 25% of its rate after "
        "its provider's 429s"
    )
    assert found[3].text == "Nobody is notified of approvals: no target is set"
    everything_fine = problems(
        processes=[], unserved=[UnservedJobs(job_type="t", pending=1, retry=0, due=0,
                                             queues=["q"])],
        held_keys=[], letters_to_review={"recorded": 0, "discard_requested": 0},
        notifications=Notifications(failures="webhook", approvals="webhook"), at=at,
    )  # fmt: skip
    assert everything_fine == []  # (a job waiting unserved but not yet due is no problem yet)
