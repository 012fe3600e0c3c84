"""The events table of docs/contracts.md, held to real events: one run that makes every kind,
through a worker in this process and the maintenance services, on real PostgreSQL."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import httpx
import psycopg
import pytest

from orchestrator import JobContext, Orchestrator, Status
from tests.support import agent_app, graph_app, log_guard, scripted
from tests.support.external import MessageService, message_service
from tests.support.harness import ROOT, WorkerRun, config_with, wait_for
from tests.support.refusals import refusing_writes_to

CONTRACTS = (ROOT / "docs" / "contracts.md").read_text()
#: Keys a kind has only sometimes (the table says which).
SOMETIMES = {"job.degraded": {"fallback", "content", "escalation_job_id"}}
RELEASE: dict[UUID, asyncio.Event] = {}


def documented() -> dict[str, set[str]]:
    """Kind -> keys, from the events table of docs/contracts.md."""
    table = CONTRACTS[
        CONTRACTS.index("| Kind | Payload keys |") : CONTRACTS.index("- The counters")
    ]
    kinds = {}
    for row in table.splitlines()[2:]:
        cells = row.split("|")
        if len(cells) < 3:
            continue
        keys = set(re.findall(r"`([a-z_]+)`", cells[2]))
        for kind in re.findall(r"`(job\.[a-z_]+)`", cells[1]):
            kinds[kind] = keys
    return kinds


@pytest.fixture
def service() -> Iterator[MessageService]:
    with message_service() as svc:
        yield svc


async def status_is(orc: Orchestrator, job_id: UUID, status: Status) -> None:
    async def there() -> bool:
        return (await orc.get_job(job_id)).status is status

    await wait_for(there)


CAPPED = """
[limits.one]
key = "one"
concurrency = 1

[job_types.capped]
limit = "one"
"""


@log_guard.fails_jobs("APPROVAL_EXPIRED", "HTTP_400")
@pytest.mark.logs_errors(r"sweep_zombies: job \S+ could not be handled, .*: refused by the test")
async def test_every_event_kind_has_the_documented_keys(
    make_orc: Callable[..., Orchestrator],
    db: psycopg.AsyncConnection[Any],
    service: MessageService,
) -> None:
    orc = make_orc(
        retry_config=config_with(scripted.TABLE, agent_app.TABLE, graph_app.TABLE, CAPPED),
        heartbeat_interval=60,  # none in the test's time: a heartbeat set back stays stale
        drain_seconds=0.2,
        safety_net_grace_seconds=0,
        graphile_compat=True,  # Graphile Worker's reschedule_jobs (docs/graphile.md)
    )
    scripted.register(orc)
    agent_app.register(orc)
    graph_app.register(orc)

    @orc.job_type("hang")
    async def hang(ctx: JobContext, payload: None) -> None:
        await RELEASE.setdefault(ctx.job_id, asyncio.Event()).wait()

    @orc.job_type("capped")  # one at a time (CAPPED): the second waits for capacity
    async def capped(ctx: JobContext, payload: None) -> None:
        await RELEASE.setdefault(ctx.job_id, asyncio.Event()).wait()

    @orc.job_type("fall_back")
    async def fall_back(ctx: JobContext, payload: None) -> None:
        # what tasks/llm.py writes when a model is overloaded (its end-to-end tests:
        # tests/test_job_types.py); here, only the event's keys
        request = httpx.Request("POST", "http://127.0.0.1/v1/messages")
        overloaded = httpx.HTTPStatusError(
            "overloaded", request=request, response=httpx.Response(529, request=request)
        )
        await ctx.record_model_fallback("a", "b", ctx.classify(overloaded), step=None)

    later = datetime.now(UTC) + timedelta(hours=1)
    async with orc:
        # a waiting job whose dispatch is lost: the safety net gives it a new one
        lost = await orc.submit("scripted", {"script": ["ok"]}, run_at=later)
        await db.execute(
            "UPDATE orc_jobs SET run_at = now() - interval '1 minute' WHERE id = %s", (lost,)
        )
        await db.execute(
            "DELETE FROM procrastinate_jobs WHERE args ->> 'job_id' = %s", (str(lost),)
        )
        assert (await orc.maintenance.safety_net.run_once()).redispatched == 1
        # keyed submits: replaced while waiting, then cancelled
        keyed = await orc.submit("scripted", {"script": ["ok"]}, job_key="k", run_at=later)
        await orc.submit("scripted", {"script": ["ok"]}, job_key="k", run_at=later)
        await orc.cancel(keyed, reason="not needed", by="test")
        # a producer reschedules a waiting job through Graphile Worker's API
        await orc.migrate()
        try:
            await db.execute(
                "SELECT graphile_worker.reschedule_jobs(ARRAY[(graphile_worker.add_job("
                "'scripted', '{\"script\": [\"ok\"]}', run_at => %s)).id], priority => 1)",
                (later,),
            )
        finally:
            await make_orc().migrate()  # the API removed again

    async with WorkerRun(orc) as worker:
        done = [
            await orc.submit("scripted", {"script": script})
            for script in (["ok"], ["app", "ok"], ["infra", "ok"], ["permanent"])
        ]
        done.append(await orc.submit("fall_back", None))
        done.append(await orc.submit("scripted", {"script": ["ok"]}, depends_on=done[:1]))
        done.append(await orc.submit("planner", {"topics": ["one"]}))  # spawns, waits, resumes
        gated = {"service": service.url, "approval_at": 1}
        approved, rejected = [await orc.submit("agent", gated) for _ in range(2)]
        expired = await orc.submit("agent", {**gated, "approval_expires_in": 0.2})
        for job_id in (approved, rejected, expired):
            await status_is(orc, job_id, Status.WAITING_APPROVAL)
        for job_id, decide in ((approved, orc.approve), (rejected, orc.reject)):
            [approval] = [a for a in await orc.approvals() if a["job_id"] == job_id]
            await decide(approval["id"], by="alice", reason="checked")
        await asyncio.sleep(0.3)
        assert (await orc.maintenance.approval_expiry.run_once()).expired == 1
        # under a limit of one: the second job waits for capacity, then runs
        one_at_a_time = [await orc.submit("capped", None) for _ in range(2)]

        async def parked() -> bool:
            return any([(await orc.get_job(j)).waiting_for for j in one_at_a_time])

        await wait_for(parked)
        for job_id in one_at_a_time:
            RELEASE.setdefault(job_id, asyncio.Event()).set()
        await worker.until_finished(*one_at_a_time)
        # a running job gives its key to a new one; then it goes stale and is swept
        running = await orc.submit("hang", None, job_key="h")
        await status_is(orc, running, Status.RUNNING)
        await orc.submit("hang", None, job_key="h")

        await db.execute(
            "UPDATE orc_jobs SET heartbeat_at = now() - interval '1 hour' WHERE id = %s",
            (running,),
        )

        async def swept() -> bool:
            return (await orc.maintenance.sweep.run_once()).handled > 0

        await wait_for(swept, interval=0.2)
        await worker.until_finished(*done, approved, rejected)
        await db.execute(  # the infra retry's wait (e s), fast-forwarded
            "UPDATE procrastinate_jobs SET scheduled_at = now() WHERE status = 'todo'"
        )
        await worker.until_finished(*done)
        # the last running job is handed back by the drain
        interrupted = await orc.submit("hang", None)
        await status_is(orc, interrupted, Status.RUNNING)
    await status_is(orc, interrupted, Status.PENDING)
    # a zombie the database refuses to write: the sweep passes over it
    cur = await db.execute(
        "INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts, max_retries, "
        "trace_id, lease_token, attempt, heartbeat_at) VALUES (gen_random_uuid(), 'hang', "
        "'RUNNING', 'null', 'hang', 1, 1, 't', gen_random_uuid(), 1, now() - interval '1 hour') "
        "RETURNING id"
    )
    [refused] = await cur.fetchone() or ()
    async with refusing_writes_to(db, refused):
        assert (await orc.maintenance.sweep.run_once()).passed_over == 1

    expected = documented()
    cur = await db.execute("SELECT kind, payload FROM orc_job_events")
    seen: dict[str, list[set[str]]] = {}
    for kind, payload in await cur.fetchall():
        seen.setdefault(kind, []).append(set(payload))
    assert sorted(seen) == sorted(expected)  # every kind was made, and none other
    for kind, key_sets in seen.items():
        optional = SOMETIMES.get(kind, set())
        for keys in key_sets:
            assert expected[kind] - optional <= keys <= expected[kind], (kind, keys)
