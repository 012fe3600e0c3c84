"""Every LLM call a job makes is admitted in its flow key's window before it is sent
(docs/flow-control.md, "Every call admitted"): real PostgreSQL, real worker processes, the local
LLM server. A fleet of jobs of several calls each never spends more than the key allows in any
interval; a call whose room is far off parks its job, which gives its worker slot back and
resumes at that call, without repeating an earlier turn's side effects; a call whose room comes
soon waits for it in place, its room reserved, so a saturated key's calls hold their slots
waiting no longer than that."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import psycopg
import pytest

from demo import llm_server as llm
from orchestrator import Orchestrator
from tests.support import flow_app
from tests.support.external import MessageService, message_service
from tests.support.harness import WorkerRun, config_with, free_port, wait_for
from tests.support.workers import WorkerProcess

KEY = "sk-test-flow-calls-0123456789"
APP = "tests.support.flow_app:orc"
#: No job here is a zombie. On a loaded machine a worker's heartbeat can be seconds late (its
#: first LLM call imports the SDK on its event loop; its connections wait for a CPU): under the
#: workers' fast zombie threshold (1.5 s, for crash tests) a live job was swept and retried, a
#: retry these tests' jobs do not expect (they assert retry_count 0).
NOT_ZOMBIES = {"ORCHESTRATOR_HEARTBEAT_INTERVAL": "1", "ORCHESTRATOR_ZOMBIE_THRESHOLD": "60"}


@pytest.fixture
def server() -> Iterator[llm.LocalLLM]:
    with llm.serve(api_key=KEY, agent_steps=4) as running:
        yield running


@pytest.fixture
def service() -> Iterator[MessageService]:
    with message_service() as svc:
        yield svc


def workers(
    stack: contextlib.ExitStack, dsn: str, server: llm.LocalLLM, config: Any, *, count: int,
    concurrency: int, **env: Any,
) -> list[WorkerProcess]:  # fmt: skip
    settings = {
        "ORCHESTRATOR_RETRY_CONFIG": config, "ORCHESTRATOR_WORKER_CONCURRENCY": concurrency,
        "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": KEY, **NOT_ZOMBIES, **env,
    }  # fmt: skip
    return [stack.enter_context(WorkerProcess(dsn, APP, **settings)) for _ in range(count)]


async def spends(db: psycopg.AsyncConnection[Any], key: str) -> list[tuple[float, int, int]]:
    """The key's spend records: (at, requests, units), by time."""
    cur = await db.execute(
        "SELECT extract(epoch FROM at)::float8, requests, units FROM orc_flow_spends"
        " WHERE key = %s ORDER BY at",
        (key,),
    )
    return [(float(at), int(r), int(u)) for at, r, u in await cur.fetchall()]


def most_in_any_interval(records: list[tuple[float, int, int]], seconds: float) -> tuple[int, int]:
    """The most requests, and the most units, that fell in any interval of ``seconds``."""
    requests = units = 0
    for start, _, _ in records:
        inside = [(r, u) for at, r, u in records if start <= at < start + seconds]
        requests = max(requests, sum(r for r, _ in inside))
        units = max(units, sum(u for _, u in inside))
    return requests, units


async def test_a_fleet_of_agents_makes_no_more_calls_than_the_window_allows(
    dsn: str, make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any],
    server: llm.LocalLLM,
) -> None:  # fmt: skip
    """The reproduction: ten jobs of five calls each under requests = 10 and units = 200 per
    60 s. Before, only the claims were admitted: the 50 calls went at once. Now each call is
    admitted before it is sent: ten calls reach the server, the window's records hold ten
    requests, and the jobs, whose next call's room is a minute off, park. Their slots are free
    meanwhile: a job of another key runs to the end on the same workers."""
    config = flow_app.config("requests = 10\nunits = 200\ninterval_seconds = 60")
    orc = make_orc(retry_config=config)
    flow_app.register(orc)
    await orc.open()
    with contextlib.ExitStack() as stack:
        workers(stack, dsn, server, config, count=2, concurrency=5)
        ids = [await orc.submit("chat", {"model": "m", "tag": f"job{n}"}) for n in range(10)]

        async def all_parked() -> bool:
            jobs = [await orc.get_job(job_id) for job_id in ids]
            return all(j.waiting_for is not None and j.status.value == "PENDING" for j in jobs)

        await wait_for(all_parked, timeout=30)
        other = await orc.submit("chat", {"model": "other", "calls": 2})

        async def other_done() -> bool:
            return (await orc.get_job(other)).status.value == "COMPLETED"

        await wait_for(other_done, timeout=30)  # every slot was free: all ten jobs parked
        assert server.requests["m"] == 10, server.requests
        records = await spends(db, "anthropic:m")
        assert len(records) == 10  # one request per call: the claim's was the first call's
        assert most_in_any_interval(records, 60) <= (10, 200)
        [key] = await orc.flow_keys("anthropic:m")
        assert key.requests_used == 10 and key.units_used <= 200 and key.waiting == 10
        steps = 0
        for job_id in ids:
            job, events = await orc.get_job(job_id), await orc.job_events(job_id)
            assert "its requests per interval are spent" in (job.waiting_for or "") or (
                "in line behind" in (job.waiting_for or "")
            )
            assert job.attempt <= 1 and job.retry_count == 0  # parked: no budget spent
            kinds = [e.kind for e in events]
            steps += kinds.count("job.checkpointed")
            assert kinds[-1] == "job.waiting_for_capacity"  # at a call, or at its claim
        assert steps == 10  # each call's step kept: they resume at the next call


async def test_every_interval_of_a_fleet_s_run_holds_the_window(
    dsn: str, make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any],
    server: llm.LocalLLM,
) -> None:  # fmt: skip
    """The same fleet under requests = 10 and units = 200 per 2 s runs to the end: its 50 calls
    are each made once (a parked job resumes at its call), and in no interval of 2 s did the
    key's spends, sampled from the database all along, hold more than 10 requests or 200
    units."""
    config = flow_app.config("requests = 10\nunits = 200\ninterval_seconds = 2")
    orc = make_orc(retry_config=config)
    flow_app.register(orc)
    await orc.open()
    seen: dict[int, tuple[float, int, int]] = {}  # spend id -> its latest (at, requests, units)
    with contextlib.ExitStack() as stack:
        workers(stack, dsn, server, config, count=2, concurrency=5)
        ids = [await orc.submit("chat", {"model": "m", "tag": f"job{n}"}) for n in range(10)]

        async def finished() -> bool:
            cur = await db.execute(
                "SELECT id, extract(epoch FROM at)::float8, requests, units FROM orc_flow_spends"
                " WHERE key = 'anthropic:m'"
            )
            for spend_id, at, requests, units in await cur.fetchall():
                seen[spend_id] = (float(at), int(requests), int(units))
            cur = await db.execute(
                "SELECT count(*) FROM orc_jobs WHERE id = ANY(%s) AND finished_at IS NULL", (ids,)
            )
            row = await cur.fetchone()
            return row is not None and row[0] == 0

        await wait_for(finished, timeout=90, interval=0.05)
    for job_id in ids:
        job = await orc.get_job(job_id)
        assert (job.status.value, job.result, job.retry_count) == ("COMPLETED", 5, 0)
    assert server.requests["m"] == 50  # each call once
    records = sorted(seen.values())
    assert sum(r for _, r, _ in records) == 50  # a request per call, none counted twice
    assert most_in_any_interval(records, 2.0) <= (10, 200), records


def waited_in_place(ports: list[int]) -> float:
    """Seconds the workers' calls waited in place, holding their slots (their metric, summed)."""
    total = 0.0
    for port in ports:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        for value in re.findall(
            r"^orchestrator_flow_call_wait_seconds_total\{[^}]*\} (\S+)$", text, re.MULTILINE
        ):
            total += float(value)
    return total


async def test_calls_on_a_saturated_key_hold_their_slots_waiting_only_for_a_room_reserved(
    dsn: str, make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any],
    server: llm.LocalLLM,
) -> None:  # fmt: skip
    """Ten jobs of four calls each on ten slots, under requests = 2 per second: every running
    job's next call finds its room within a second or two. Before, a call whose room came within
    2 s waited for it in place without reserving it: every running job found the same room,
    waited, lost it to another and tried again until its 2 s were spent, then parked (about
    0.8 s of slot held per call here, the first calls after a claim included, which wait for
    nothing). Now the room a call waits for is reserved for it at its instant, under the key's
    lock, and only a room that comes within the bound (0.25 s) is waited for: the calls
    decided after it meet it taken and park at once. So the slots held waiting come to less
    than the bound per call (most calls wait for nothing), every call is made once, and no
    interval of a second holds more than two of them (spends placed ahead of now included)."""
    config = flow_app.config("requests = 2\ninterval_seconds = 1")
    orc = make_orc(retry_config=config)
    flow_app.register(orc)
    await orc.open()
    ports = [free_port() for _ in range(2)]
    seen: dict[int, tuple[float, int, int]] = {}  # spend id -> its latest (at, requests, units)
    with contextlib.ExitStack() as stack:
        for port in ports:
            workers(stack, dsn, server, config, count=1, concurrency=5,
                    ORCHESTRATOR_HEALTH_PORT=port)  # fmt: skip
        ids = [
            await orc.submit("chat", {"model": "m", "calls": 4, "tag": f"job{n}"})
            for n in range(10)
        ]

        async def finished() -> bool:
            cur = await db.execute(
                "SELECT id, extract(epoch FROM at)::float8, requests, units FROM orc_flow_spends"
                " WHERE key = 'anthropic:m'"
            )
            for spend_id, at, requests, units in await cur.fetchall():
                seen[spend_id] = (float(at), int(requests), int(units))
            cur = await db.execute(
                "SELECT count(*) FROM orc_jobs WHERE id = ANY(%s) AND finished_at IS NULL", (ids,)
            )
            row = await cur.fetchone()
            return row is not None and row[0] == 0

        await wait_for(finished, timeout=120, interval=0.05)
        waited = waited_in_place(ports)
    for job_id in ids:
        job = await orc.get_job(job_id)
        assert (job.status.value, job.result, job.retry_count) == ("COMPLETED", 4, 0)
    calls = server.requests["m"]
    assert calls == 40  # each call once
    assert waited <= calls * 0.25, (waited, calls)
    records = sorted(seen.values())
    assert most_in_any_interval(records, 1.0)[0] <= 2, records


GATED = """
[limits.gated]
key = "gated"
requests = 1
interval_seconds = 10

[job_types.gated]
limit = "gated"
"""


async def test_a_call_waiting_for_its_room_does_not_go_through_a_pause_begun_meanwhile(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    """A call whose room comes soon is admitted for that instant and goes then without asking
    for room again; but a pause begun while it waited (a provider's 429, an operator) holds
    it: at its instant it finds the key paused, gives its room back and parks its job, which
    resumes after the pause. Its call is made once, after the pause's end."""
    orc = make_orc(retry_config=config_with(GATED))
    gate = asyncio.Event()
    sent: list[float] = []  # when each call was let through, epoch seconds

    @orc.job_type("gated")
    async def gated(ctx: Any, payload: None) -> None:
        await gate.wait()
        await ctx.admit_call(units=1)
        sent.append(time.time())

    await orc.open()
    job_id = await orc.submit("gated", None)
    async with WorkerRun(orc, concurrency=1) as run:

        async def running() -> bool:
            return (await orc.get_job(job_id)).status.value == "RUNNING"

        await wait_for(running, timeout=30)
        # Another spend fills the window until 0.2 s from now: the call's room comes then.
        await db.execute(
            "INSERT INTO orc_flow_spends (key, requests, units, at)"
            " VALUES ('gated', 1, 1, clock_timestamp() - interval '9.8 seconds')"
        )
        await db.execute("UPDATE orc_flow_keys SET window_requests = window_requests + 1")
        gate.set()

        async def admitted_ahead() -> bool:
            cur = await db.execute(
                "SELECT count(*) FROM orc_flow_spends"
                " WHERE key = 'gated' AND at > clock_timestamp()"
            )
            return await cur.fetchone() == (1,)

        await wait_for(admitted_ahead, timeout=30, interval=0.005)
        key = await orc.pause_flow_key("gated", seconds=1, reason="a 429", by="test")
        await run.until_finished(job_id, timeout=30)
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    assert (job.status.value, job.retry_count) == ("COMPLETED", 0)
    waits = [e.payload["waiting_on"] for e in events if e.kind == "job.waiting_for_capacity"]
    assert waits == ["paused"], [(e.kind, e.payload) for e in events]
    assert key.paused_until is not None
    assert len(sent) == 1 and sent[0] >= key.paused_until.timestamp(), (sent, key)


async def test_a_parked_agent_frees_its_slot_and_resumes_at_its_call(
    dsn: str, make_orc: Callable[..., Orchestrator], server: llm.LocalLLM,
    service: MessageService,
) -> None:  # fmt: skip
    """An agent of five turns (four tool calls that send a message, then its answer) under
    requests = 3 per 8 s, on a worker of one slot: its fourth call's room is seconds off, so
    it parks. The slot is free meanwhile: a job of another key, submitted then, runs to the end
    before the agent starts again. The agent resumes at its fourth call: each turn's call was
    made once, each message sent once."""
    config = flow_app.config("requests = 3\ninterval_seconds = 8")
    orc = make_orc(retry_config=config)
    flow_app.register(orc)
    await orc.open()
    with contextlib.ExitStack() as stack:
        workers(stack, dsn, server, config, count=1, concurrency=1,
                TEST_MESSAGE_SERVICE_URL=service.url)  # fmt: skip
        task = {"prompt": "tell the team", "model": "agent", "tools": ["send_message"]}
        agent = await orc.submit("run_agent", task)

        async def parked() -> bool:
            return (await orc.get_job(agent)).waiting_for is not None

        await wait_for(parked, timeout=30)
        assert server.requests["agent"] == 3
        other = await orc.submit("chat", {"model": "other", "calls": 1})

        async def done(job_id: Any) -> bool:
            return (await orc.get_job(job_id)).finished_at is not None

        await wait_for(lambda: done(other), timeout=30)
        await wait_for(lambda: done(agent), timeout=60)
    job, events = await orc.get_job(agent), await orc.job_events(agent)
    # (parked once at its fourth call; once more at its fifth only on a machine so slow that
    # its first turns were over 2 s apart)
    waits = [e.payload["waiting_on"] for e in events if e.kind == "job.waiting_for_capacity"]
    assert waits and set(waits) == {"requests"}, [(e.kind, e.payload) for e in events]
    assert (job.status.value, job.retry_count, job.attempt) == ("COMPLETED", 0, 1 + len(waits))
    assert job.result is not None and job.result["steps"] == 5
    assert server.requests["agent"] == 5  # each turn's call once
    assert sorted(service.deliveries.values()) == [1, 1, 1, 1]  # each message sent once
    resumed = [e.at for e in events if e.kind == "job.running"][1]
    finished = (await orc.get_job(other)).finished_at
    assert finished is not None and finished < resumed  # it ran in the agent's slot
