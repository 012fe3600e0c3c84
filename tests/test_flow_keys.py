"""A flow key from its limit's template, one rule in one home (docs/flow-control.md, "The key"):
the database's ``orc_flow_key_v1``, held equal to its model (tests/support/flow_keys.py) over
random templates and payloads; a submit refused in its statement when its payload lacks a field
the template names (from Python and from Graphile Worker's SQL API), naming it, nothing written;
a job that comes to its claim without its key gets it there, or fails for good rather than run
under another key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.types.json import Jsonb

from orchestrator import JobContext, Orchestrator, Status
from orchestrator.domain.errors import ConfigError, InvalidPayload
from orchestrator.interfaces.api.app import create_api
from tests.support.flow_keys import FlowKeyError, render_key
from tests.support.harness import WorkerRun, config_with, wait_for

#: A job type whose key names a field two objects deep, which its payloads need not hold.
CONFIG = """
[limits.per_user]
key = "user:{payload.user.id}/{tenant}"
concurrency = 1

[job_types.keyed]
limit = "per_user"
"""

FIELDS = ("a", "b", "n")


def keyed_app(
    make_orc: Callable[..., Orchestrator], *, limits: bool, **settings: Any
) -> Orchestrator:
    if limits:
        settings["retry_config"] = config_with(CONFIG)
    orc = make_orc(**settings)
    orc.ran = []  # type: ignore[attr-defined]

    @orc.job_type("keyed")
    async def keyed(ctx: JobContext, payload: Any) -> None:
        orc.ran.append(payload)  # type: ignore[attr-defined]

    return orc


scalars = st.one_of(
    st.integers(-(10**12), 10**12), st.text("xyz:-/ ", max_size=8), st.booleans(), st.none()
)
payloads = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=2), st.dictionaries(st.sampled_from(FIELDS), inner, max_size=3)
    ),
    max_leaves=6,
)
placeholders = st.one_of(
    st.sampled_from(["{job_type}", "{tenant}", "{agent}"]),
    st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3).map(
        lambda path: "{payload." + ".".join(path) + "}"
    ),
)
templates = st.lists(
    st.one_of(placeholders, st.text("kx:/- ", min_size=1, max_size=70)), min_size=1, max_size=5
).map("".join)
names = st.one_of(st.none(), st.just(""), st.text("tn-", min_size=1, max_size=6))


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(templates, names, names, payloads)
def test_the_database_renders_and_refuses_a_key_as_its_model_does(
    dsn: str, template: str, tenant: str | None, agent: str | None, payload: Any
) -> None:
    try:
        expected: str | None = render_key(
            template, job_type="kind", tenant_id=tenant, agent_id=agent, payload=payload
        )
        refused = None
    except FlowKeyError as exc:
        expected, refused = None, str(exc)
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            (got,) = conn.execute(
                "SELECT orc_flow_key_v1(%s, 'kind', %s, %s, %s)",
                (template, tenant, agent, Jsonb(payload)),
            ).fetchone() or (None,)
            assert (got, None) == (expected, refused)
        except psycopg.Error as exc:
            assert exc.sqlstate == "ORCFK", exc
            assert (exc.diag.message_primary, exc.diag.message_detail) == (refused, "kind")
            assert expected is None


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        (
            {"x": 1},
            "the flow key 'user:{payload.user.id}/{tenant}' needs payload.user.id, which is missing",
        ),
        ({"user": ["id"]}, "needs payload.user.id, which is missing"),
        ({"user": {"id": {"v": 1}}}, "needs payload.user.id to be a string or number"),
        ({"user": {"id": "u" * 200}}, "the flow key is 207 characters long, over 200"),
    ],
    ids=["missing", "not-an-object", "not-a-scalar", "too-long"],
)
async def test_a_submit_its_key_cannot_be_rendered_for_is_refused_naming_why(
    make_orc: Callable[..., Orchestrator],
    db: psycopg.AsyncConnection[Any],
    payload: Any,
    says: str,
) -> None:
    """Refused by the submit's statement, the batch with it: nothing is written, and a caller's
    own transaction goes on (only the submit's savepoint rolled back)."""
    orc = keyed_app(make_orc, limits=True)
    await orc.open()
    with pytest.raises(InvalidPayload) as raised:
        await orc.submit_many([{"job_type": "keyed", "payload": {"user": {"id": 1}}},
                               {"job_type": "keyed", "payload": payload}])  # fmt: skip
    assert str(raised.value).startswith("invalid payload for job type 'keyed': the flow key ")
    assert says in str(raised.value)
    assert await orc.list_jobs() == []
    async with db.transaction():
        with pytest.raises(InvalidPayload):
            await orc.submit("keyed", payload, tenant_id="t", connection=db)
        job_id = await orc.submit("keyed", {"user": {"id": 7}}, tenant_id="t", connection=db)
    assert (await orc.get_job(job_id)).flow_key == "user:7/t"


async def test_graphile_workers_add_job_renders_the_key_at_submit_or_refuses_it(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc = keyed_app(make_orc, limits=True, graphile_compat=True, graphile_tenant="acme")
    await orc.migrate()
    try:
        async with WorkerRun(orc) as run:  # (it writes which limit its job types run under)

            async def limited() -> bool:
                cur = await db.execute("SELECT limit_name FROM orc_flow_job_types")
                return await cur.fetchall() == [("per_user",)]

            await wait_for(limited, timeout=10)
            with pytest.raises(psycopg.Error) as raised:
                await db.execute("SELECT graphile_worker.add_job('keyed', '{\"x\": 1}')")
            assert raised.value.sqlstate == "ORCFK"
            assert "needs payload.user.id, which is missing" in str(raised.value)
            assert await orc.list_jobs() == []
            await db.execute("SELECT graphile_worker.add_job('keyed', '{\"user\": {\"id\": 5}}')")
            [job] = await orc.list_jobs()
            await run.until_finished(job.id)
    finally:
        await make_orc().migrate()  # the API removed again
    assert job.flow_key == "user:5/acme"  # rendered at submit, before any claim
    assert orc.ran == [{"user": {"id": 5}}]  # type: ignore[attr-defined]


async def test_a_job_that_came_without_its_key_gets_it_at_its_claim_or_fails_naming_the_field(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    """Submitted by a producer whose config has no limit for its type: the claim renders its key
    by the submit's rule; one whose payload lacks the field never runs (under any key): it
    fails for good, FLOW_KEY_INVALID, dead-lettered, its dispatch ended."""
    producer = keyed_app(make_orc, limits=False)
    await producer.open()
    good = await producer.submit("keyed", {"user": {"id": 3}})
    bad = await producer.submit("keyed", {"x": 1})
    assert {(await producer.get_job(j)).flow_key for j in (good, bad)} == {None}
    orc = keyed_app(make_orc, limits=True)
    async with WorkerRun(orc) as run:
        await run.until_finished(good, bad)
    assert orc.ran == [{"user": {"id": 3}}]  # type: ignore[attr-defined]
    assert (await orc.get_job(good)).flow_key == "user:3/-"
    failed = await orc.get_job(bad)
    assert (failed.status, failed.flow_key, failed.attempt) == (Status.FAILED, None, 0)
    assert failed.last_error is not None
    assert failed.last_error.code == "FLOW_KEY_INVALID"
    assert failed.last_error.message == (
        "the flow key 'user:{payload.user.id}/{tenant}' needs payload.user.id, which is missing"
    )
    assert [e.kind for e in await orc.job_events(bad)] == [
        "job.created", "job.dead_lettered", "job.failed",
    ]  # fmt: skip
    [letter] = await orc.dead_letters()
    assert letter.job_id == bad

    async def no_dispatch() -> bool:
        cur = await db.execute(
            "SELECT count(*) FROM procrastinate_jobs WHERE status <> 'succeeded'"
        )
        return (await cur.fetchone()) == (0,)

    await wait_for(no_dispatch, timeout=10)


async def test_a_schedule_whose_run_lacks_its_key_s_field_stops_serve_at_start_up(
    make_orc: Callable[..., Orchestrator],
) -> None:
    """``serve`` runs the schedules too: its start-up refuses the same schedule, naming it,
    before it answers anything."""
    orc = keyed_app(make_orc, limits=True)
    orc.schedule("broken", "keyed", cron="* * * * *", payload={"x": 1})
    app = create_api(orc)
    with pytest.raises(ConfigError, match="schedule 'broken': invalid payload"):
        async with app.router.lifespan_context(app):
            pass


async def test_a_schedule_whose_run_lacks_its_key_s_field_stops_a_worker_at_start_up(
    make_orc: Callable[..., Orchestrator],
) -> None:
    """As an unknown job type is (before the database is open), a schedule's payload that lacks
    what its limit's key names is refused at start-up, once the database can render the key,
    naming the schedule; a schedule whose payload holds it passes."""
    orc = keyed_app(make_orc, limits=True)
    orc.schedule("fine", "keyed", cron="* * * * *", payload={"user": {"id": 1}})
    orc.schedule("broken", "keyed", cron="* * * * *", payload={"x": 1})
    await orc.open()
    with pytest.raises(ConfigError) as raised:
        await orc.run_worker(wait=False, install_signal_handlers=False)
    assert str(raised.value) == (
        "orc.schedule: schedule 'broken': invalid payload for job type 'keyed': the flow key"
        " 'user:{payload.user.id}/{tenant}' needs payload.user.id, which is missing"
    )
