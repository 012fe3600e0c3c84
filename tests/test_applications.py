"""Several applications on one database (docs/applications.md), at the store and the database:
each application's declarations of the shared rows (flow limits, limited job types, job types,
schedules) are its own; a name two applications declare otherwise is refused, naming both and
what differs, and the refusal recorded; a withdrawal waits while a live peer of the application
runs another config version; the waiting jobs of a type no live application declares are
counted, per tenant. The two-process run (workers, ``serve``, reloads and ``migrate`` of a
second application beside a first's LLM jobs) is tests/test_applications_fleet.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from orchestrator import JobContext, Orchestrator
from orchestrator.domain.applications import Application
from orchestrator.domain.errors import ApplicationConflict
from orchestrator.domain.schedules import define
from orchestrator.services.fleet import FleetMetrics
from retry_config import parse_bytes
from tests.support.harness import ROOT, config_with

A = Application("agents")
B = Application("billing")


def config(limits: str, version: str = "") -> Any:
    """A retry config of these ``[limits.*]`` tables (``version``: a comment that changes the
    file's version alone)."""
    return parse_bytes(f"# {version}\n{limits}".encode(), Path("applications.toml"))


LLM_1 = '[limits.llm]\nkey = "llm"\nconcurrency = 1\n'
LLM_5 = '[limits.llm]\nkey = "llm"\nconcurrency = 5\n'
OTHER = '[limits.other]\nkey = "other"\nrequests = 10\ninterval_seconds = 60\n'


async def limits(db: psycopg.AsyncConnection[Any]) -> dict[str, Any]:
    cur = await db.execute(
        "SELECT name, concurrency, requests FROM orc_flow_limits WHERE owner = 'config'"
    )
    return {row[0]: row[1:] for row in await cur.fetchall()}


async def declared(db: psycopg.AsyncConnection[Any], kind: str) -> set[tuple[str, str]]:
    cur = await db.execute(
        "SELECT application, name FROM orc_application_definitions WHERE kind = %s", (kind,)
    )
    return {(row[0], row[1]) for row in await cur.fetchall()}


@pytest.fixture
async def orc(make_orc: Callable[..., Orchestrator]) -> Orchestrator:
    made = make_orc()
    await made.open()
    return made


async def test_an_application_s_sync_leaves_another_s_limits_alone(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any]
) -> None:
    flow = orc.stores.flow
    await flow.sync(config(LLM_1), A)
    await flow.sync(config(OTHER), B)
    assert await limits(db) == {"llm": (1, None), "other": (None, 10)}
    await flow.sync(config(""), B)  # B withdraws all it had: A's stays
    assert await limits(db) == {"llm": (1, None)}
    assert await declared(db, "limit") == {("agents", "llm")}


async def test_a_limit_defined_otherwise_by_a_second_application_is_refused_and_recorded(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any]
) -> None:
    flow = orc.stores.flow
    await flow.sync(config(LLM_1), A)
    with pytest.raises(ApplicationConflict) as refused:
        await flow.sync(config(LLM_5 + OTHER), B)
    said = str(refused.value)
    for text in ("'billing'", "'agents'", "limit 'llm'", "concurrency: 5 here, 1 there"):
        assert text in said, said
    assert await limits(db) == {"llm": (1, None)}  # nothing of B's declaration was written
    assert await declared(db, "limit") == {("agents", "llm")}
    cur = await db.execute(
        "SELECT application, kind, name, other, difference FROM orc_application_conflicts"
    )
    assert await cur.fetchall() == [("billing", "limit", "llm", "agents", {"concurrency": [5, 1]})]
    # Shared with one definition: B declares it too, and the refusal is mended.
    await flow.sync(config(LLM_1 + OTHER), B)
    cur = await db.execute("SELECT count(*) FROM orc_application_conflicts")
    assert await cur.fetchone() == (0,)
    assert await declared(db, "limit") == {
        ("agents", "llm"), ("billing", "llm"), ("billing", "other")
    }  # fmt: skip
    await flow.sync(config(""), A)  # A withdraws it; B still declares it: it stays
    assert await limits(db) == {"llm": (1, None), "other": (None, 10)}
    await flow.sync(config(OTHER), B)
    assert await limits(db) == {"other": (None, 10)}


async def test_a_withdrawal_waits_while_a_live_peer_declares_otherwise(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any]
) -> None:
    """A one-off script (or half a rolling deploy) that declares otherwise, of the same
    application, does not take away the limits its live peers run under; once every live peer
    declares as it does (or belongs to another application), the withdrawal is made."""
    flow = orc.stores.flow
    full = config(LLM_1 + OTHER, "full")
    await flow.sync(full, A, "fingerprint-of-the-workers")
    peer = await orc.stores.dispatches.register_worker(prune_after=30)
    await orc.stores.config_versions.record(
        peer, worker="peer", config=orc.live_config, application="agents",
        declares="fingerprint-of-the-workers", runs="jobs",
    )  # fmt: skip
    names, answer = await flow.sync(config(OTHER, "script"), A, "fingerprint-of-a-script")
    assert answer.deferred == ["limit llm"] and names == []
    assert await limits(db) == {"llm": (1, None), "other": (None, 10)}
    assert await declared(db, "limit") == {("agents", "llm"), ("agents", "other")}
    # The same fingerprint as every live peer: withdrawn.
    names, answer = await flow.sync(config(OTHER, "next"), A, "fingerprint-of-the-workers")
    assert (answer.deferred, names) == ([], ["llm"])
    assert await limits(db) == {"other": (None, 10)}
    # A peer of another application, declaring anything, does not hold it back.
    await flow.sync(full, A, "fingerprint-of-the-workers")
    await db.execute("UPDATE orc_worker_configs SET application = 'billing'")
    names, answer = await flow.sync(config(OTHER, "script"), A, "fingerprint-of-a-script")
    assert (answer.deferred, names) == ([], ["llm"])


async def test_migrate_of_one_application_leaves_another_s_job_types(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    async def run(ctx: JobContext, payload: Any) -> None:
        return None

    first = make_orc(application="agents")
    first.job_type("a_type")(run)
    second = make_orc(application="billing")
    second.job_type("b_type")(run)
    await first.migrate()
    await second.migrate()
    cur = await db.execute("SELECT job_type FROM orc_job_types")
    types = {row[0] for row in await cur.fetchall()}
    assert {"a_type", "b_type"} <= types
    assert ("agents", "a_type") in await declared(db, "job_type")
    # A job type both define with one definition is shared; otherwise the second is refused.
    clash = make_orc(
        application="relay", retry_config=config_with('\n[job_types.a_type]\nqueue = "elsewhere"\n')
    )
    clash.job_type("a_type")(run)
    with pytest.raises(ApplicationConflict, match=r"job type 'a_type' is defined otherwise by "
                       r"application 'agents'.*queue"):  # fmt: skip
        await clash.migrate()
    cur = await db.execute("SELECT queue FROM orc_job_types WHERE job_type = 'a_type'")
    assert await cur.fetchone() == ("a_type",)


async def test_schedules_are_each_application_s_own(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any]
) -> None:
    store = orc.stores.schedules
    nightly = define("nightly", "report", source="test", cron="0 3 * * *")
    hourly = define("hourly", "sweep", source="test", cron="0 * * * *")
    await store.sync(A, [nightly])
    await store.sync(B, [hourly])
    await store.sync(B, [])
    cur = await db.execute("SELECT name FROM orc_schedules")
    assert await cur.fetchall() == [("nightly",)]
    other = define("nightly", "report", source="test", cron="0 4 * * *")
    with pytest.raises(ApplicationConflict, match=r"schedule 'nightly'.*cron"):
        await store.sync(B, [other])
    # An operator's command of A holding none of its schedules withdraws none.
    await store.sync(A, [], whole=False)
    cur = await db.execute("SELECT name, cron FROM orc_schedules")
    assert await cur.fetchall() == [("nightly", "0 3 * * *")]


async def test_waiting_jobs_of_a_type_no_live_application_declares_are_shown_per_tenant(
    make_orc: Callable[..., Orchestrator],
) -> None:
    async def run(ctx: JobContext, payload: Any) -> None:
        return None

    gone = make_orc(application="gone")
    gone.job_type("gone_type")(run)
    await gone.migrate()
    await gone.open()
    for tenant in ("acme", "acme", "globex"):
        await gone.submit("gone_type", {}, tenant_id=tenant)
    found = await gone.applications()
    assert [(u.job_type, u.pending) for u in found.unserved] == [("gone_type", 3)]
    mine = await gone.applications(tenants=["acme"])
    assert [(u.job_type, u.pending) for u in mine.unserved] == [("gone_type", 2)]
    assert [
        (u.job_type, u.pending) for u in (await gone.applications(tenants=["x"])).unserved
    ] == []
    app = next(a for a in found.applications if a.name == "gone")
    assert not app.live and "gone_type" in app.job_types
    # A live API server of the application runs no in-process type: still unserved, and due.
    server = await gone.stores.dispatches.register_worker(prune_after=30)
    await gone.stores.config_versions.record(
        server, worker="s", config=gone.live_config, application="gone", runs="external"
    )
    (still,) = (await gone.applications()).unserved
    assert (still.job_type, still.due, still.queues) == ("gone_type", 3, ["gone_type"])
    # A live worker of the application: they are served again.
    worker = await gone.stores.dispatches.register_worker(prune_after=30)
    await gone.stores.config_versions.record(
        worker, worker="w", config=gone.live_config, application="gone", runs="jobs"
    )
    found = await gone.applications()
    assert found.unserved == []
    assert next(a for a in found.applications if a.name == "gone").live


async def test_the_operator_sees_a_refusal_between_live_applications_and_the_unserved_jobs(
    make_orc: Callable[..., Orchestrator], dsn: str
) -> None:
    """The exporter's series behind OrchestratorApplicationsDisagree and
    OrchestratorJobsUnserved, and the command line (`applications`, `status` without a job
    id), read from the database's record of a refusal and of the live processes."""

    async def run(ctx: JobContext, payload: Any) -> None:
        return None

    gone = make_orc(application="gone")
    gone.job_type("gone_type")(run)
    await gone.migrate()
    await gone.open()
    await gone.submit("gone_type", {})
    flow = gone.stores.flow
    await flow.sync(config(LLM_1), A)
    with pytest.raises(ApplicationConflict):
        await flow.sync(config(LLM_5), B)
    fleet = FleetMetrics(gone.stores.fleet, zombie_threshold=300, max_tenants=10, min_interval=0)

    def series(families: list[Any], name: str) -> list[tuple[dict[str, str], float]]:
        return [(s.labels, s.value) for f in families for s in f.samples if s.name == name]

    families = await fleet.families()
    assert series(families, "orchestrator_application_conflicts") == []  # neither is live
    assert series(families, "orchestrator_jobs_unserved") == [({"job_type": "gone_type"}, 1)]
    for application in ("agents", "billing"):
        worker = await gone.stores.dispatches.register_worker(prune_after=30)
        await gone.stores.config_versions.record(
            worker, worker=application, config=gone.live_config, application=application,
            runs="jobs",
        )  # fmt: skip
    families = await fleet.families()
    assert series(families, "orchestrator_application_conflicts") == [
        ({"application": "billing", "other": "agents", "kind": "limit", "name": "llm"}, 1)
    ]
    for argv in (["applications"], ["status"]):
        done = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "orchestrator", *argv], capture_output=True,
            text=True, cwd=ROOT, timeout=60, env={**os.environ, "DATABASE_URL": dsn},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert "billing: 1 live process(es), config " + gone.retry_config.version in lines
        assert (
            "  REFUSED limit 'llm': application 'agents' defines it otherwise (concurrency 5 "
            "here, 1 there)" in lines
        ), lines
        assert (
            "UNSERVED gone_type: 1 pending, 0 to retry, 1 due (queue gone_type); no live worker "
            "runs this type (they wait for one)" in lines
        ), lines


async def test_an_application_gone_for_good_is_forgotten_not_while_it_lives(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any], dsn: str
) -> None:
    """`orchestrator applications forget NAME`: the application's declarations go, with the
    shared rows no other application declares and its refusals; refused while it lives, or for
    a name no application could have."""
    await orc.stores.flow.sync(config(LLM_1 + OTHER), B)
    await orc.stores.flow.sync(config(LLM_1), A)  # shares llm
    with pytest.raises(ApplicationConflict):
        await orc.stores.flow.sync(config(LLM_5), Application("relay"))
    await orc.stores.schedules.sync(B, [define("hourly", "sweep", source="t", cron="0 * * * *")])
    worker = await orc.stores.dispatches.register_worker(prune_after=30)
    await orc.stores.config_versions.record(
        worker, worker="host/w1", config=orc.live_config, application="billing", runs="jobs"
    )

    def forget(name: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "orchestrator", "applications", "forget", name],
            capture_output=True, text=True, cwd=ROOT, timeout=60,
            env={**os.environ, "DATABASE_URL": dsn},
        )  # fmt: skip

    live = await asyncio.to_thread(forget, "billing")
    assert live.returncode == 2 and "Traceback" not in live.stderr, live.stderr
    assert "application 'billing' has 1 live process(es) (host/w1)" in live.stderr
    assert await limits(db) == {"llm": (1, None), "other": (None, 10)}
    bad = await asyncio.to_thread(forget, "Billing Service")
    assert bad.returncode == 2 and "is not an application's name" in bad.stderr, bad.stderr
    await db.execute("DELETE FROM procrastinate_workers")
    done = await asyncio.to_thread(forget, "billing")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("forgot application 'billing': ")
    assert await limits(db) == {"llm": (1, None)}  # A still declares it
    cur = await db.execute("SELECT count(*) FROM orc_schedules")
    assert await cur.fetchone() == (0,)
    assert await declared(db, "limit") == {("agents", "llm")}
    # The refused application's refusal goes with it when it is forgotten.
    assert (await asyncio.to_thread(forget, "relay")).returncode == 0
    cur = await db.execute("SELECT count(*) FROM orc_application_conflicts")
    assert await cur.fetchone() == (0,)
