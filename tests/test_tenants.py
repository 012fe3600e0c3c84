"""Tenants (docs/contracts.md, "Tenants"): the tenant given at submit is on the job, in
job.created, in its attempt's context, on its dead letter and on the job a requeue makes; the
job and dead-letter listings filter by it; job keys stay global."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from orchestrator import JobContext, Orchestrator, Status
from tests.support import scripted
from tests.support.harness import WorkerRun, config_with


def app(make_orc: Callable[..., Orchestrator]) -> Orchestrator:
    orc = make_orc(retry_config=config_with(scripted.TABLE))
    scripted.register(orc)

    @orc.job_type("whose")
    async def whose(ctx: JobContext, payload: None) -> str | None:
        return ctx.tenant_id

    return orc


async def test_a_jobs_tenant_goes_from_submit_to_its_attempt(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc = app(make_orc)
    async with WorkerRun(orc) as worker:
        acme = await orc.submit("whose", tenant_id="acme")
        nobody = await orc.submit("whose")
        await worker.until_finished(acme, nobody)
        jobs = [await orc.get_job(job_id) for job_id in (acme, nobody)]
        created = [(await orc.job_events(job_id))[0] for job_id in (acme, nobody)]
    assert [(j.tenant_id, j.status, j.result) for j in jobs] == [
        ("acme", Status.COMPLETED, "acme"),  # the task saw its tenant in ctx.tenant_id
        (None, Status.COMPLETED, None),
    ]
    assert [(e.kind, e.payload["tenant_id"]) for e in created] == [
        ("job.created", "acme"),
        ("job.created", None),
    ]


@pytest.mark.parametrize("job_key", [None, "k"], ids=["keyless", "keyed"])
async def test_a_batch_takes_a_tenant_per_job(
    make_orc: Callable[..., Orchestrator], job_key: str | None
) -> None:
    # A batch with a key goes through orc_submit_jobs_v1 (its keyless jobs too); one without,
    # through orc_submit_jobs_v2.
    async with app(make_orc) as orc:
        ids = await orc.submit_many(
            [
                {"job_type": "whose", "tenant_id": "acme", "job_key": job_key},
                {"job_type": "whose", "tenant_id": "globex"},
                {"job_type": "whose"},
            ]
        )
        tenants = [(await orc.get_job(job_id)).tenant_id for job_id in ids]
        created = [(await orc.job_events(job_id))[0].payload["tenant_id"] for job_id in ids]
    assert tenants == created == ["acme", "globex", None]


async def test_listings_filter_by_tenant_and_dead_letters_keep_it(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc = app(make_orc)
    permanent = {"script": ["permanent"]}
    async with WorkerRun(orc) as worker:
        acme = {await orc.submit("scripted", permanent, tenant_id="acme") for _ in range(2)}
        globex = await orc.submit("scripted", permanent, tenant_id="globex")
        nobody = await orc.submit("scripted", permanent)
        later = await orc.submit(
            "whose", tenant_id="acme", run_at=datetime.now(UTC) + timedelta(hours=1)
        )
        await worker.until_finished(*acme, globex, nobody)
        listed = {j.id for j in await orc.list_jobs(tenant_id="acme")}
        failed = {j.id for j in await orc.list_jobs(tenant_id="acme", status=Status.FAILED)}
        everyone = {j.id for j in await orc.list_jobs()}
        assert await orc.list_jobs(tenant_id="initech") == []
        letters = await orc.dead_letters(tenant_id="acme")
        recorded = await orc.dead_letters(state="recorded", tenant_id="globex")
        all_letters = await orc.dead_letters()
        replay = await orc.requeue_dead_letter(letters[0].id)
        replayed = await orc.get_job(replay)
    assert listed == acme | {later} and failed == acme
    assert everyone == acme | {globex, nobody, later}
    assert {(d.job_id, d.tenant_id) for d in letters} == {(j, "acme") for j in acme}
    assert [(d.job_id, d.tenant_id) for d in recorded] == [(globex, "globex")]
    assert {d.tenant_id for d in all_letters} == {"acme", "globex", None}
    assert (replayed.tenant_id, replayed.replay_of) == ("acme", letters[0].id)


async def test_job_keys_are_global_and_a_replace_takes_the_newer_submits_tenant(
    make_orc: Callable[..., Orchestrator],
) -> None:
    async with app(make_orc) as orc:
        first = await orc.submit("whose", job_key="report", tenant_id="acme")
        replaced = await orc.submit("whose", job_key="report", tenant_id="globex")
        after_replace = (await orc.get_job(first)).tenant_id
        deduplicated = await orc.submit(
            "whose", job_key="report", job_key_mode="unsafe_dedupe", tenant_id="acme"
        )
        after_dedupe = (await orc.get_job(first)).tenant_id
        event = (await orc.job_events(first))[1]
        prefixed = await orc.submit("whose", job_key="acme:report", tenant_id="acme")
    assert replaced == deduplicated == first  # one key, whichever tenant submits it
    assert (after_replace, after_dedupe) == ("globex", "globex")  # dedupe changes nothing
    assert (event.kind, event.payload["tenant_id"]) == ("job.replaced", "globex")
    assert prefixed != first  # a tenant's own key space: a prefix


async def test_the_database_holds_every_tenant_submit_takes_and_no_other(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    longest = "é" * 200  # characters, not bytes, as JobSpec counts them
    async with app(make_orc) as orc:
        job_id = await orc.submit("whose", tenant_id=longest)
        assert (await orc.get_job(job_id)).tenant_id == longest
    for bad in ("", "t" * 201):
        with pytest.raises(psycopg.errors.CheckViolation, match="orc_jobs_tenant_id_length"):
            await db.execute("UPDATE orc_jobs SET tenant_id = %s WHERE id = %s", (bad, job_id))
