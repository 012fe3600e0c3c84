"""End to end on real PostgreSQL and a real Procrastinate worker (in this event loop)."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from orchestrator import ErrorClass, InvalidTransition, Orchestrator, Status
from tests.support import log_guard, scripted
from tests.support.harness import WorkerRun, config_with, run_safety_net, wait_for
from tests.support.scripted import RELEASE, RUNS, STARTED, status_path


def app(make_orc: Callable[..., Orchestrator], **settings: Any) -> Orchestrator:
    orc = make_orc(retry_config=config_with(scripted.TABLE), **settings)
    scripted.register(orc)
    return orc


async def run_script(orc: Orchestrator, script: list[str], **options: Any) -> Any:
    async with WorkerRun(orc) as worker:
        job_id = await orc.submit("scripted", {"script": script}, **options)
        await worker.until_finished(job_id)
    return job_id


# -- the replay cases RP-001..005 (docs/contracts.md) ---------------------------------------------


async def test_rp_001_success(make_orc: Callable[..., Orchestrator]) -> None:
    orc = app(make_orc)
    job_id = await run_script(orc, ["ok"])
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    assert status_path(events) == ["PENDING", "RUNNING", "COMPLETED"]
    assert (job.status, job.attempt, job.retry_count) == (Status.COMPLETED, 1, 0)
    assert job.result == {"attempt": 1, "retry_count": 0}
    assert job.lease_token is None and job.finished_at is not None


async def test_rp_002_one_transient_failure_then_success(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc = app(make_orc)
    job_id = await run_script(orc, ["app", "ok"])
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    assert status_path(events) == ["PENDING", "RUNNING", "RETRY", "RUNNING", "COMPLETED"]
    assert job.retry_count == 1
    failed = next(e for e in events if e.kind == "job.failed")
    assert failed.payload["error"] == {
        "message": "429 Too Many Requests", "code": "HTTP_429", "classification": "TRANSIENT_APP",
    }  # fmt: skip
    assert (
        failed.payload["layer"] == "app" and failed.payload["backoff_ms"] == 50
    )  # base, no jitter
    assert job.last_error is not None and job.last_error.terminal is False


async def test_rp_003_three_transient_failures_then_success(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc = app(make_orc)
    job_id = await run_script(orc, ["app", "app", "app", "ok"])
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    assert status_path(events) == ["PENDING"] + ["RUNNING", "RETRY"] * 3 + ["RUNNING", "COMPLETED"]
    assert (job.retry_count, job.attempt) == (3, 4)
    backoffs = [e.payload["backoff_ms"] for e in events if e.kind == "job.retry_scheduled"]
    assert backoffs == [50, 100, 200]  # min(cap, base * 2^(n-1)), cap 400
    # Each retry is a fresh dispatch (a new Procrastinate job), as in Graphile's app layer.
    assert len({e.payload["run_id"] for e in events if e.kind == "job.running"}) == 4


async def test_a_jobs_history_is_kept_once_in_its_own_events(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    """Every transition is in orc_job_events; Procrastinate's per-dispatch copy is off (0009),
    through an app retry (a new dispatch, scheduled) and an infrastructure one (the same
    dispatch, retried by Procrastinate)."""
    orc = app(make_orc)
    job_id = await run_script(orc, ["app", "infra", "ok"])
    events = await orc.job_events(job_id)
    assert status_path(events) == ["PENDING"] + ["RUNNING", "RETRY"] * 2 + ["RUNNING", "COMPLETED"]
    cur = await db.execute("SELECT count(*) FROM procrastinate_events")
    assert await cur.fetchone() == (0,)


@log_guard.fails_jobs("HTTP_429")
async def test_rp_004_fourth_failure_is_dead_lettered_then_failed(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = app(make_orc)
    job_id = await run_script(orc, ["app"] * 4)
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    assert status_path(events)[-2:] == ["RUNNING", "FAILED"]
    assert [e.kind for e in events][-3:] == ["job.dead_lettered", "job.failed", "job.degraded"]
    assert (job.status, job.retry_count, job.attempt) == (Status.FAILED, 3, 4)
    assert job.last_error is not None and job.last_error.terminal
    assert job.last_error.classification is ErrorClass.TRANSIENT_APP
    [letter] = await orc.dead_letters()
    assert letter.job_id == job_id and letter.state == "recorded"
    assert (
        events[-1].payload["dead_letter_id"]
        == events[-2].payload["dead_letter_id"]
        == str(letter.id)
    )


async def test_rp_005_a_second_terminal_write_is_refused(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc = app(make_orc)
    job_id = await run_script(orc, ["ok"])
    before = await orc.get_job(job_id)
    with pytest.raises(InvalidTransition) as info:
        await orc.cancel(job_id, reason="too late")
    assert info.value.code == "WF_STATE_TRANSITION_INVALID"
    assert await orc.get_job(job_id) == before


# -- attempts count claims, never reset ---------------------------------------------


async def test_attempt_counts_every_claim_and_is_never_reset(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc = app(make_orc)
    job_id = await run_script(orc, ["app", "app", "ok"])
    running = [e.payload for e in await orc.job_events(job_id) if e.kind == "job.running"]
    assert [p["attempt"] for p in running] == [1, 2, 3]
    assert [p["retry_count"] for p in running] == [0, 1, 2]


@log_guard.fails_jobs("HTTP_400")
async def test_permanent_failure_uses_no_retry(make_orc: Callable[..., Orchestrator]) -> None:
    orc = app(make_orc)
    job_id = await run_script(orc, ["permanent"])
    job = await orc.get_job(job_id)
    assert (job.status, job.attempt, job.retry_count) == (Status.FAILED, 1, 0)
    assert job.last_error is not None
    assert (job.last_error.code, job.last_error.classification) == (
        "HTTP_400",
        ErrorClass.PERMANENT,
    )


@log_guard.fails_jobs("HTTP_429")
async def test_max_retries_given_at_submit_overrides_the_config(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc = app(make_orc)
    job_id = await run_script(orc, ["app", "app", "ok"], max_retries=1)
    job = await orc.get_job(job_id)
    assert (job.status, job.retry_count, job.max_retries) == (Status.FAILED, 1, 1)


# -- the infrastructure layer: Graphile's formula on real Procrastinate retries ----------------


async def dispatch_row(db: psycopg.AsyncConnection[Any], job_id: Any) -> tuple[Any, ...]:
    cur = await db.execute(
        "SELECT p.id, p.status, p.attempts, p.scheduled_at, j.next_retry_at, j.status "
        "FROM orc_jobs j JOIN procrastinate_jobs p ON p.id = j.procrastinate_job_id WHERE j.id = %s",
        (job_id,),
    )
    row = await cur.fetchone()
    assert row is not None
    return row


@log_guard.fails_jobs("ECONNRESET")
async def test_infra_failures_follow_graphile_on_real_procrastinate_retries(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = app(make_orc)  # scripted: worker_max_attempts = 4 runs per dispatch
    async with WorkerRun(orc) as worker:
        job_id = await orc.submit("scripted", {"script": ["infra"] * 4})
        for run in (1, 2, 3):

            async def rescheduled(run: int = run) -> bool:
                row = await dispatch_row(db, job_id)
                return row[1] == "todo" and row[2] == run

            await wait_for(rescheduled)
            pj_id, _, _, scheduled_at, next_retry_at, status = await dispatch_row(db, job_id)
            events = await orc.job_events(job_id)
            failed = [e for e in events if e.kind == "job.failed"][-1]
            # The job shows the retry: RETRY, same instant as Procrastinate's schedule, no app
            # budget used, and the delay is exp(min(10, run)) seconds.
            assert status == "RETRY" and scheduled_at == next_retry_at
            assert failed.payload["layer"] == "infra"
            assert failed.payload["backoff_ms"] == pytest.approx(math.exp(run) * 1000, abs=0.01)
            assert scheduled_at - failed.at == pytest.approx(
                timedelta(seconds=math.exp(run)), abs=timedelta(seconds=0.5)
            )
            assert (await orc.get_job(job_id)).retry_count == 0
            # Fast-forward the wait (the formula is checked; the clock is not what we test).
            await db.execute(
                "UPDATE procrastinate_jobs SET scheduled_at = now() WHERE id = %s", (pj_id,)
            )
            await db.execute("UPDATE orc_jobs SET next_retry_at = now() WHERE id = %s", (job_id,))
            worker_wake = await db.execute(
                "SELECT pg_notify('orc_wakeup', extract(epoch FROM now())::text)"
            )
            assert worker_wake is not None
        await worker.until_finished(job_id)

    job = await orc.get_job(job_id)
    pj = await dispatch_row(db, job_id)
    assert (job.status, job.attempt, job.retry_count) == (Status.FAILED, 4, 0)
    assert (
        job.last_error is not None and job.last_error.classification is ErrorClass.TRANSIENT_INFRA
    )
    assert job.last_error.code == "ECONNRESET" and job.last_error.terminal
    assert (pj[1], pj[2]) == ("failed", 4)  # one dispatch, four runs: Graphile's max attempts
    assert [e.payload["run"] for e in await orc.job_events(job_id) if e.kind == "job.running"] == [
        1,
        2,
        3,
        4,
    ]


# -- fencing: stale attempts and duplicate dispatches -----------------------------------------


async def test_a_stale_completion_is_rejected_by_the_lease(
    make_orc: Callable[..., Orchestrator],
    db: psycopg.AsyncConnection[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    orc = app(make_orc)
    async with WorkerRun(orc):
        job_id = await orc.submit("scripted", {"script": ["block"]})
        await wait_for(lambda: _started(job_id))
        # The job is handed to another attempt (as a zombie sweep would do) while this one runs.
        await db.execute(
            "UPDATE orc_jobs SET lease_token = gen_random_uuid() WHERE id = %s", (job_id,)
        )
        superseded = await orc.get_job(job_id)
        RELEASE[job_id].set()

        async def refused() -> bool:
            return any("stale write refused" in r.getMessage() for r in caplog.records)

        await wait_for(refused)
    job = await orc.get_job(job_id)
    assert job.status is Status.RUNNING and job.result is None
    assert job.lease_token == superseded.lease_token  # the newer attempt's lease is untouched
    assert job == superseded  # nothing about the job changed
    assert [e.kind for e in await orc.job_events(job_id)] == ["job.created", "job.running"]


async def _started(job_id: Any) -> bool:
    return job_id in STARTED and STARTED[job_id].is_set()


async def test_a_duplicate_dispatch_is_a_no_op(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = app(make_orc)
    async with orc:
        job_id = await orc.submit("scripted", {"script": ["ok"]})
        for _ in range(2):  # two more dispatches of the job, through Procrastinate's defer
            await db.execute(
                "SELECT procrastinate_defer_jobs_v1(ARRAY[ROW('scripted', 'orc.scripted', 0, %s,"
                " NULL, jsonb_build_object('job_id', %s::text), NULL)"
                "::procrastinate_job_to_defer_v1])",
                (str(job_id), str(job_id)),
            )
    async with WorkerRun(orc) as worker:
        await worker.until_finished(job_id)

        async def all_dispatches_done() -> bool:
            cur = await db.execute(
                "SELECT count(*) FROM procrastinate_jobs "
                "WHERE status <> 'succeeded' AND task_name = 'orc.scripted'"
            )
            row = await cur.fetchone()
            return row is not None and row[0] == 0

        await wait_for(all_dispatches_done)
    assert RUNS[job_id] == 1
    assert [e.kind for e in await orc.job_events(job_id)] == [
        "job.created",
        "job.running",
        "job.completed",
    ]


# -- timeouts, invalid output, payloads that no longer fit ------------------------------------


@log_guard.fails_jobs("JOB_TIMEOUT")
async def test_job_timeout_fails_the_job_with_the_design_message(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc = app(make_orc)
    job_id = await run_script(orc, ["sleep:30"], timeout_seconds=1)
    job = await orc.get_job(job_id)
    assert job.status is Status.FAILED and job.last_error is not None
    assert job.last_error.message == "Job timed out after 1 seconds"
    assert job.last_error.code == "JOB_TIMEOUT"


@log_guard.fails_jobs("OUTPUT_INVALID")
async def test_invalid_output_fails_and_keeps_the_output(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc = app(make_orc)
    async with WorkerRun(orc) as worker:
        job_id = await orc.submit("shaped", {"status": "two hundred"})
        await worker.until_finished(job_id)
    job = await orc.get_job(job_id)
    assert job.status is Status.FAILED and job.last_error is not None
    assert job.last_error.classification is ErrorClass.INVALID_OUTPUT
    assert job.last_error.output == {"status": "two hundred"}
    assert job.attempt == 1  # never retried


@log_guard.fails_jobs("PAYLOAD_INVALID")
async def test_a_stored_payload_that_no_longer_fits_fails_permanently(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = app(make_orc)
    async with orc:
        job_id = await orc.submit("scripted", {"script": ["ok"]})
    await db.execute("""UPDATE orc_jobs SET payload = '{"steps": []}' WHERE id = %s""", (job_id,))
    async with WorkerRun(orc) as worker:
        await worker.until_finished(job_id)
    job = await orc.get_job(job_id)
    assert job.last_error is not None and job.last_error.code == "PAYLOAD_INVALID"
    assert RUNS[job_id] == 0


# -- cancellation ----------------------------------------------------------------------------


async def test_cancel_a_waiting_job(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = app(make_orc)
    async with orc:
        job_id = await orc.submit("scripted", {"script": ["ok"]})
        await orc.cancel(job_id, reason="not needed", by="alice")
        job = await orc.get_job(job_id)
        event = (await orc.job_events(job_id))[-1]
    assert job.status is Status.CANCELLED
    assert (event.kind, event.payload) == ("job.cancelled", {"reason": "not needed", "by": "alice"})
    pj = await dispatch_row(db, job_id)
    assert pj[1] == "cancelled"


async def test_cancel_a_running_job_aborts_it(make_orc: Callable[..., Orchestrator]) -> None:
    orc = app(make_orc)
    async with WorkerRun(orc):
        job_id = await orc.submit("scripted", {"script": ["block"]})
        await wait_for(lambda: _started(job_id))
        await orc.cancel(job_id, reason="stop")

        async def attempt_gone() -> bool:
            return job_id not in orc.running_jobs()

        await wait_for(attempt_gone)  # Procrastinate cancelled it; it could not hand the job back
    assert (await orc.get_job(job_id)).status is Status.CANCELLED
    assert (await orc.job_events(job_id))[-1].kind == "job.cancelled"


# -- the retry safety net --------------------------------------------------------------------


async def test_safety_net_redispatches_a_job_whose_dispatch_was_lost(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = app(make_orc, safety_net_grace_seconds=0)
    async with orc:
        lost = await orc.submit("scripted", {"script": ["ok"]})
        stuck = await orc.submit("scripted", {"script": ["ok"]})
        healthy = await orc.submit("scripted", {"script": ["ok"]})
        # lost: its Procrastinate job was deleted. stuck: held `doing` by a dead worker.
        await db.execute(
            "DELETE FROM procrastinate_jobs WHERE id = (SELECT procrastinate_job_id FROM orc_jobs WHERE id = %s)",
            (lost,),
        )
        await db.execute(
            "INSERT INTO procrastinate_workers (id, last_heartbeat) OVERRIDING SYSTEM VALUE "
            "VALUES (999, now() - interval '1 hour')"
        )
        await db.execute(
            "UPDATE procrastinate_jobs SET status = 'doing', worker_id = 999 "
            "WHERE id = (SELECT procrastinate_job_id FROM orc_jobs WHERE id = %s)",
            (stuck,),
        )
        assert await run_safety_net(orc) == 2
        assert await run_safety_net(orc) == 0  # nothing left to do: idempotent
        kinds = {j: [e.kind for e in await orc.job_events(j)] for j in (lost, stuck, healthy)}
    assert kinds[lost][-1] == kinds[stuck][-1] == "job.redispatched"
    assert "job.redispatched" not in kinds[healthy]
    async with WorkerRun(orc) as worker:
        await worker.until_finished(lost, stuck, healthy)
    for job_id in (lost, stuck, healthy):
        assert (await orc.get_job(job_id)).status is Status.COMPLETED


# -- dead letters: requeue and two-person discard -----------------------------------


@log_guard.fails_jobs("HTTP_400")
async def test_dead_letter_requeue_creates_a_linked_job(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc = app(make_orc)
    job_id = await run_script(orc, ["permanent"])
    async with orc:
        [letter] = await orc.dead_letters()
        replay = await orc.requeue_dead_letter(letter.id)
        new_job = await orc.get_job(replay)
        [after] = await orc.dead_letters()
        with pytest.raises(Exception, match="already requeued"):
            await orc.requeue_dead_letter(letter.id)
    assert new_job.replay_of == letter.id and new_job.payload == {"script": ["permanent"]}
    assert new_job.status is Status.PENDING and replay != job_id
    assert (after.state, after.requeued_job_id) == ("requeued", replay)


@log_guard.fails_jobs("HTTP_400")
async def test_dead_letter_discard_needs_two_different_reviewers(
    make_orc: Callable[..., Orchestrator],
) -> None:
    from orchestrator import DeadLetterError

    orc = app(make_orc)
    await run_script(orc, ["permanent"])
    async with orc:
        [letter] = await orc.dead_letters()
        with pytest.raises(DeadLetterError, match="needs a reason"):
            await orc.request_discard(letter.id, by="alice", reason=" ")
        with pytest.raises(DeadLetterError, match="it is recorded"):
            await orc.confirm_discard(letter.id, by="bob")
        await orc.request_discard(letter.id, by="alice", reason="customer deleted")
        with pytest.raises(DeadLetterError, match="second reviewer"):
            await orc.confirm_discard(letter.id, by="alice")
        await orc.confirm_discard(letter.id, by="bob")
        [done] = await orc.dead_letters()
    assert (done.state, done.discard_requested_by, done.discarded_by) == (
        "discarded",
        "alice",
        "bob",
    )
    assert done.discard_reason == "customer deleted"
