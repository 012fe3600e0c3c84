"""Tenants (docs/contracts.md, "Tenants"): the tenant given at submit is on the job, in
job.created, in its attempt's context, on its dead letter and on the job a requeue makes; the
job and dead-letter listings filter by it; a job key is the tenant's own (jobs without a tenant
have theirs), in-process and through the API."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import psycopg
import pytest

from orchestrator import JobContext, Orchestrator, Status
from orchestrator.app import JobSpec
from orchestrator.domain.models import SubmitResult
from orchestrator.domain.principals import Scope
from tests.support import log_guard, scripted
from tests.support.api_server import ApiServer, token
from tests.support.harness import WorkerRun, config_with, wait_for


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


@log_guard.fails_jobs("HTTP_400")
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


KEYED_MODES = ["replace", "preserve_run_at", "unsafe_dedupe"]


@pytest.mark.parametrize("mode", KEYED_MODES)
async def test_a_job_key_is_the_tenant_s_own_and_no_tenant_is_a_scope_of_its_own(
    make_orc: Callable[..., Orchestrator], mode: str
) -> None:
    async with app(make_orc) as orc:

        async def submit(tenant: str | None, script: list[str]) -> SubmitResult:
            spec = JobSpec(job_type="scripted", payload={"script": script}, job_key="report",
                           job_key_mode=mode, tenant_id=tenant)  # fmt: skip
            (result,) = await orc.submit_specs([spec])
            return result

        acme = await submit("acme", ["ok"])
        globex = await submit("globex", ["app", "ok"])
        nobody = await submit(None, ["infra", "ok"])
        # One batch naming the key in three scopes: each finds its own scope's job.
        batch = await orc.submit_specs(
            [JobSpec(job_type="scripted", payload={"script": ["ok"]}, job_key="report",
                     job_key_mode=mode, tenant_id=tenant)
             for tenant in ("globex", None, "initech")]
        )  # fmt: skip
        again = await submit("acme", ["app", "app", "ok"])
        jobs = {j.id: j for j in await orc.list_jobs()}
    assert [r.outcome for r in (acme, globex, nobody)] == ["created"] * 3
    assert len({acme.job_id, globex.job_id, nobody.job_id}) == 3
    kept = "deduplicated" if mode == "unsafe_dedupe" else "replaced"
    assert [(r.job_id, r.outcome) for r in batch[:2]] == [
        (globex.job_id, kept), (nobody.job_id, kept)
    ]  # fmt: skip
    assert batch[2].outcome == "created"
    assert (again.job_id, again.outcome) == (acme.job_id, kept)  # within the tenant: one job
    acme_job = jobs[acme.job_id]
    assert (acme_job.tenant_id, acme_job.job_key, acme_job.revision) == ("acme", "report", 1)
    expected = ["app", "app", "ok"] if mode != "unsafe_dedupe" else ["ok"]
    assert acme_job.payload == {"script": expected}  # only its own tenant's submit touched it
    assert {(j.tenant_id, j.job_key) for j in jobs.values()} == {
        ("acme", "report"), ("globex", "report"), (None, "report"), ("initech", "report")
    }  # fmt: skip


async def test_a_running_job_keeps_its_key_when_another_tenant_submits_it(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc = app(make_orc)
    async with WorkerRun(orc) as worker:
        running = await orc.submit("scripted", {"script": ["block"]}, job_key="k", tenant_id="a")

        async def started() -> bool:
            return (await orc.get_job(running)).status is Status.RUNNING

        await wait_for(started)
        other = await orc.submit("scripted", {"script": ["ok"]}, job_key="k", tenant_id="b")
        kept = await orc.get_job(running)
        scripted.RELEASE.setdefault(running, asyncio.Event()).set()
        await worker.until_finished(running, other)
    assert other != running
    assert (kept.job_key, kept.tenant_id) == ("k", "a")  # not revoked: b has a key of its own
    assert [e.kind for e in await orc.job_events(running)].count("job.key_revoked") == 0


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


# -- through the API ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(dsn: str) -> Iterator[ApiServer]:
    with ApiServer(dsn) as running:
        yield running


@pytest.fixture
async def tenants(
    make_orc: Callable[..., Orchestrator], server: ApiServer
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    """Clients of two tenants' tokens, ``a`` and ``b``, each limited to its own tenant."""
    async with app(make_orc) as orc:
        secrets = [
            await token(orc.stores.tokens, f"tenant-{t}", Scope.READ, Scope.SUBMIT, tenants=[t])
            for t in "ab"
        ]
    clients = [
        httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {s}"})
        for s in secrets
    ]
    async with clients[0] as a, clients[1] as b:
        yield a, b


def _keyed(script: list[str], key: str, mode: str) -> dict[str, Any]:
    return {"job_type": "scripted", "payload": {"script": script}, "job_key": key,
            "job_key_mode": mode}  # fmt: skip


async def _submitted(client: httpx.AsyncClient, spec: dict[str, Any], batch: bool) -> Any:
    if batch:
        response = await client.post("/api/v1/jobs/batch", json={"jobs": [spec]})
        assert response.status_code == 201, response.text
        return response.json()["jobs"][0]
    response = await client.post("/api/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    return response.json()


@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
@pytest.mark.parametrize("mode", ["replace", "unsafe_dedupe"])
async def test_another_tenant_s_key_makes_its_own_job_and_leaves_the_first_alone(
    tenants: tuple[httpx.AsyncClient, httpx.AsyncClient], mode: str, batch: bool
) -> None:
    a, b = tenants
    first = await _submitted(a, _keyed(["ok"], "report", mode), batch=False)
    seen = (await a.get(f"/api/v1/jobs/{first['job_id']}")).json()
    second = await _submitted(b, _keyed(["app", "ok"], "report", mode), batch)
    assert second["outcome"] == "created" and second["job_id"] != first["job_id"]
    mine = await a.get(f"/api/v1/jobs/{first['job_id']}")
    assert mine.status_code == 200, mine.text
    assert mine.json() == seen  # a's job, untouched: its tenant, payload, revision, schedule
    assert (seen["tenant_id"], seen["payload"]) == ("a", {"script": ["ok"]})
    theirs = (await b.get(f"/api/v1/jobs/{second['job_id']}")).json()
    assert (theirs["tenant_id"], theirs["payload"]) == ("b", {"script": ["app", "ok"]})
    assert (await b.get(f"/api/v1/jobs/{first['job_id']}")).status_code == 404
    for client, own in ((a, first), (b, second)):  # a key filter shows the tenant's own job
        listed = (await client.get("/api/v1/jobs", params={"job_key": "report"})).json()
        assert [j["id"] for j in listed["jobs"]] == [own["job_id"]]
    again = await _submitted(a, _keyed(["ok"], "report", mode), batch)
    assert again["job_id"] == first["job_id"]  # within a tenant, the key still names one job


@pytest.mark.parametrize("mode", ["replace", "unsafe_dedupe"])
async def test_an_idempotency_key_is_the_tenant_s_own(
    tenants: tuple[httpx.AsyncClient, httpx.AsyncClient], mode: str
) -> None:
    a, b = tenants
    spec = {"job_type": "scripted", "payload": {"script": ["ok"]}}
    key = {"Idempotency-Key": "order-17"}
    first = (await a.post("/api/v1/jobs", json=spec, headers=key)).json()
    seen = (await a.get(f"/api/v1/jobs/{first['job_id']}")).json()
    assert seen["job_key"] == "idempotency/a/order-17"  # docs/api.md: idempotency/<tenant>/K
    # b names a's idempotent job by its job key, and sends the same Idempotency-Key.
    named = await _submitted(b, _keyed(["app", "ok"], seen["job_key"], mode), batch=False)
    same_header = (await b.post("/api/v1/jobs", json=spec, headers=key)).json()
    assert (named["outcome"], same_header["outcome"]) == ("created", "created")
    assert first["job_id"] not in (named["job_id"], same_header["job_id"])
    retried = await a.post("/api/v1/jobs", json=spec, headers=key)
    assert retried.status_code == 201, retried.text
    assert retried.json() == {"job_id": first["job_id"], "outcome": "deduplicated"}
    after = (await a.get(f"/api/v1/jobs/{first['job_id']}")).json()
    moved = {"revision": seen["revision"] + 1, "updated_at": after["updated_at"]}
    assert after == {**seen, **moved}  # a's job: only the dedupe's revision moved
    assert (after["tenant_id"], after["payload"]) == ("a", {"script": ["ok"]})
