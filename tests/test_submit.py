"""Submitting jobs: early rejection, transactional submit, batches, and Graphile's job keys."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import RFC_4122, UUID

import psycopg
import pytest
from pydantic import BaseModel

import tasks
from orchestrator import (
    InvalidPayload,
    JobContext,
    Orchestrator,
    Status,
    SubmitError,
    UnknownJobType,
)
from orchestrator.domain.ids import uuid7


class Greeting(BaseModel):
    name: str
    times: int = 1


def app(make_orc: Callable[..., Orchestrator]) -> Orchestrator:
    orc = make_orc()

    @orc.job_type("greet")
    async def greet(ctx: JobContext, payload: Greeting) -> str:
        return f"hello {payload.name}" * payload.times

    return orc


async def count(db: psycopg.AsyncConnection[Any], table: str) -> int:
    cur = await db.execute(f"SELECT count(*) FROM {table}")
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def nothing_stored(db: psycopg.AsyncConnection[Any]) -> bool:
    return (
        await count(db, "orc_jobs") == 0
        and await count(db, "procrastinate_jobs") == 0
        and await count(db, "orc_job_events") == 0
    )


async def procrastinate_jobs(db: psycopg.AsyncConnection[Any]) -> list[tuple[Any, ...]]:
    cur = await db.execute(
        "SELECT id, status, task_name, queue_name, priority, lock, args, scheduled_at "
        "FROM procrastinate_jobs ORDER BY id"
    )
    return await cur.fetchall()


async def test_submit_creates_a_pending_job_and_its_dispatch(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    async with app(make_orc) as orc:
        job_id = await orc.submit("greet", Greeting(name="ada"), agent_id="agent-7", priority=5)
        job = await orc.get_job(job_id)
        history = await orc.job_events(job_id)
    assert job.status is Status.PENDING
    assert (job.payload, job.agent_id, job.priority) == ({"name": "ada", "times": 1}, "agent-7", 5)
    assert (job.attempt, job.retry_count, job.max_retries, job.max_attempts) == (0, 0, 3, 2)
    assert job.trace_id
    [pj] = await procrastinate_jobs(db)
    assert job.procrastinate_job_id == pj[0]
    # status, task, queue, priority (Graphile: lower runs first), lock on the job, args
    assert pj[1:7] == ("todo", "orc.greet", "greet", -5, str(job_id), {"job_id": str(job_id)})
    assert pj[7] is None  # due now
    assert [e.kind for e in history] == ["job.created"]


async def test_run_at_in_the_future_schedules_the_dispatch(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    run_at = datetime.now(UTC) + timedelta(hours=1)
    async with app(make_orc) as orc:
        job_id = await orc.submit("greet", {"name": "b"}, run_at=run_at)
        assert (await orc.get_job(job_id)).run_at == run_at
    [pj] = await procrastinate_jobs(db)
    assert pj[7] == run_at


@pytest.mark.parametrize("job_key", [None, "k"], ids=["keyless", "keyed"])
async def test_job_created_records_the_options_the_job_was_submitted_with(
    make_orc: Callable[..., Orchestrator], job_key: str | None
) -> None:
    run_at = datetime.now(UTC) + timedelta(minutes=5)
    async with app(make_orc) as orc:
        job_id = await orc.submit(
            "greet", {"name": "c"}, run_at=run_at, max_retries=7, job_key=job_key, trace_id="t-1",
            tenant_id="acme",
        )  # fmt: skip
        [created] = await orc.job_events(job_id)
    assert created.kind == "job.created"
    payload = dict(created.payload)
    assert datetime.fromisoformat(payload.pop("run_at")) == run_at
    assert payload == {
        "job_type": "greet", "queue": "greet", "max_runs": 2, "max_retries": 7,
        "job_key": job_key, "trace_id": "t-1", "tenant_id": "acme",
    }  # fmt: skip


@pytest.mark.parametrize("job_key", [None, "k"], ids=["keyless", "keyed"])
async def test_a_submit_for_later_tells_waiting_workers_when(
    make_orc: Callable[..., Orchestrator], dsn: str, job_key: str | None
) -> None:
    # Workers sleep until the soonest due time they know of; orc_wakeup carries it (epoch).
    soon, later = (datetime.now(UTC) + timedelta(hours=h) for h in (1, 2))
    async with (
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as listener,
        app(make_orc) as orc,
    ):
        await listener.execute("LISTEN orc_wakeup")
        await orc.submit_many(
            [
                {"job_type": "greet", "payload": {"name": "now"}},
                {
                    "job_type": "greet",
                    "payload": {"name": "b"},
                    "run_at": later,
                    "job_key": job_key,
                },
                {"job_type": "greet", "payload": {"name": "a"}, "run_at": soon},
            ]
        )
        heard = [float(n.payload) async for n in listener.notifies(timeout=1.0)]
    assert min(heard) == pytest.approx(soon.timestamp())  # a keyed job may add its own


@pytest.mark.parametrize(
    ("job_type", "payload", "options", "error", "fragment"),
    [
        ("nope", {"name": "x"}, {}, UnknownJobType, "unknown job type 'nope'; registered types: greet"),
        ("greet", {"nom": "x"}, {}, InvalidPayload, "name: Field required"),
        ("greet", {"name": "x", "times": "many"}, {}, InvalidPayload, "times: Input should be a valid integer"),
        ("greet", "just a string", {}, InvalidPayload, "invalid payload for job type 'greet'"),
        ("greet", {"name": "x"}, {"run_at": datetime(2030, 1, 1)}, SubmitError, "run_at"),
        ("greet", {"name": "x"}, {"max_retries": -1}, SubmitError, "max_retries"),
        ("greet", {"name": "x"}, {"job_key_mode": "merge"}, SubmitError, "job_key_mode"),
        ("greet", {"name": "x"}, {"timeout_seconds": 0}, SubmitError, "timeout_seconds"),
        ("greet", {"name": "x"}, {"priority": 2**40}, SubmitError, "priority"),
    ],
)  # fmt: skip
async def test_bad_submits_are_refused_before_anything_is_stored(
    make_orc: Callable[..., Orchestrator],
    db: psycopg.AsyncConnection[Any],
    job_type: str,
    payload: Any,
    options: dict[str, Any],
    error: type[Exception],
    fragment: str,
) -> None:
    async with app(make_orc) as orc:
        with pytest.raises(error) as info:
            await orc.submit(job_type, payload, **options)
    assert fragment in str(info.value)
    assert await nothing_stored(db)


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("payload", "options", "error", "fragment"),
    [
        ({"a": {"b": float("nan")}}, {}, InvalidPayload, "payload.a.b: nan is not a number JSON can hold"),
        ({"a": [1, float("inf")]}, {}, InvalidPayload, "payload.a[1]: inf is not a number"),
        ({"text": "x\x00y"}, {}, InvalidPayload, "payload.text: text with a NUL character"),
        ({"k\x00": 1}, {}, InvalidPayload, "payload (a key): text with a NUL character"),
        ({"text": "\ud800"}, {}, InvalidPayload, "payload.text: text with a lone surrogate"),
        (nested(101), {}, InvalidPayload, "payload: nested more than 100 levels deep"),
        (nested(400), {}, InvalidPayload, "payload: nested more than 100 levels deep"),
        ({"blob": "x" * 400}, {}, InvalidPayload, "over the limit of 300 (ORCHESTRATOR_MAX_PAYLOAD_BYTES)"),
        ({}, {"job_key": "k\x00"}, SubmitError, "job_key: Value error, text with a NUL character"),
        ({}, {"agent_id": "a\x00"}, SubmitError, "agent_id: Value error, text with a NUL"),
        ({}, {"tenant_id": "t\x00"}, SubmitError, "tenant_id: Value error, text with a NUL"),
        ({}, {"tenant_id": ""}, SubmitError, "tenant_id: Value error, a tenant cannot be empty"),
        ({}, {"tenant_id": " \t"}, SubmitError, "tenant_id: Value error, a tenant cannot be only whitespace"),
        ({}, {"tenant_id": "t" * 201}, SubmitError, "tenant_id: Value error, a tenant has at most 200 characters"),
        ({}, {"max_retries": 2**31}, SubmitError, "max_retries: Input should be less than or equal to 2147483647"),
        ({}, {"timeout_seconds": 2**40}, SubmitError, "timeout_seconds: Input should be less than or equal"),
    ],
    ids=lambda v: str(v)[:24],
)  # fmt: skip
async def test_what_json_or_a_column_cannot_hold_is_refused_naming_the_field(
    make_orc: Callable[..., Orchestrator],
    db: psycopg.AsyncConnection[Any],
    payload: Any,
    options: dict[str, Any],
    error: type[Exception],
    fragment: str,
) -> None:
    orc = make_orc(max_payload_bytes=300)

    @orc.job_type("anything")
    async def anything(ctx: JobContext, payload: Any) -> None:
        return None

    async with orc:
        with pytest.raises(error) as info:
            await orc.submit("anything", payload, **options)
        assert fragment in str(info.value)
        await orc.submit("anything", nested(99))  # as deep as allowed: fine
    assert len(await procrastinate_jobs(db)) == 1


async def test_a_payload_exactly_at_the_limit_is_taken(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc = make_orc(max_payload_bytes=12)

    @orc.job_type("anything")
    async def anything(ctx: JobContext, payload: Any) -> None:
        return None

    async with orc:
        await orc.submit("anything", {"a": "1234"})  # {"a":"1234"}: 12 bytes
        with pytest.raises(InvalidPayload, match="13 bytes, over the limit of 12"):
            await orc.submit("anything", {"a": "12345"})


async def test_built_in_job_types_refuse_a_field_they_do_not_know(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = make_orc()
    tasks.register_all(orc)
    typos = [
        ("http_request", {"url": "http://127.0.0.1:9/", "metod": "POST"}, "metod"),
        ("llm_generate", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_token": 5}, "max_token"),
        ("send_notification", {"channel": "webhook", "url": "http://127.0.0.1:9/", "text": "t", "txt": "t"}, "txt"),
        ("execute_tool", {"tool": "http_fetch", "args": {"url": "http://127.0.0.1:9/"}, "timeout": 3}, "timeout"),
    ]  # fmt: skip
    async with orc:
        for job_type, payload, field in typos:
            with pytest.raises(InvalidPayload, match=rf"{field}: Extra inputs are not permitted"):
                await orc.submit(job_type, payload)
    assert await nothing_stored(db)


async def test_a_rolled_back_transactional_submit_leaves_nothing(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any], dsn: str
) -> None:
    async with app(make_orc) as orc:
        async with (
            await psycopg.AsyncConnection.connect(dsn) as conn,
            conn.transaction(force_rollback=True),
        ):
            await conn.execute("CREATE TEMP TABLE business (x int)")
            await orc.submit("greet", {"name": "x"}, connection=conn)
            await orc.submit_many(
                [{"job_type": "greet", "payload": {"name": "y"}}], connection=conn
            )
            assert await nothing_stored(db)  # not visible before commit either
        assert await nothing_stored(db)

        async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.transaction():
            job_id = await orc.submit("greet", {"name": "z"}, connection=conn)
        assert (await orc.get_job(job_id)).status is Status.PENDING
        assert len(await procrastinate_jobs(db)) == 1


async def test_batch_submit_keeps_order_and_rejects_the_whole_batch_early(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    async with app(make_orc) as orc:
        with pytest.raises(InvalidPayload):
            await orc.submit_many(
                [
                    {"job_type": "greet", "payload": {"name": "ok"}},
                    {"job_type": "greet", "payload": {}},
                ]
            )
        assert await nothing_stored(db)
        specs = [{"job_type": "greet", "payload": {"name": f"n{i}"}} for i in range(200)]
        ids = await orc.submit_many(specs)
        assert len(set(ids)) == 200
        for i in (0, 57, 199):
            assert (await orc.get_job(ids[i])).payload["name"] == f"n{i}"
        assert await orc.submit_many([]) == []
    rows = await procrastinate_jobs(db)
    assert sorted(r[5] for r in rows) == sorted(str(i) for i in ids)


async def test_job_key_replace_updates_the_waiting_job(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    later = datetime.now(UTC) + timedelta(minutes=5)
    async with app(make_orc) as orc:
        first = await orc.submit("greet", {"name": "a"}, job_key="k")
        second = await orc.submit("greet", {"name": "b"}, job_key="k", run_at=later)
        assert first == second
        job = await orc.get_job(first)
        assert (job.payload["name"], job.run_at) == ("b", later)
        assert [e.kind for e in await orc.job_events(first)] == ["job.created", "job.replaced"]
    rows = await procrastinate_jobs(db)
    assert len(rows) == 1 and rows[0][0] == job.procrastinate_job_id and rows[0][7] == later


async def test_job_key_preserve_run_at_keeps_the_schedule(
    make_orc: Callable[..., Orchestrator],
) -> None:
    first_run = datetime.now(UTC) + timedelta(minutes=1)
    async with app(make_orc) as orc:
        job_id = await orc.submit("greet", {"name": "a"}, job_key="k", run_at=first_run)
        same = await orc.submit(
            "greet", {"name": "b"}, job_key="k", job_key_mode="preserve_run_at",
            run_at=first_run + timedelta(hours=1),
        )  # fmt: skip
        job = await orc.get_job(job_id)
    assert same == job_id and job.payload["name"] == "b" and job.run_at == first_run


async def test_job_key_unsafe_dedupe_returns_the_live_job_unchanged(
    make_orc: Callable[..., Orchestrator],
) -> None:
    async with app(make_orc) as orc:
        job_id = await orc.submit("greet", {"name": "a"}, job_key="k")
        same = await orc.submit("greet", {"name": "b"}, job_key="k", job_key_mode="unsafe_dedupe")
        job = await orc.get_job(job_id)
    assert same == job_id and job.payload["name"] == "a"


async def test_job_key_of_a_running_job_is_revoked_and_a_new_job_created(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    async with app(make_orc) as orc:
        running = await orc.submit("greet", {"name": "a"}, job_key="k")
        await db.execute(
            "UPDATE orc_jobs SET status = 'RUNNING', lease_token = gen_random_uuid() WHERE id = %s",
            (running,),
        )
        fresh = await orc.submit("greet", {"name": "b"}, job_key="k")
        assert fresh != running
        assert (await orc.get_job(running)).job_key is None
        assert (await orc.get_job(fresh)).job_key == "k"
        revoked = (await orc.job_events(running))[-1]
        assert revoked.kind == "job.key_revoked" and revoked.payload["replaced_by"] == str(fresh)


async def test_job_key_of_a_finished_job_does_not_block_a_new_one(
    make_orc: Callable[..., Orchestrator],
) -> None:
    async with app(make_orc) as orc:
        old = await orc.submit("greet", {"name": "a"}, job_key="k")
        await orc.cancel(old, reason="test")
        new = await orc.submit("greet", {"name": "b"}, job_key="k")
        assert new != old
        assert (await orc.get_job(old)).job_key == "k"  # history keeps the key


async def test_a_keyed_jobs_revision_counts_every_later_submit_in_any_mode(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    async with app(make_orc) as orc:
        job_id = await orc.submit("greet", {"name": "a"}, job_key="k")
        assert (await orc.get_job(job_id)).revision == 0
        for n, mode in enumerate(["replace", "preserve_run_at", "unsafe_dedupe", "replace"], 1):
            assert (
                await orc.submit("greet", {"name": "b"}, job_key="k", job_key_mode=mode) == job_id
            )
            assert (await orc.get_job(job_id)).revision == n
        replaced = [
            e.payload["revision"] for e in await orc.job_events(job_id) if e.kind == "job.replaced"
        ]
        assert replaced == [1, 2, 4]  # unsafe_dedupe counts, and changes nothing else
        await db.execute(
            "UPDATE orc_jobs SET status = 'RUNNING', lease_token = gen_random_uuid() WHERE id = %s",
            (job_id,),
        )
        fresh = await orc.submit("greet", {"name": "c"}, job_key="k")  # took the key: a new job
        assert fresh != job_id and (await orc.get_job(fresh)).revision == 0
        assert (await orc.get_job(job_id)).revision == 4
        assert (await orc.get_job(await orc.submit("greet", {"name": "d"}))).revision == 0


async def test_a_uuid7_made_in_sql_is_made_as_pythons(db: psycopg.AsyncConnection[Any]) -> None:
    """A submit in Python names its jobs (orchestrator.domain.ids.uuid7), Graphile Worker's API
    and the failures no attempt held in SQL (orc_uuid7_v1): both RFC 9562 version 7, their
    millisecond times from one clock, so ids made one after the other sort in that order."""
    made = [uuid7()]
    for _ in range(3):
        cur = await db.execute("SELECT orc_uuid7_v1() FROM pg_sleep(0.003)")  # (sleep first)
        made.append(UUID(str((await cur.fetchone() or (None,))[0])))
        await asyncio.sleep(0.003)
        made.append(uuid7())
    assert {(u.version, u.variant) for u in made} == {(7, RFC_4122)}
    assert sorted(made) == made
    millis = [u.int >> 80 for u in made]
    assert abs(millis[1] - time.time() * 1000) < 5_000
