"""Flow control (docs/flow-control.md, migration 0029): fleet-wide limits per key, enforced at
the claim in the database. Real PostgreSQL, real workers (in process here; several worker
processes and the local LLM server's rate limit in the tests further down)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import psycopg
import pytest

from demo import llm_server as llm
from orchestrator import Orchestrator
from orchestrator.domain.errors import FlowKeyNotFound
from tests.support import flow_app
from tests.support.flow_keys import render_key
from tests.support.harness import ROOT, WorkerRun, run_safety_net, wait_for
from tests.support.workers import WorkerProcess


def flow_orc(make_orc: Callable[..., Orchestrator], **settings: Any) -> Orchestrator:
    orc = make_orc(retry_config=flow_app.CONFIG, **settings)
    flow_app.register(orc)
    return orc


async def running_of(db: psycopg.AsyncConnection[Any], key: str) -> int:
    cur = await db.execute(
        "SELECT count(*) FROM orc_jobs WHERE flow_key = %s AND status = 'RUNNING'", (key,)
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def test_a_key_never_runs_more_than_its_concurrency_and_waiting_jobs_say_why(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = flow_orc(make_orc)
    await orc.open()
    ids = [await orc.submit("hold", {"pool": "a", "seconds": 0.4}) for _ in range(6)]
    other = await orc.submit("hold", {"pool": "b", "seconds": 0.1})
    seen: list[int] = []
    async with WorkerRun(orc, concurrency=10) as run:

        async def sampled() -> bool:
            seen.append(await running_of(db, "hold:a"))
            waiting = [j for j in await orc.list_jobs(job_type="hold") if j.waiting_for]
            return bool(waiting) and max(seen) == 2

        await wait_for(sampled, timeout=10)
        waiting = [j for j in await orc.list_jobs(job_type="hold") if j.waiting_for]
        reasons = {j.waiting_for for j in waiting}
        # the first to wait waits for the limit; those after it, in line behind it
        assert "waiting for capacity on hold:a (its concurrency limit is reached)" in reasons
        assert reasons <= {
            "waiting for capacity on hold:a (its concurrency limit is reached)",
            "waiting for capacity on hold:a (in line behind other jobs of the key)",
        }
        assert all(j.attempt == 0 and j.status.value == "PENDING" for j in waiting)
        await run.until_finished(*ids, other, timeout=20)
    assert max(seen) == 2
    for job_id in ids:
        job = await orc.get_job(job_id)
        assert job.status.value == "COMPLETED" and job.attempt == 1 and job.waiting_for is None


async def running_times(orc: Orchestrator, job_ids: list[Any]) -> list[float]:
    """When each job's attempts were claimed (its job.running events), in epoch seconds."""
    times = []
    for job_id in job_ids:
        times += [e.at.timestamp() for e in await orc.job_events(job_id) if e.kind == "job.running"]
    return sorted(times)


async def test_a_key_starts_no_more_than_its_requests_in_any_window(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc = flow_orc(make_orc)
    await orc.open()
    ids = [await orc.submit("tick") for _ in range(13)]  # 5 per second: three windows
    async with WorkerRun(orc, concurrency=10) as run:
        await run.until_finished(*ids, timeout=20)
    starts = await running_times(orc, ids)
    assert len(starts) == 13  # one claim each: none was refused a start after its claim
    # (claims are stamped a moment after their admission: 10 ms of slack for the stamps)
    in_any_second = max(sum(1 for t in starts if s <= t < s + 0.99) for s in starts)
    assert in_any_second == 5, [round(t - starts[0], 4) for t in starts]
    assert starts[-1] - starts[0] >= 2.0  # the 11th start waited for the window to slide twice
    for job_id in ids:
        job = await orc.get_job(job_id)
        assert (job.attempt, job.retry_count, job.waiting_for) == (1, 0, None)


async def test_a_full_window_hands_out_its_next_capacity_ahead_of_time(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    """Once a key's window is full, its next waiters each get a dispatch for the instant its
    room frees (a spend's time + the interval, rounded up to 50 ms), a whole window's worth at
    once, so that they start when the room frees rather than one after another; the waiters
    whose room depends on spends not made yet wait for them. The workers' timer knows every
    time scheduled, not only the soonest that the pump announced."""
    orc = flow_orc(make_orc)
    await orc.open()
    ids = [await orc.submit("tick") for _ in range(12)]  # 5 per second
    ahead: list[tuple[datetime, datetime | None]] = []
    async with WorkerRun(orc, concurrency=10) as run:

        async def scheduled() -> bool:
            cur = await db.execute(
                "SELECT w.dispatched_at, p.scheduled_at FROM orc_flow_waiters AS w"
                " JOIN orc_jobs AS j ON j.id = w.job_id"
                " JOIN procrastinate_jobs AS p ON p.id = j.procrastinate_job_id"
                " WHERE w.key = 'tick' AND w.dispatched_at > now() ORDER BY 1"
            )
            ahead[:] = await cur.fetchall()
            return len(ahead) == 5

        await wait_for(scheduled, timeout=10)
        cur = await db.execute("SELECT at FROM orc_flow_spends WHERE key = 'tick' ORDER BY at")
        spends = [row[0].timestamp() for row in await cur.fetchall()]
        cur = await db.execute(
            "SELECT count(*) FROM orc_flow_waiters WHERE key = 'tick' AND dispatched_at IS NULL"
        )
        unscheduled = await cur.fetchone()
        due = await orc.stores.liveness.soonest_due(lookback=0.0)
        await run.until_finished(*ids, timeout=20)
    assert len(spends) == 5 and unscheduled == (2,)
    for (dispatched_at, scheduled_at), spent in zip(ahead, spends, strict=True):
        assert dispatched_at == scheduled_at  # the waiter's due time is its dispatch's
        assert dispatched_at.timestamp() == pytest.approx(math.ceil((spent + 1) * 20) / 20)
    assert due.seconds is not None and due.seconds <= 1.0  # not the poll, one second away
    starts = await running_times(orc, ids)
    assert max(sum(1 for t in starts if s <= t < s + 0.99) for s in starts) == 5


async def test_waiters_sent_ahead_each_start_at_their_own_time_in_line_order(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    """Waiters sent ahead for different instants do not hold each other back: at its time, a
    waiter counts as taken only the room of those due by then, not of those sent for later,
    so each starts in its turn (one counting them all would find no room and go back in line,
    behind the others)."""
    orc = flow_orc(make_orc)
    await orc.open()
    async with WorkerRun(orc, concurrency=10) as run:
        first = []
        for _ in range(5):  # the window's spends, 0.1 s apart
            first.append(await orc.submit("tick"))
            await run.until_finished(first[-1])
            await asyncio.sleep(0.1)
        later = [await orc.submit("tick") for _ in range(5)]  # sent ahead, as far apart
        await run.until_finished(*later, timeout=20)
    starts = [(await running_times(orc, [job_id]))[0] for job_id in later]
    assert starts == sorted(starts), [round(t - starts[0], 3) for t in starts]
    window = await running_times(orc, first)
    for k, job_id in enumerate(later):  # each in the room its predecessor's spend left
        assert window[k] + 1.0 - 0.02 <= starts[k]
        cur = await db.execute(
            "SELECT extract(epoch FROM p.scheduled_at),"
            " EXISTS (SELECT FROM orc_job_events AS e"
            "          WHERE e.job_id = j.id AND e.kind = 'job.waiting_for_capacity')"
            " FROM orc_jobs AS j JOIN procrastinate_jobs AS p ON p.id = j.procrastinate_job_id"
            " WHERE j.id = %s",
            (job_id,),
        )
        [(ran_on, waited)] = await cur.fetchall()
        if waited:  # (not when the first spends had slid out before it came: a slow machine)
            # it ran on the dispatch sent ahead for its room (a spend and its claim's event are
            # stamped a moment apart; the time is rounded up to 50 ms), not turned back at its
            # time and sent again
            assert ran_on is not None, f"waiter {k} was turned back and sent again for now"
            assert window[k] + 1.0 - 0.02 <= float(ran_on) <= window[k] + 1.0 + 0.07, k


async def test_each_admission_keeps_the_schedule_a_horizon_ahead(
    make_orc: Callable[..., Orchestrator],
) -> None:
    """Jobs that run longer than their key's interval release nothing for a while; the
    admission of a waiter sent ahead pumps the key, so the room of the next window is handed
    out then, not when the first job ends: the third window's jobs start before any job ends."""
    orc = flow_orc(make_orc)
    await orc.open()
    ids = [
        await orc.submit("late_call", {"sent_after": 0, "returned_after": 4}) for _ in range(12)
    ]  # 5 per second: three windows, each job running 4 s
    async with WorkerRun(orc, concurrency=20) as run:
        await run.until_finished(*ids, timeout=30)
    starts = await running_times(orc, ids)
    first_end = min([(await orc.get_job(job_id)).finished_at for job_id in ids])
    assert first_end is not None and len(starts) == 12
    assert starts[-1] < first_end.timestamp(), [round(t - starts[0], 2) for t in starts]


async def test_cancelled_jobs_give_their_capacity_back_and_leave_the_line(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = flow_orc(make_orc)
    await orc.open()
    long = [await orc.submit("hold", {"pool": "c", "seconds": 30}) for _ in range(2)]
    waiting = [await orc.submit("hold", {"pool": "c", "seconds": 0.1}) for _ in range(2)]
    async with WorkerRun(orc, concurrency=10) as run:

        async def parked() -> bool:
            jobs = [await orc.get_job(j) for j in waiting]
            return all(j.waiting_for for j in jobs) and await running_of(db, "hold:c") == 2

        await wait_for(parked)
        await orc.cancel(waiting[1], reason="not needed")  # it leaves the line
        cur = await db.execute("SELECT count(*) FROM orc_flow_waiters")
        assert await cur.fetchone() == (1,)
        await orc.cancel(long[0], reason="takes too long")  # its slot goes to the one waiting
        await run.until_finished(waiting[0], timeout=10)
        await orc.cancel(long[1], reason="done with the test")
        await run.until_finished(*long, timeout=10)
    assert (await orc.get_job(waiting[0])).status.value == "COMPLETED"
    assert (await orc.get_job(waiting[1])).status.value == "CANCELLED"


async def test_tenants_sharing_a_key_get_their_weighted_shares(
    make_orc: Callable[..., Orchestrator],
) -> None:
    """``weights = { heavy = 3 }``: while both wait, heavy starts three jobs for each of light's,
    though light's jobs were all submitted after heavy's."""
    orc = flow_orc(make_orc)
    await orc.open()
    heavy = [await orc.submit("fair", tenant_id="heavy") for _ in range(60)]
    light = [await orc.submit("fair", tenant_id="light") for _ in range(60)]
    async with WorkerRun(orc, concurrency=10) as run:
        await run.until_finished(*heavy, *light, timeout=60)
    starts = sorted(
        [(t, "heavy") for t in await running_times(orc, heavy)]
        + [(t, "light") for t in await running_times(orc, light)]
    )
    first_light = next(i for i, (_, who) in enumerate(starts) if who == "light")
    last_heavy = max(i for i, (_, who) in enumerate(starts) if who == "heavy")
    contended = [who for _, who in starts[first_light : last_heavy + 1]]
    share = contended.count("heavy") / len(contended)
    assert len(contended) > 40
    assert 0.75 * 0.9 <= share <= 0.75 * 1.1, (share, len(contended))


KEY = "sk-test-flow-0123456789"


@pytest.fixture
def model_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[llm.LocalLLM]:
    with llm.serve(api_key=KEY) as server:
        monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
        monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url)
        yield server


def ask(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 50}


async def test_a_429_with_a_hint_pauses_the_key_for_every_job_and_spends_no_budget(
    make_orc: Callable[..., Orchestrator], model_server: llm.LocalLLM
) -> None:
    model_server.script("m", [llm.Status(429, "rate_limit_error", retry_after="2"), llm.Text("ok")])
    model_server.script("other", [llm.Text("ok")])
    orc = flow_orc(make_orc)
    await orc.open()
    first = await orc.submit("llm_generate", ask("m"))
    async with WorkerRun(orc, concurrency=10) as run:

        async def paused() -> bool:
            keys = await orc.flow_keys("anthropic:m")
            return bool(keys) and keys[0].paused_until is not None

        await wait_for(paused)
        [key] = await orc.flow_keys("anthropic:m")
        assert key.paused_by == "provider" and key.throttled == 1
        assert key.pause_reason and "LLM_RATE_LIMITED" in key.pause_reason
        later = [await orc.submit("llm_generate", ask("m")) for _ in range(3)]
        elsewhere = await orc.submit("llm_generate", ask("other"))  # another key runs on
        await run.until_finished(elsewhere, timeout=5)
        for job_id in later:
            job = await orc.get_job(job_id)
            assert job.waiting_for is not None and job.waiting_for.startswith(
                "waiting for capacity on anthropic:m (paused until "
            )
            assert job.attempt == 0
        assert model_server.requests["m"] == 1  # nobody called the model while it was paused
        await run.until_finished(first, *later, timeout=15)
    assert model_server.requests["m"] == 5  # the first twice, each later one once
    job, events = await orc.get_job(first), await orc.job_events(first)
    assert (job.status.value, job.retry_count, job.attempt) == ("COMPLETED", 0, 2)
    [failed] = [e.payload for e in events if e.kind == "job.failed"]
    assert failed["layer"] == "pause" and failed["error"]["code"] == "LLM_RATE_LIMITED"
    for job_id in later:
        job = await orc.get_job(job_id)
        assert (job.status.value, job.attempt, job.retry_count) == ("COMPLETED", 1, 0)
    [key] = await orc.flow_keys("anthropic:m")
    assert key.waiting == 0 and key.running == 0


async def provider_pause(db: psycopg.AsyncConnection[Any], key: str, seconds: float) -> None:
    """The key paused by its provider (a 429's hint), as a worker's retry pauses it."""
    await db.execute("SELECT orc_flow_throttled_v2(%s, %s, 'overloaded_error')", (key, seconds))


async def test_a_job_that_can_fall_back_does_not_wait_out_a_long_pause_of_its_key(
    make_orc: Callable[..., Orchestrator], model_server: llm.LocalLLM,
    db: psycopg.AsyncConnection[Any],
) -> None:  # fmt: skip
    """While its key is paused by its provider for longer than the type's
    fallback_after_seconds, a job whose type names fallback models is let through the pause and
    calls the next model at once (a ``job.model_fallback`` event, reason ``key_paused``); the
    paused model is not called."""
    model_server.script("m", [llm.Text("ok")])
    model_server.script("m2", [llm.Text("from the fallback")])
    orc = make_orc(
        retry_config=flow_app.config(
            llm_generate='fallback_models = ["m2"]\nfallback_after_seconds = 5'
        )
    )
    flow_app.register(orc)
    await orc.open()
    async with WorkerRun(orc, concurrency=10) as run:
        await run.until_finished(await orc.submit("llm_generate", ask("m")))  # the key exists
        await provider_pause(db, "anthropic:m", 60)
        job_id = await orc.submit("llm_generate", ask("m"))
        await run.until_finished(job_id, timeout=15)
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    assert (job.status.value, job.attempt, job.retry_count) == ("COMPLETED", 1, 0)
    assert model_server.requests["m"] == 1 and model_server.requests["m2"] == 1
    assert "job.waiting_for_capacity" not in [e.kind for e in events]
    [moved] = [e.payload for e in events if e.kind == "job.model_fallback"]
    assert (moved["from"], moved["to"], moved["reason"]) == ("m", "m2", "key_paused")
    assert 50 < moved["retry_after"] <= 60


async def test_a_waiter_that_can_fall_back_is_handed_room_through_a_long_pause(
    make_orc: Callable[..., Orchestrator],
    model_server: llm.LocalLLM,
    db: psycopg.AsyncConnection[Any],
) -> None:
    """A job already waiting for room when its provider pauses its key: when room frees, the
    pump hands it on as its type meets the key (through a pause longer than its fallback
    threshold), not at the pause's end."""
    model_server.script("m", [llm.Text("slow answer", chunks=10, every=0.2)])
    model_server.script("m2", [llm.Text("from the fallback")])
    orc = make_orc(
        retry_config=flow_app.config(
            "concurrency = 1", llm_generate='fallback_models = ["m2"]\nfallback_after_seconds = 5'
        )
    )
    flow_app.register(orc)
    await orc.open()
    async with WorkerRun(orc, concurrency=10) as run:
        slow = await orc.submit("llm_generate", ask("m"))
        await wait_for(lambda: _running_one(db, "anthropic:m"))
        waiter = await orc.submit("llm_generate", ask("m"))
        await wait_for(lambda: _waits(orc, waiter))
        await provider_pause(db, "anthropic:m", 60)
        await run.until_finished(slow, waiter, timeout=15)
    assert model_server.requests["m"] == 1 and model_server.requests["m2"] == 1
    [moved] = [e.payload for e in await orc.job_events(waiter) if e.kind == "job.model_fallback"]
    assert moved["reason"] == "key_paused"


async def _running_one(db: psycopg.AsyncConnection[Any], key: str) -> bool:
    return await running_of(db, key) == 1


async def _waits(orc: Orchestrator, job_id: Any) -> bool:
    return (await orc.get_job(job_id)).waiting_for is not None


async def test_an_operator_pauses_a_key_and_lifts_the_pause(
    make_orc: Callable[..., Orchestrator], model_server: llm.LocalLLM
) -> None:
    orc = flow_orc(make_orc)
    await orc.open()
    warm = await orc.submit("llm_generate", ask("m"))  # the key exists once a job was claimed
    async with WorkerRun(orc, concurrency=10) as run:
        await run.until_finished(warm)
        key = await orc.pause_flow_key(
            "anthropic:m", seconds=600, reason="provider incident", by="ops"
        )
        assert key.paused_by == "ops" and key.pause_reason == "provider incident"
        held = [await orc.submit("llm_generate", ask("m")) for _ in range(2)]

        async def waiting() -> bool:
            return all([(await orc.get_job(j)).waiting_for for j in held])

        await wait_for(waiting)
        assert model_server.requests["m"] == 1
        lifted = await orc.resume_flow_key("anthropic:m")
        assert lifted.paused_until is None
        await run.until_finished(*held, timeout=5)  # woken by the resume, not a 10-minute wait
    with pytest.raises(FlowKeyNotFound):
        await orc.resume_flow_key("anthropic:nope")


async def test_a_429_without_a_hint_halves_the_key_s_rate_which_recovers_gradually(
    make_orc: Callable[..., Orchestrator],
    model_server: llm.LocalLLM,
    db: psycopg.AsyncConnection[Any],
) -> None:
    """The documented rule (docs/flow-control.md, "Adaptive rate"): each 429 or 529 without a
    hint halves the key's rate factor (down to 1/64), and it recovers by 0.1 per interval
    without one. The factor scales the key's concurrency, requests and units."""
    model_server.script("m", [llm.Status(429, "rate_limit_error"), llm.Text("ok")])
    orc = flow_orc(make_orc)
    await orc.open()
    job_id = await orc.submit("llm_generate", ask("m"))
    async with WorkerRun(orc, concurrency=10) as run:
        await run.until_finished(job_id)
    job = await orc.get_job(job_id)
    assert (job.status.value, job.retry_count) == ("COMPLETED", 1)  # no hint: a retry spent
    [key] = await orc.flow_keys("anthropic:m")
    assert key.paused_until is None and key.throttled == 1
    assert key.rate_factor is not None and 0.5 <= key.rate_factor < 0.51

    async def factor(intervals_ago: float, stored: float) -> float:
        await db.execute(
            "UPDATE orc_flow_keys SET rate_factor = %s,"
            " factor_at = now() - make_interval(secs => 60 * %s) WHERE key = 'anthropic:m'",
            (stored, intervals_ago),
        )
        [key] = await orc.flow_keys("anthropic:m")
        assert key.rate_factor is not None
        return key.rate_factor

    assert await factor(2.5, 0.5) == pytest.approx(0.75, abs=0.01)  # +0.1 per interval
    assert await factor(20, 0.5) == 1.0  # never above the limit
    for _ in range(8):  # halving stops at 1/64
        await db.execute("SELECT orc_flow_throttled_v1('anthropic:m', NULL, 'test')")
    assert await factor(0, 1 / 64) == pytest.approx(1 / 64, abs=0.001)
    cur = await db.execute("SELECT rate_factor FROM orc_flow_keys WHERE key = 'anthropic:m'")
    assert await cur.fetchone() == (1 / 64,)


async def test_a_slowed_key_runs_fewer_jobs_at_once(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = flow_orc(make_orc)
    await orc.open()
    warm = await orc.submit("hold", {"pool": "s", "seconds": 0.05})
    async with WorkerRun(orc, concurrency=10) as run:
        await run.until_finished(warm)
        await db.execute("SELECT orc_flow_throttled_v1('hold:s', NULL, 'test')")  # 2 -> 1
        ids = [await orc.submit("hold", {"pool": "s", "seconds": 0.2}) for _ in range(4)]
        seen: list[int] = []

        async def done() -> bool:
            seen.append(await running_of(db, "hold:s"))
            return all([(await orc.get_job(j)).finished_at for j in ids])

        await wait_for(done, timeout=15)
    assert max(seen) == 1


async def test_the_safety_net_wakes_a_line_whose_wake_up_was_lost(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    """A line with waiters and none on its way, and free capacity (here: the dispatch sent for
    it deleted by hand), is woken by the next run of the retry safety net."""
    orc = flow_orc(make_orc)
    await orc.open()
    ids = [await orc.submit("hold", {"pool": "n", "seconds": 0.3}) for _ in range(3)]
    async with WorkerRun(orc, concurrency=10) as run:

        async def one_waits() -> bool:
            return bool([j for j in ids if (await orc.get_job(j)).waiting_for])

        await wait_for(one_waits)
        # lose the wake-up: the jobs that finish do not hand their capacity on
        await db.execute("ALTER TABLE orc_jobs DISABLE TRIGGER orc_jobs_flow_release")
        try:
            await wait_for(lambda: _running_none(db), timeout=10)
        finally:
            await db.execute("ALTER TABLE orc_jobs ENABLE TRIGGER orc_jobs_flow_release")
        [waiting] = [j for j in ids if (await orc.get_job(j)).waiting_for]
        assert (await orc.get_job(waiting)).finished_at is None
        assert await run_safety_net(orc) == 1
        await run.until_finished(*ids, timeout=10)


async def _running_none(db: psycopg.AsyncConnection[Any]) -> bool:
    return await running_of(db, "hold:n") == 0


# -- a rate-limit storm: worker processes against the local LLM server's limits -------------------

STORM_LIMIT = 4  # jobs of the key running at once, fleet-wide
#: Our allowance is a little above the server's, so that the server's 429s happen and pause.
STORM = flow_app.config(f"concurrency = {STORM_LIMIT}\nrequests = 14\ninterval_seconds = 2")


def cli(dsn: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "--app", "tests.support.flow_app:orc", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "DATABASE_URL": dsn, "ORCHESTRATOR_RETRY_CONFIG": str(STORM)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


async def test_a_storm_on_three_worker_processes_keeps_every_limit(
    dsn: str, make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    """Three worker processes, 60 jobs of two tenants on one key, the server allowing 12 requests
    per 2 s with 429 + Retry-After beyond. Sampled from the database all along, the key never runs
    more than its limit; the server's 429s pause the key for every worker until their hint; no
    waiting job spends an attempt or budget; the tenants get even shares; a worker killed
    mid-call gives its jobs' capacity back once they are swept; an operator's pause holds new
    jobs until it is lifted."""
    with llm.serve(
        api_key=KEY, requests_per_window=12, window_seconds=2.0
    ) as server, contextlib.ExitStack() as workers:  # fmt: skip
        server.script("storm", [llm.Text("a slow but steady answer", chunks=4, every=0.1)])
        env = {"ORCHESTRATOR_RETRY_CONFIG": STORM, "ANTHROPIC_BASE_URL": server.url,
               "ANTHROPIC_API_KEY": KEY}  # fmt: skip
        procs = [
            workers.enter_context(WorkerProcess(dsn, "tests.support.flow_app:orc", **env))
            for _ in range(3)
        ]
        orc = make_orc(retry_config=STORM)
        flow_app.register(orc)
        await orc.open()
        tenants = ["a"] * 30 + ["b"] * 30
        ids = [await orc.submit("llm_generate", ask("storm"), tenant_id=t) for t in tenants]
        seen: list[int] = []
        killed = False

        async def finished() -> bool:
            nonlocal killed
            seen.append(await running_of(db, "anthropic:storm"))
            if not killed and await _running_on(db, procs[0].pid):
                procs[0].process.kill()  # mid-call: its jobs are zombies until swept
                killed = True
            cur = await db.execute(
                "SELECT count(*) FROM orc_jobs WHERE id = ANY(%s) AND finished_at IS NULL", (ids,)
            )
            row = await cur.fetchone()
            return row is not None and row[0] == 0

        await wait_for(finished, timeout=90, interval=0.02)
        assert killed and max(seen) == STORM_LIMIT and len(seen) > 100
        assert server.rate_limited > 0  # the storm happened

        starts: list[tuple[float, str]] = []
        for job_id, tenant in zip(ids, tenants, strict=True):
            job, events = await orc.get_job(job_id), await orc.job_events(job_id)
            assert job.status.value == "COMPLETED"
            kinds = [e.kind for e in events]
            failed = [e.payload for e in events if e.kind == "job.failed"]
            if "job.zombie_detected" not in kinds:  # the killed worker's jobs were retried
                assert job.retry_count == 0 and all(f["layer"] == "pause" for f in failed)
                # a call whose room (or the key's pause) was more than 0.25 s off parked its
                # job, which ran again when handed room: an attempt more, no budget spent
                parked = sum(
                    1 for before, kind in itertools.pairwise(kinds)
                    if kind == "job.waiting_for_capacity"
                    and before not in ("job.created", "job.retry_scheduled")
                )  # fmt: skip
                assert job.attempt == 1 + len(failed) + parked, kinds  # waiting spent no budget
            starts += [(e.at.timestamp(), tenant) for e in events if e.kind == "job.running"]
            pauses = [e for e in events if e.kind == "job.failed" and e.payload["layer"] == "pause"]
            for pause in pauses:  # nobody started a job of the key while it was paused
                [until] = [
                    datetime.fromisoformat(e.payload["available_at"]).timestamp()
                    for e in events
                    if e.kind == "job.retry_scheduled" and e.id > pause.id
                ][:1]
                begun = pause.at.timestamp() + 0.2  # (a claim decided just before it)
                during = [t for t, _ in starts if begun < t < until - 0.05]
                assert during == [], (pause.payload["error"], during)
        starts.sort()
        first_b = next(i for i, (_, t) in enumerate(starts) if t == "b")
        last_a = max(i for i, (_, t) in enumerate(starts) if t == "a")
        contended = [t for _, t in starts[first_b : last_a + 1]]
        assert 0.45 <= contended.count("a") / len(contended) <= 0.55, contended

        # an operator pauses the key (the CLI), new jobs wait, the resume lets them go
        assert "PAUSED" in cli(dsn, "flow", "pause", "anthropic:storm", "--for", "10m")
        held = [await orc.submit("llm_generate", ask("storm"), tenant_id="a") for _ in range(3)]

        async def waiting() -> bool:
            return all([(await orc.get_job(j)).waiting_for for j in held])

        await wait_for(waiting, timeout=15)
        assert "anthropic:storm" in cli(dsn, "flow")
        cli(dsn, "flow", "resume", "anthropic:storm")
        await wait_for(lambda: _all_finished(orc, held), timeout=15)


async def _running_on(db: psycopg.AsyncConnection[Any], pid: int) -> bool:
    cur = await db.execute(
        "SELECT count(*) FROM orc_jobs WHERE status = 'RUNNING' AND locked_by LIKE %s",
        (f"%/{pid}/%",),
    )
    row = await cur.fetchone()
    return row is not None and row[0] > 0


async def _all_finished(orc: Orchestrator, ids: list[Any]) -> bool:
    return all([(await orc.get_job(j)).finished_at is not None for j in ids])


async def test_a_call_s_real_usage_reconciles_its_job_s_reservation(
    make_orc: Callable[..., Orchestrator],
    model_server: llm.LocalLLM,
    db: psycopg.AsyncConnection[Any],
) -> None:
    """A job is admitted on its estimate (its input at four characters a token + max_tokens);
    once its call returns, the window holds what the call used instead."""
    orc = make_orc(retry_config=flow_app.config("units = 100000\ninterval_seconds = 60"))
    flow_app.register(orc)
    await orc.open()
    job_id = await orc.submit("llm_generate", ask("m"))
    estimate = (await orc.get_job(job_id)).flow_cost
    assert estimate is not None and estimate > 50  # max_tokens 50, and the input
    async with WorkerRun(orc, concurrency=10) as run:
        await run.until_finished(job_id)
    usage = (await orc.get_job(job_id)).result["usage"]
    used = usage["input_tokens"] + usage["output_tokens"]
    cur = await db.execute(
        "SELECT units, reconciled FROM orc_flow_spends WHERE job_id = %s", (job_id,)
    )
    assert await cur.fetchall() == [(used, True)]
    assert used != estimate
    [key] = await orc.flow_keys("anthropic:m")
    assert (key.units_used, key.requests_used) == (used, 1)


async def test_a_call_s_spend_is_dated_from_when_it_was_sent_not_from_the_claim(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    """The provider counts a request when it arrives, so a job's spend in its key's window is
    dated from when its call was sent (``sent_at``), not from its claim: a call sent well after
    its claim (a worker's first, opening its connection) would otherwise leave our window
    before the provider's, and the next claims would meet its 429s."""
    orc = flow_orc(make_orc)
    await orc.open()
    job_id = await orc.submit("late_call", {"sent_after": 0.4, "returned_after": 0.7})
    async with WorkerRun(orc, concurrency=10) as run:
        await run.until_finished(job_id)
    cur = await db.execute(
        "SELECT s.at, s.reconciled, e.at, u.recorded_at FROM orc_flow_spends AS s"
        " JOIN orc_job_events AS e ON e.job_id = s.job_id AND e.kind = 'job.running'"
        " JOIN orc_llm_usage AS u ON u.job_id = s.job_id WHERE s.job_id = %s",
        (job_id,),
    )
    [(spent_at, reconciled, claimed_at, recorded_at)] = await cur.fetchall()
    assert reconciled
    assert (spent_at - claimed_at).total_seconds() >= 0.35  # not the claim's time
    assert (recorded_at - spent_at).total_seconds() >= 0.25  # nor the reply's


async def test_a_job_submitted_without_its_key_gets_it_at_its_claim(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    """A producer on another retry config (or a Graphile Worker producer writing SQL) submits
    without the flow: the workers' config in the database gives it its key at the claim, and the
    limit holds all the same."""
    producer = make_orc()  # the tests' base config: no limits
    flow_app.register(producer)
    await producer.open()
    ids = [await producer.submit("hold", {"pool": "p", "seconds": 0.3}) for _ in range(5)]
    assert {(await producer.get_job(j)).flow_key for j in ids} == {None}
    orc = flow_orc(make_orc)
    seen: list[int] = []
    async with WorkerRun(orc, concurrency=10) as run:

        async def done() -> bool:
            seen.append(await running_of(db, "hold:p"))
            return all([(await orc.get_job(j)).finished_at for j in ids])

        await wait_for(done, timeout=15)
        await run.until_finished(*ids)
    assert max(seen) == 2
    assert {(await orc.get_job(j)).flow_key for j in ids} == {"hold:p"}


@pytest.mark.parametrize(
    ("template", "payload", "tenant", "agent"),
    [
        ("anthropic:{payload.model}", {"model": "claude-x"}, None, None),
        ("{job_type}/{tenant}/{agent}", None, "acme", "a1"),
        ("{job_type}/{tenant}/{agent}", None, None, None),
        (
            "p:{payload.a.b}:{payload.n}:{payload.t}",
            {"a": {"b": "x"}, "n": 7, "t": True},
            "t",
            None,
        ),
        ("literal only", {"x": 1}, None, None),
    ],
)
async def test_the_database_renders_a_key_as_a_submit_does(
    db: psycopg.AsyncConnection[Any], template: str, payload: Any, tenant: Any, agent: Any
) -> None:
    expected = render_key(
        template, job_type="kind", tenant_id=tenant, agent_id=agent, payload=payload
    )
    cur = await db.execute(
        "SELECT orc_flow_render_v1(%s, jsonb_populate_record(NULL::orc_jobs, jsonb_build_object("
        "'job_type', 'kind', 'tenant_id', %s::text, 'agent_id', %s::text, 'payload', %s::jsonb)))",
        (template, tenant, agent, json.dumps(payload)),
    )
    assert [row[0] for row in await cur.fetchall()] == [expected]


async def test_a_call_s_spend_is_written_once_however_often_its_write_is_tried(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    """A spend written again under its call's id (what a try repeated after a lost
    acknowledgement does) changes nothing in the key's window; another call's spend adds its
    request and units."""
    orc = flow_orc(make_orc)
    await orc.open()
    job_id = await orc.submit("late_call", {"sent_after": 0, "returned_after": 0})
    async with WorkerRun(orc, concurrency=10) as run:
        await run.until_finished(job_id)
    [call] = (await orc.job_usage(job_id)).calls
    [before] = await orc.flow_keys("late_call")
    assert (before.requests_used, before.units_used) == (1, 7)
    for _ in range(2):
        await orc.stores.flow.spend("late_call", job_id, units=7, call_id=call.call_id)
    [again] = await orc.flow_keys("late_call")
    assert (again.requests_used, again.units_used) == (1, 7)
    await orc.stores.flow.spend("late_call", job_id, units=5, call_id="another call")
    [more] = await orc.flow_keys("late_call")
    assert (more.requests_used, more.units_used) == (2, 12)


async def test_a_pause_ends_by_the_database_s_clock(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    """An operator's pause and a provider's hint are lengths; the database adds them to its
    own clock, as it reads every other time of a key's window (no caller's clock is read)."""
    orc = flow_orc(make_orc)
    await orc.open()
    job_id = await orc.submit("tick", None)
    async with WorkerRun(orc, concurrency=10) as run:
        await run.until_finished(job_id)
    await orc.pause_flow_key("tick", seconds=600, reason="incident", by="test")
    cur = await db.execute(
        "SELECT extract(epoch FROM paused_until - clock_timestamp())::float8 FROM orc_flow_keys"
        " WHERE key = 'tick'"
    )
    [(left,)] = await cur.fetchall()
    assert 590 < left <= 600
    await db.execute("SELECT orc_flow_throttled_v2('tick', 900, 'rate_limit_error: slow down')")
    [key] = await orc.flow_keys("tick")  # extended, and still the operator's (no type passes it)
    assert key.paused_by == "test" and key.pause_reason == "incident"
    cur = await db.execute(
        "SELECT extract(epoch FROM paused_until - clock_timestamp())::float8 FROM orc_flow_keys"
        " WHERE key = 'tick'"
    )
    [(seconds,)] = await cur.fetchall()
    assert 890 < seconds <= 900
