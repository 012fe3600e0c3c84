"""One bad row never stops a maintenance service: the rest of its batch is handled, the row is
recorded on its job (job.maintenance_failed, once while the reason stays the same) and logged,
and the next run tries it again (orchestrator.services.batches.PassedOver).

A row is made bad the way a database makes one (tests/support/refusals.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import psycopg
import pytest

from orchestrator import Orchestrator, Status
from orchestrator.services.sweep import ZombieSweep
from retry_config import LiveConfig, RetryConfig
from retry_config.models import JobRetryConfig
from tests.support import log_guard
from tests.support.refusals import refusing_writes_to

ZOMBIE = (
    "INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts, max_retries, "
    "trace_id, lease_token, locked_by, attempt, dispatch_attempt, heartbeat_at, started_at) "
    "VALUES (gen_random_uuid(), %s, 'RUNNING', 'null', %s, 3, 3, 't', gen_random_uuid(), "
    "'gone/1/w1', 1, 1, now() - interval '1 hour', now() - interval '1 hour') RETURNING id"
)


@pytest.fixture
async def orc(make_orc: Callable[..., Orchestrator]) -> Orchestrator:
    app = make_orc(zombie_threshold=60, safety_net_grace_seconds=0)
    await app.open()
    return app


async def insert(db: psycopg.AsyncConnection[Any], sql: str, *params: Any) -> UUID:
    row = await (await db.execute(sql, params)).fetchone()
    assert row is not None
    job_id: UUID = row[0]
    return job_id


async def zombie(db: psycopg.AsyncConnection[Any], job_type: str = "agent") -> UUID:
    return await insert(db, ZOMBIE, job_type, job_type)


async def passed_over_events(orc: Orchestrator, job_id: UUID) -> list[dict[str, Any]]:
    return [e.payload for e in await orc.job_events(job_id) if e.kind == "job.maintenance_failed"]


@pytest.mark.logs_errors(r"sweep_zombies: job \S+ could not be handled, .*: refused by the test")
async def test_the_sweep_recovers_every_zombie_but_the_one_the_database_refuses(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    good = [await zombie(db, "agent"), await zombie(db, "send_notification")]
    bad = await zombie(db, "http_request")
    async with refusing_writes_to(db, bad):
        with caplog.at_level(logging.ERROR, logger="orchestrator.services"):
            result = await orc.maintenance.sweep.run_once()
        assert (result.retried, result.passed_over) == (2, 1)
        for job_id in good:
            assert (await orc.get_job(job_id)).status is Status.RETRY
        assert (await orc.get_job(bad)).status is Status.RUNNING
        [event] = await passed_over_events(orc, bad)
        assert event == {
            "service": "sweep_zombies", "error": "refused by the test", "code": "P0001"
        }  # fmt: skip
        assert any(str(bad) in r.getMessage() for r in caplog.records), caplog.text
        again = await orc.maintenance.sweep.run_once()  # refused again: recorded once
        assert (again.retried, again.passed_over) == (0, 1)
        assert len(await passed_over_events(orc, bad)) == 1
    assert (await orc.maintenance.sweep.run_once()).retried == 1  # the next run takes it
    assert (await orc.get_job(bad)).status is Status.RETRY


@pytest.mark.logs_errors(r"sweep_zombies: job \S+ could not be handled, .*: backoff out of range")
async def test_a_zombie_without_a_decision_is_passed_over_and_the_others_recovered(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any]
) -> None:
    @dataclass(frozen=True)
    class Unusable(RetryConfig):
        """A config whose entry for one type cannot be applied at run time."""

        def for_type(self, job_type: str) -> JobRetryConfig:
            if job_type == "http_request":
                raise OverflowError("backoff out of range")
            return super().for_type(job_type)

    config = orc.retry_config
    sweep = ZombieSweep(
        stores=orc.stores, failures=orc.failures,
        config=LiveConfig(Unusable(config.path, config.defaults, config.job_types)),
        threshold=60,
        expiry_grace=60, batch_size=10, limit=100,
    )  # fmt: skip
    good, bad = await zombie(db, "agent"), await zombie(db, "http_request")
    result = await sweep.run_once()
    assert (result.retried, result.passed_over) == (1, 1)
    assert (await orc.get_job(good)).status is Status.RETRY
    assert (await orc.get_job(bad)).status is Status.RUNNING
    [event] = await passed_over_events(orc, bad)
    assert event == {
        "service": "sweep_zombies", "error": "backoff out of range", "code": "OverflowError"
    }  # fmt: skip


@pytest.mark.logs_errors(r"retry_safety_net: job \S+ could not be handled, .*: refused by the test")
async def test_the_safety_net_redispatches_every_lost_job_but_the_refused_one(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any]
) -> None:
    lost = (
        "INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts, max_retries, "
        "trace_id, run_at) VALUES (gen_random_uuid(), 'agent', 'PENDING', 'null', 'agent', 3, "
        "3, 't', now() - interval '1 minute') RETURNING id"
    )
    good, bad = await insert(db, lost), await insert(db, lost)
    async with refusing_writes_to(db, bad):
        result = await orc.maintenance.safety_net.run_once()
        assert (result.redispatched, result.passed_over) == (1, 1)
        assert (await orc.get_job(good)).procrastinate_job_id is not None
        assert (await orc.get_job(bad)).procrastinate_job_id is None
        [event] = await passed_over_events(orc, bad)
        assert event["service"] == "retry_safety_net"


@log_guard.fails_jobs("APPROVAL_EXPIRED")
@pytest.mark.logs_errors(r"expire_approvals: job \S+ could not be handled, .*: refused by the test")
async def test_approval_expiry_decides_every_expired_approval_but_the_refused_one(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any]
) -> None:
    waiting = (
        "INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts, max_retries, "
        "trace_id) VALUES (gen_random_uuid(), 'agent', 'WAITING_APPROVAL', 'null', 'agent', 3, "
        "3, 't') RETURNING id"
    )
    good, bad = await insert(db, waiting), await insert(db, waiting)
    for job_id in (good, bad):
        await db.execute(
            "INSERT INTO orc_approvals (id, job_id, step, key, question, on_reject, expires_at) "
            "VALUES (gen_random_uuid(), %s, 1, 'k', 'go on?', 'fail', now() - interval '1 s')",
            (job_id,),
        )
    async with refusing_writes_to(db, bad):
        result = await orc.maintenance.approval_expiry.run_once()
        assert (result.expired, result.passed_over) == (1, 1)
        assert (await orc.get_job(good)).status is Status.FAILED
        assert (await orc.get_job(bad)).status is Status.WAITING_APPROVAL
        [event] = await passed_over_events(orc, bad)
        assert event["service"] == "expire_approvals"
