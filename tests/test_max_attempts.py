"""The worker contract's ``max_attempts`` in the events, ``last_error`` and claims a real
database holds (docs/contracts.md, "Attempts and runs"): SQL alone tells it (orc_max_attempts_v1
at a claim, orc_max_attempts_after_v1 after a failure), held equal to its model
(tests/support/attempts.py) at every moment; random failures of both layers, written by their
real paths, keep its invariants and tell the model's cap; a worker process failing jobs through
both layers tells it end to end."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Any, Literal
from uuid import UUID

import psycopg
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from psycopg.types.json import Jsonb

from orchestrator import JobContext, Orchestrator
from orchestrator.domain.classification import Classified, ErrorClass
from orchestrator.domain.events import Fault
from orchestrator.domain.models import DeadLetter
from orchestrator.domain.policy import Budget, Layer
from orchestrator.runtime.outcomes import OutcomeWriter, of_failure, terminal
from orchestrator.storage.database import OwnConnection
from tests.support import log_guard, scripted
from tests.support.attempts import Moment, max_attempts
from tests.support.harness import config_with, wait_for
from tests.support.workers import WorkerProcess

#: The events that report where a job's attempts stand, and the failures among them.
COUNTED = ("job.running", "job.failed", "job.retry_scheduled")
#: How a try fails here: through the worker's outcome writer (the first four), the job timeout,
#: or a worker that looks dead to the zombie sweep.
Failure = Literal["infra", "app", "permanent", "invalid", "job_timeout", "zombie"]
FAILURES: tuple[Failure, ...] = ("infra", "app", "permanent", "invalid", "job_timeout", "zombie")
CLASSES = {
    "infra": Classified(ErrorClass.TRANSIENT_INFRA, "ECONNRESET"),
    "app": Classified(ErrorClass.TRANSIENT_APP, "HTTP_429"),
    "permanent": Classified(ErrorClass.PERMANENT, "HTTP_400"),
    "invalid": Classified(ErrorClass.INVALID_OUTPUT, "OUTPUT_INVALID"),
    "job_timeout": Classified(ErrorClass.PERMANENT, "JOB_TIMEOUT"),
}
#: Job types with 1, 2 and 3 runs per dispatch; their retries are given at submit.
CONFIG = "".join(f"[job_types.runs{n}]\nworker_max_attempts = {n}\n" for n in (1, 2, 3))


#: Each moment a cap is told, as the SQL names it (null: a terminal failure).
MOMENTS: dict[str, Moment] = {
    "claim": "claim", "terminal": "terminal", "infra": Layer.INFRA, "app": Layer.APP,
    "pause": Layer.PAUSE,
}  # fmt: skip


def test_the_sql_tells_the_model_s_max_attempts_at_every_moment(dsn: str) -> None:
    """orc_max_attempts_v1 (the claim's row and job.running) is the model at a claim, and
    orc_max_attempts_after_v1 (every failure writer's) the model after a failure retried at each
    layer or ended, on every small budget and at the limits of the columns."""
    edge = 2**31 - 1
    extremes = [(edge, edge, edge, 0, edge), (1, 1, edge, 0, edge), (1, edge, 1, edge, 0)]
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            """
            WITH b AS (
                SELECT a, r, mr, c, mc
                  FROM generate_series(1, 12) AS a, generate_series(1, 6) AS r,
                       generate_series(1, 6) AS mr, generate_series(0, 6) AS c,
                       generate_series(0, 6) AS mc
            )
            SELECT 'claim', a, r, mr, c, mc, orc_max_attempts_v1(a, r, mr, c, mc) FROM b
            UNION ALL
            SELECT m, a, r, mr, c, mc,
                   orc_max_attempts_after_v1(a, r, mr, c, mc, nullif(m, 'terminal'))
              FROM b, unnest(ARRAY['terminal', 'infra', 'app', 'pause']) AS m
            UNION ALL
            SELECT 'claim', a, r, mr, c, mc, orc_max_attempts_v1(a, r, mr, c, mc)
              FROM unnest(%s::int[], %s::int[], %s::int[], %s::int[], %s::int[])
                   AS e (a, r, mr, c, mc)
            """,
            [list(column) for column in zip(*extremes, strict=True)],
        ).fetchall()
    assert len(rows) == 5 * 12 * 6 * 6 * 7 * 7 + len(extremes)
    for moment, attempt, run, max_runs, retry_count, max_retries, told in rows:
        b = Budget(retry_count=retry_count, max_retries=max_retries, run=run, max_runs=max_runs)
        assert told == max_attempts(attempt, b, MOMENTS[moment]), (moment, attempt, b)


def test_a_layer_the_sql_does_not_know_is_refused(dsn: str) -> None:
    with psycopg.connect(dsn) as conn, pytest.raises(psycopg.errors.RaiseException, match="lost"):
        conn.execute("SELECT orc_max_attempts_after_v1(1, 1, 3, 0, 3, 'lost')")


async def test_a_failure_of_the_release_before_brings_its_cap_and_the_sql_s_replaces_it(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any]
) -> None:
    """The release before shapes its terminal failures with their own max_attempts; the one
    failure writer (orc_fail_jobs_v1) replaces it with its own, the attempt (the same value
    from a worker that computed it right), in last_error, the dead letter and job.failed."""
    job_id = await orc.submit("runs2", None)
    brought = {"message": "old", "code": "X", "classification": "PERMANENT", "max_attempts": 99}
    item = {
        "ord": 1, "job_id": str(job_id), "lease_token": None,
        "dead_letter_id": "0190a6c4-0000-7000-8000-000000000001", "error": brought,
        "failed": {"terminal": True, "attempt": 0, "max_attempts": 99}, "before": [],
        "degraded": None, "dispatch_id": None, "dispatch_status": None,
    }  # fmt: skip
    cur = await db.execute(
        "SELECT dead_letter_id FROM orc_fail_jobs_v1(%s, 'FAILED', ARRAY['PENDING'])",
        (Jsonb([item]),),
    )
    assert await cur.fetchall() == [(UUID(item["dead_letter_id"]),)]
    cur = await db.execute(
        "SELECT j.last_error -> 'max_attempts', d.error -> 'max_attempts',"
        "       (SELECT e.payload -> 'max_attempts' FROM orc_job_events AS e"
        "         WHERE e.job_id = j.id AND e.kind = 'job.failed')"
        "  FROM orc_jobs AS j JOIN orc_dead_letters AS d ON d.job_id = j.id WHERE j.id = %s",
        (job_id,),
    )
    assert await cur.fetchall() == [(0, 0, 0)]  # never claimed: attempt 0


@pytest.fixture
async def orc(make_orc: Callable[..., Orchestrator]) -> Orchestrator:
    """Open for the whole test (its examples share it; make_orc closes it)."""
    orc = make_orc(retry_config=config_with(CONFIG))
    for n in (1, 2, 3):

        @orc.job_type(f"runs{n}")
        async def never_run(ctx: JobContext, payload: None) -> None:
            raise AssertionError("this test runs no task: it writes each attempt's outcome")

    await orc.open()
    return orc


async def fail_once(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any], writer: OutcomeWriter,
    job_id: UUID, how: Failure, worker_id: int,
) -> None:  # fmt: skip
    """Claim the waiting job now (the claim's SQL, job.running; its row tells the model's cap),
    then fail that attempt as ``how`` says, through the path that writes such a failure."""
    held = await orc.stores.dispatches.claim_now(job_id, worker_id=worker_id, worker="prop")
    assert held is not None
    claim, dispatch_id = held.claim, held.dispatch_id
    assert claim.most_attempts == max_attempts(claim.attempt, Budget.of(claim), "claim")
    if how == "zombie":
        await db.execute(
            "UPDATE orc_jobs SET heartbeat_at = now() - interval '1 hour' WHERE id = %s",
            (job_id,),
        )
        assert (await orc.maintenance.sweep.run_once()).handled == 1
        return
    classified = CLASSES[how]
    fault = Fault(f"{how} (property test)", classified.code, classified.error_class)
    if how == "job_timeout":  # as an attempt does: terminal, whatever budget is left
        outcome = terminal(claim, fault, classified, dispatch_id=dispatch_id, failures=orc.failures)
    else:
        outcome = of_failure(
            claim, fault, classified, dispatch_id=dispatch_id,
            backoff=orc.retry_config.for_type(claim.job_type).backoff, rng=random.Random(0),
            failures=orc.failures,
        )  # fmt: skip
    assert await writer.write(dispatch_id, claim, outcome)


async def letters_of(orc: Orchestrator, job_id: UUID) -> list[DeadLetter]:
    return [d for d in await orc.dead_letters(limit=1_000) if d.job_id == job_id]


def check_last_error(error: dict[str, Any], told: dict[str, Any]) -> None:
    """A failure's ``last_error`` tells what its event told, and is terminal exactly when
    ``attempt >= max_attempts`` (then they are equal)."""
    assert (error["attempt"], error["max_attempts"]) == (told["attempt"], told["max_attempts"])
    assert error["terminal"] == (error["attempt"] >= error["max_attempts"])
    if error["terminal"]:
        assert error["max_attempts"] == error["attempt"]


@log_guard.fails_jobs(
    "ECONNRESET", "HTTP_429", "HTTP_400", "OUTPUT_INVALID", "JOB_TIMEOUT", "ZOMBIE"
)
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    runs=st.integers(1, 3),
    retries=st.integers(0, 3),
    failures=st.lists(st.sampled_from(FAILURES), min_size=1, max_size=14),
)
async def test_random_failures_of_both_layers_keep_max_attempts_true(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any], dsn: str,
    runs: int, retries: int, failures: list[Failure],
) -> None:  # fmt: skip
    """Failures drawn at random (infrastructure ones within a dispatch, application retries,
    zombies, permanent errors, invalid output, the job timeout), each written by its real path,
    then a permanent one if the job still has budget. Proved on the stored history:

    - every job.running, job.failed and job.retry_scheduled, and every last_error, has
      ``attempt`` and ``max_attempts``; job.running's is the model's at a claim, job.failed's
      the model's after a failure retried at its layer or ended;
    - a failure is terminal exactly when ``attempt >= max_attempts``, and then they are equal;
    - with nothing but failures, ``max_attempts`` never grows; a retry tells the cap of the
      claim it leads to;
    - the job never makes more attempts than any ``max_attempts`` it was told."""
    note(f"{runs} runs per dispatch, {retries} retries, failures {failures}")
    writer = OutcomeWriter(
        orc.stores.dispatches, orc.stores.jobs, OwnConnection(dsn, "outcomes"), orc.metrics
    )
    worker_id = await orc.stores.dispatches.register_worker(prune_after=3600)
    job_id = await orc.submit(f"runs{runs}", None, max_retries=retries)
    for how in [*failures, "permanent"]:
        seen = len(await orc.job_events(job_id))
        await fail_once(orc, db, writer, job_id, how, worker_id)
        job = await orc.get_job(job_id)
        new = [e for e in (await orc.job_events(job_id))[seen:] if e.kind in COUNTED]
        failure = [e for e in new if e.kind in COUNTED[1:]][-1]
        cur = await db.execute("SELECT last_error FROM orc_jobs WHERE id = %s", (job_id,))
        [error] = await cur.fetchone() or ()
        check_last_error(error, failure.payload)
        if job.finished_at is not None:
            [letter] = await letters_of(orc, job_id)
            assert letter.error.max_attempts == job.attempt == error["attempt"]
            break
    await writer.connection.close()

    history = [e for e in await orc.job_events(job_id) if e.kind in COUNTED]
    assert all({"attempt", "max_attempts"} <= set(e.payload) for e in history), history
    caps = [e.payload["max_attempts"] for e in history]
    assert all(isinstance(cap, int) for cap in caps)
    assert caps == sorted(caps, reverse=True), history
    assert all(job.attempt <= cap for cap in caps)
    for event, after in itertools.pairwise(history):
        p = event.payload
        if event.kind == "job.running":
            b = Budget(
                retry_count=p["retry_count"], max_retries=p["max_retries"], run=p["run"],
                max_runs=p["max_runs"],
            )  # fmt: skip
            assert p["max_attempts"] == max_attempts(p["attempt"], b, "claim")
        if event.kind == "job.retry_scheduled":
            assert after.kind == "job.running"
            assert after.payload["max_attempts"] == p["max_attempts"]
    failed = [e.payload for e in history if e.kind == "job.failed"]
    for p in failed:
        assert p["terminal"] == (p["attempt"] >= p["max_attempts"])
        b = Budget(
            retry_count=p["retry_count"], max_retries=p["max_retries"], run=p["run"],
            max_runs=p["max_runs"],
        )  # fmt: skip
        moment: Moment = "terminal" if p["terminal"] else Layer(p["layer"])
        assert p["max_attempts"] == max_attempts(p["attempt"], b, moment), p
    assert failed[-1]["terminal"] and failed[-1]["max_attempts"] == job.attempt


# -- end to end: a worker process ----------------------------------------------------------------

#: Two runs per dispatch and one application retry: four attempts at most.
E2E_TABLE = "[job_types.scripted]\nworker_max_attempts = 2\napp_max_retries = 1\n"
#: (script, what each counted event tells: kind, attempt, max_attempts, terminal or None).
E2E = {
    "both layers to the cap": (
        ["infra", "app", "infra", "infra"],
        [("job.running", 1, 4, None), ("job.failed", 1, 4, False),
         ("job.retry_scheduled", 1, 4, None),
         ("job.running", 2, 4, None), ("job.failed", 2, 4, False),
         ("job.retry_scheduled", 2, 4, None),
         ("job.running", 3, 4, None), ("job.failed", 3, 4, False),
         ("job.retry_scheduled", 3, 4, None),
         ("job.running", 4, 4, None), ("job.failed", 4, 4, True)],
    ),
    "an app retry gives up its dispatch's last run": (
        ["app", "infra", "app"],
        [("job.running", 1, 4, None), ("job.failed", 1, 3, False),
         ("job.retry_scheduled", 1, 3, None),
         ("job.running", 2, 3, None), ("job.failed", 2, 3, False),
         ("job.retry_scheduled", 2, 3, None),
         ("job.running", 3, 3, None), ("job.failed", 3, 3, True)],
    ),
    "a permanent error ends it below the cap": (
        ["infra", "permanent"],
        [("job.running", 1, 4, None), ("job.failed", 1, 4, False),
         ("job.retry_scheduled", 1, 4, None),
         ("job.running", 2, 4, None), ("job.failed", 2, 2, True)],
    ),
}  # fmt: skip


@log_guard.fails_jobs("ECONNRESET", "HTTP_429", "HTTP_400")
async def test_a_worker_process_tells_max_attempts_through_both_layers(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any], dsn: str
) -> None:
    config = config_with(E2E_TABLE)
    orc = make_orc(retry_config=config)
    scripted.register(orc)
    app = "tests.support.scripted_app:orc"
    with WorkerProcess(dsn, app, ORCHESTRATOR_RETRY_CONFIG=config):
        async with orc:
            jobs = {
                name: await orc.submit("scripted", {"script": script})
                for name, (script, _) in E2E.items()
            }

            async def all_failed() -> bool:
                # the infrastructure layer's waits (exp(run) s), fast-forwarded
                await db.execute(
                    "UPDATE procrastinate_jobs SET scheduled_at = now() "
                    "WHERE status = 'todo' AND scheduled_at > now()"
                )
                return all([(await orc.get_job(j)).finished_at is not None for j in jobs.values()])

            await wait_for(all_failed, timeout=60, interval=0.2)
            for name, (_, expected) in E2E.items():
                job = await orc.get_job(jobs[name])
                told = [
                    (e.kind, e.payload["attempt"], e.payload["max_attempts"],
                     e.payload.get("terminal"))
                    for e in await orc.job_events(jobs[name]) if e.kind in COUNTED
                ]  # fmt: skip
                assert told == expected, name
                error = job.last_error
                assert error is not None and error.terminal, name
                assert error.attempt == error.max_attempts == expected[-1][1], name
                [letter] = await letters_of(orc, jobs[name])
                assert letter.error.max_attempts == error.attempt, name
