"""What a token of one tenant cannot do to another tenant or to the fleet, tried as an attacker
holding it would, through a real ``orchestrator serve`` (tests/support/tenants_app.py), and
the same rules on the other paths that name the same things: the Python API, the command line
(a real process), schedules, the retry config file.

- The queues the orchestrator reserves (retry_config.names: the maintenance queue, every
  worker's one maintenance slot) take no job, from any submit path.
- A schedule's ticks are its own: no submit but the scheduler's may name a job key of the
  schedules' namespace (``schedule/<name>/<tick>``), so none can take a tick's job over.
- ``GET /api/v1/config`` and the dashboard's config page show a token limited to tenants only
  its tenants' schedules and weights.
- A tenant is never empty or blank, wherever one is named; a token stored with one before is
  limited to nothing by it.
- The dashboard's overview counts a tenant's own zombies only; a job page of a job the token
  may not see is a 404 (with the friendly page).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID, uuid4

import httpx
import psycopg
import pytest

import retry_config
from orchestrator import JobContext, Orchestrator
from orchestrator.domain import crontab
from orchestrator.domain.errors import ConfigError, InvalidArgument, SubmitError
from orchestrator.domain.principals import Scope
from orchestrator.domain.schedules import job_key
from orchestrator.facade.submit import JobRows, job_spec
from orchestrator.storage.tokens import TokenError
from tests.support import tenants_app
from tests.support.api_server import ApiServer, token, ui_session
from tests.support.harness import ROOT, config_with, wait_for
from tests.support.tenants_app import MARKERS, MINE, REPORTS, THEIRS, TICKING

APP = "tests.support.tenants_app:orc"
TICKING_APP = "tests.support.tenants_app:ticking"
FAR = "2099-01-01T00:00:00Z"
#: What the attacker asks for: the maintenance lane, ahead of everything there.
MAINTENANCE = {"queue": "maintenance", "priority": -2147483647}
OK = {"script": ["ok"]}


@pytest.fixture(scope="module")
def server(dsn: str) -> Iterator[ApiServer]:
    with ApiServer(dsn, APP) as running:
        yield running


@pytest.fixture
async def orc(make_orc: Callable[..., Orchestrator]) -> AsyncIterator[Orchestrator]:
    """The tests' side of the server (its tokens, its rows), on empty tables."""
    made = make_orc(retry_config=tenants_app.CONFIG)
    tenants_app.register(made)
    await made.open()
    yield made


class Tokens:
    """Clients of the server, each with a token of its own: ``submit_a`` / ``read_a`` limited
    to tenant-a, ``read_b`` to tenant-b, ``fleet``: every scope, every tenant."""

    def __init__(self, server: ApiServer, secrets: dict[str, str]) -> None:
        self.secrets = secrets
        self.clients = {
            name: httpx.AsyncClient(
                base_url=server.url, headers={"Authorization": f"Bearer {secret}"}, timeout=30
            )
            for name, secret in secrets.items()
        }

    def __getattr__(self, name: str) -> httpx.AsyncClient:
        return self.clients[name]


@pytest.fixture
async def tokens(orc: Orchestrator, server: ApiServer) -> AsyncIterator[Tokens]:
    store = orc.stores.tokens
    made = Tokens(
        server,
        {
            "submit_a": await token(store, "submit-a", Scope.SUBMIT, tenants=[MINE]),
            "read_a": await token(store, "read-a", Scope.READ, tenants=[MINE]),
            "read_b": await token(store, "read-b", Scope.READ, tenants=[THEIRS]),
            "submit_all": await token(store, "submit-all", Scope.SUBMIT),
            "fleet": await token(store, "fleet", Scope.ADMIN),
        },
    )
    yield made
    for client in made.clients.values():
        await client.aclose()


async def stored_jobs(db: psycopg.AsyncConnection[Any]) -> list[tuple[Any, ...]]:
    cur = await db.execute("SELECT queue, tenant_id, job_key FROM orc_jobs ORDER BY created_at")
    return await cur.fetchall()


def refused(answer: httpx.Response, *said: str) -> bool:
    """A 422 problem whose detail says each of ``said``."""
    body = answer.json() if "json" in answer.headers.get("content-type", "") else {}
    return answer.status_code == 422 and all(s in body.get("detail", "") for s in said)


def cli(dsn: str, *argv: str, app: str = APP) -> subprocess.CompletedProcess[str]:
    """``orchestrator --app APP ARGV`` as an operator runs it: a real process."""
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "--app", app, *argv],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
        env={**os.environ, "DATABASE_URL": dsn},
    )  # fmt: skip


def one_error_line(done: subprocess.CompletedProcess[str], *said: str) -> None:
    """Exit 2, nothing on stdout, and one ``error:`` line saying each of ``said``."""
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr
    for text in said:
        assert text in done.stderr, done.stderr


# -- 1. the maintenance queue ------------------------------------------------------------------


async def test_no_submit_over_http_goes_on_the_maintenance_queue(
    tokens: Tokens, db: psycopg.AsyncConnection[Any]
) -> None:
    one = {"job_type": "scripted", "payload": OK, **MAINTENANCE}
    for client in (tokens.submit_a, tokens.submit_all, tokens.fleet):
        answer = await client.post("/api/v1/jobs", json=one)
        assert refused(answer, "queue", "'maintenance' is reserved"), answer.text
        with_key = await client.post("/api/v1/jobs", json=one, headers={"Idempotency-Key": "k"})
        assert refused(with_key, "'maintenance' is reserved"), with_key.text
        batch = {"jobs": [{"job_type": "scripted", "payload": OK}, one]}  # one bad: none stored
        answer = await client.post("/api/v1/jobs/batch", json=batch)
        assert refused(answer, "jobs.1.queue", "'maintenance' is reserved"), answer.text
    assert await stored_jobs(db) == []
    fine = await tokens.submit_a.post(
        "/api/v1/jobs", json={"job_type": "scripted", "payload": OK, "queue": "maintenance-2"}
    )
    assert fine.status_code == 201, fine.text  # a queue of another name is anyone's
    assert await stored_jobs(db) == [("maintenance-2", MINE, None)]


async def test_no_other_path_puts_a_job_on_the_maintenance_queue(
    orc: Orchestrator, dsn: str, db: psycopg.AsyncConnection[Any], tmp_path: Any
) -> None:
    with pytest.raises(SubmitError, match="queue: Value error, queue 'maintenance' is reserved"):
        await orc.submit("scripted", OK, queue="maintenance", tenant_id=MINE)
    with pytest.raises(SubmitError, match="'maintenance' is reserved"):
        await orc.submit_many([{"job_type": "scripted", "payload": OK, "queue": "maintenance"}])
    submitted = cli(dsn, "submit", "scripted", "--payload", '{"script": ["ok"]}',
                    "--queue", "maintenance")  # fmt: skip
    one_error_line(submitted, "queue", "'maintenance' is reserved")
    # A schedule naming it: in code, in the retry config file.
    with pytest.raises(ConfigError, match="'maintenance' is reserved"):
        orc.schedule("nightly", "scripted", cron="0 0 * * *", queue="maintenance")
    with pytest.raises(ConfigError, match="tab:1: schedule 'scripted': queue: queue 'maint"):
        crontab.parse("0 0 * * * scripted ?queue=maintenance", "tab")
    scheduled = '[job_types.scripted]\nschedule = { cron = "0 0 * * *", queue = "maintenance" }\n'
    with pytest.raises(retry_config.ConfigError, match="'maintenance' is reserved"):
        retry_config.parse_bytes(scheduled.encode(), tmp_path / "retry.toml")
    # A job type whose queue it is: named in the file (its own table, or [defaults]), or by
    # the type's name, which is its queue unless the file names another.
    for table in ("[job_types.scripted]", "[defaults]"):
        with pytest.raises(retry_config.ConfigError, match="'maintenance' is reserved"):
            retry_config.parse_bytes(f'{table}\nqueue = "maintenance"\n'.encode(), tmp_path / "r")
    named = Orchestrator(retry_config_path=config_with())

    @named.job_type("maintenance")
    async def maintenance(ctx: JobContext, payload: Any) -> None:
        return None

    with pytest.raises(ConfigError, match="job type 'maintenance': queue 'maintenance' is res"):
        named.check_definition()
    rows = JobRows(named.job_types, named.live_config, named.settings)  # the last guard
    with pytest.raises(SubmitError, match="the queue of job type 'maintenance'"):
        rows.row(job_spec(job_type="maintenance"))
    assert await stored_jobs(db) == []


# -- 2. a schedule's ticks are its own ---------------------------------------------------------


async def test_a_submit_cannot_take_a_schedule_s_tick_over(
    make_orc: Callable[..., Orchestrator], empty_dsn: str, db: psycopg.AsyncConnection[Any]
) -> None:
    """tenant-a's submit-only token names the job key of its schedule's next ticks, with a
    payload of its own and a run_at in 2099: refused, so each tick runs its own job, and the
    schedule's last run is a job that exists."""
    orc = make_orc()
    await orc.open()
    secrets = {
        "submit_a": await token(orc.stores.tokens, "submit-a", Scope.SUBMIT, tenants=[MINE]),
        "read_a": await token(orc.stores.tokens, "read-a", Scope.READ, tenants=[MINE]),
    }
    with ApiServer(empty_dsn, TICKING_APP) as server:
        clients = Tokens(server, secrets)
        attacker, reader = clients.submit_a, clients.read_a

        async def ticking() -> dict[str, Any]:
            listed = (await reader.get("/api/v1/schedules")).json()["schedules"]
            (found,) = [s for s in listed if s["name"] == TICKING]
            return found

        async def fired() -> bool:
            return (await ticking())["last_tick"] is not None

        await wait_for(fired, timeout=20)
        now = datetime.now(UTC).replace(microsecond=0)
        ticks = [now + timedelta(seconds=s) for s in (3, 4)]
        taken = {"job_type": "scripted", "payload": {"script": ["permanent"]}, "run_at": FAR}
        for mode in ("replace", "preserve_run_at", "unsafe_dedupe"):
            spec = {**taken, "job_key": job_key(TICKING, ticks[0]), "job_key_mode": mode}
            answer = await attacker.post("/api/v1/jobs", json=spec)
            assert refused(answer, "job_key", "schedules' namespace"), answer.text
        batch = {"jobs": [{**taken, "job_key": job_key(TICKING, ticks[1])}]}
        answer = await attacker.post("/api/v1/jobs/batch", json=batch)
        assert refused(answer, "jobs.0.job_key", "schedules' namespace"), answer.text

        async def past_both() -> bool:
            last = (await ticking())["last_tick"]
            return datetime.fromisoformat(last) >= ticks[1]

        await wait_for(past_both, timeout=20)
        for tick in ticks:
            listed = await reader.get("/api/v1/jobs", params={"job_key": job_key(TICKING, tick)})
            (run,) = listed.json()["jobs"]
            assert (run["payload"], run["tenant_id"]) == (OK, MINE)
            assert datetime.fromisoformat(run["run_at"]) == tick  # the tick's, not 2099
        last = (await ticking())["last_job_id"]
        assert (await reader.get(f"/api/v1/jobs/{last}")).status_code == 200
        for client in clients.clients.values():
            await client.aclose()
    await orc.close()


async def test_no_other_path_names_a_schedule_s_job_key(
    orc: Orchestrator, dsn: str, db: psycopg.AsyncConnection[Any]
) -> None:
    key = job_key("report_a", datetime(2030, 1, 1, tzinfo=UTC))
    with pytest.raises(SubmitError, match=r"job_key: Value error, job key .* schedules' namesp"):
        await orc.submit("scripted", OK, job_key=key, tenant_id=MINE)
    with pytest.raises(SubmitError, match="schedules' namespace"):
        await orc.submit_many([{"job_type": "scripted", "job_key": "schedule/x", "payload": OK}])
    submitted = cli(dsn, "submit", "scripted", "--payload", '{"script": ["ok"]}',
                    "--job-key", key, "--tenant", MINE)  # fmt: skip
    one_error_line(submitted, "schedules' namespace")
    assert await stored_jobs(db) == []
    # The scheduler's own runs carry the key, in their schedule's tenant.
    (run,) = orc.scheduler().runs(orc.schedules["report_a"], [datetime(2030, 1, 1, tzinfo=UTC)])
    assert (run["job_key"], run["job_key_mode"], run["tenant_id"]) == (key, "unsafe_dedupe", MINE)


async def test_a_tick_whose_key_a_job_held_before_names_that_job_as_its_run(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any]
) -> None:
    """A job holding a tick's key before submits were refused those keys (or written by SQL):
    the tick's deduplicating submit returns it, and the schedule's last run names it, a job
    that exists, not the one the tick would have made."""
    orc.schedule("held", "scripted", cron="* * * * * *", payload=OK, tenant_id=MINE)
    scheduler = orc.scheduler()
    await orc.stores.schedules.sync(orc.application, scheduler.schedules.values())
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=3)
    await db.execute("UPDATE orc_schedules SET fire_after = %s WHERE name = 'held'", (start,))
    ticks = [start + timedelta(seconds=s) for s in range(1, 15)]
    rows = [
        {**row, "payload": {"script": ["permanent"]}, "run_at": FAR}
        for row in scheduler.runs(orc.schedules["held"], ticks)
    ]
    held = {
        tick: r.job_id for tick, r in zip(ticks, await orc.stores.jobs.submit(rows), strict=True)
    }
    assert (await scheduler.run_once()).fired >= 3
    (view,) = [v for v in await orc.list_schedules() if v.name == "held"]
    assert view.last_tick is not None and view.last_job_id == held[view.last_tick]
    assert (await orc.get_job(view.last_job_id)).job_key == job_key("held", view.last_tick)


# -- 3. the config a tenant reads ---------------------------------------------------------------


async def test_a_tenant_reads_its_own_schedules_and_weights_in_the_config(
    tokens: Tokens, server: ApiServer
) -> None:
    mine = await tokens.read_a.get("/api/v1/config")
    assert mine.status_code == 200, mine.text
    types, limits = mine.json()["job_types"], mine.json()["limits"]
    assert types[REPORTS[MINE]]["schedule"]["tenant_id"] == MINE
    assert types[REPORTS[MINE]]["schedule"]["payload"] == {"marker": MARKERS[MINE]}
    assert types[REPORTS[THEIRS]]["schedule"] is None  # another tenant's
    assert types[REPORTS[None]]["schedule"] is None  # no tenant's: a fleet token's only
    assert limits["shared"]["weights"] == {MINE: 2}
    assert mine.json()["token_budgets"].keys() == {MINE}
    for hidden in (THEIRS, MARKERS[THEIRS], MARKERS[None]):
        assert hidden not in mine.text
    theirs = (await tokens.read_b.get("/api/v1/config")).json()
    assert theirs["limits"]["shared"]["weights"] == {THEIRS: 3}
    assert MINE not in str(theirs) and MARKERS[MINE] not in str(theirs)
    everything = (await tokens.fleet.get("/api/v1/config")).json()
    assert everything["limits"]["shared"]["weights"] == {MINE: 2, THEIRS: 3}
    for tenant, report in REPORTS.items():
        schedule = everything["job_types"][report]["schedule"]
        assert (schedule["tenant_id"], schedule["payload"]) == (tenant, {"marker": MARKERS[tenant]})
    # The dashboard's config page, by the same rule.
    with ui_session(server, tokens.secrets["read_a"]) as (browser, _):
        page = browser.get("/ui/config")
        assert page.status_code == 200 and f"{MINE} \u00d72" in page.text
        assert THEIRS not in page.text
    with ui_session(server, tokens.secrets["fleet"]) as (browser, _):
        page = browser.get("/ui/config")
        assert f"{MINE} \u00d72" in page.text and f"{THEIRS} \u00d73" in page.text


async def test_a_tenant_reads_its_own_schedules_weights_and_unserved_jobs_of_the_applications(
    tokens: Tokens, orc: Orchestrator, db: psycopg.AsyncConnection[Any], server: ApiServer
) -> None:
    """GET /api/v1/applications and the dashboard's applications page, by the rule of /config:
    what names a tenant (a schedule, a limit's weight, a job waiting unserved) only for the
    token's tenants."""

    # The application's limits and schedules declared (as the server does as it starts: the
    # tables were emptied since), a schedule of each tenant and one of none.
    await orc.stores.flow.sync(orc.retry_config, orc.application)
    await orc.stores.schedules.sync(orc.application, orc.schedules.values())
    # Jobs of a type no live application declares: one of each tenant's.
    await db.execute(
        "INSERT INTO orc_application_definitions (kind, name, application, definition) "
        "VALUES ('job_type', 'gone_type', 'gone', '{}')"
    )
    await db.execute(
        "INSERT INTO orc_jobs (id, job_type, status, payload, queue, tenant_id, run_at, "
        "                     max_attempts, max_retries, trace_id) "
        "SELECT gen_random_uuid(), 'gone_type', 'PENDING', '{}', 'gone_type', t, now(), 3, 3, "
        "       md5(t) "
        "FROM unnest(ARRAY[%s, %s, %s]) AS t",
        (MINE, THEIRS, THEIRS),
    )
    mine = await tokens.read_a.get("/api/v1/applications")
    assert mine.status_code == 200, mine.text
    (app,) = [a for a in mine.json()["applications"] if a["name"] == "default"]
    assert app["schedules"] == [REPORTS[MINE]]
    (shared,) = [limit for limit in app["limits"] if limit["name"] == "shared"]
    assert shared["definition"]["weights"] == {MINE: 2}
    assert mine.json()["unserved"] == [
        {"job_type": "gone_type", "pending": 1, "retry": 0, "due": 1, "queues": ["gone_type"]}
    ]
    assert THEIRS not in mine.text and MARKERS[THEIRS] not in mine.text
    everything = (await tokens.fleet.get("/api/v1/applications")).json()
    (app,) = [a for a in everything["applications"] if a["name"] == "default"]
    assert sorted(app["schedules"]) == sorted(REPORTS.values())
    assert everything["unserved"] == [
        {"job_type": "gone_type", "pending": 3, "retry": 0, "due": 3, "queues": ["gone_type"]}
    ]
    # The dashboard's applications page, by the same rule.
    with ui_session(server, tokens.secrets["read_a"]) as (browser, _):
        page = browser.get("/ui/applications")
        assert page.status_code == 200 and REPORTS[MINE] in page.text
        assert 'data-job-type="gone_type"><td><a href="/ui/jobs?job_type=gone_type">gone_type</a>' \
               "</td><td>1</td>" in page.text  # fmt: skip
        assert THEIRS not in page.text and REPORTS[None] not in page.text
    with ui_session(server, tokens.secrets["fleet"]) as (browser, _):
        page = browser.get("/ui/applications")
        assert all(report in page.text for report in REPORTS.values())
        assert "</td><td>3</td>" in page.text


# -- 5. a tenant is never empty or blank ------------------------------------------------------


@pytest.mark.parametrize("blank", ["", " ", "\t \n"], ids=["empty", "space", "whitespace"])
async def test_a_blank_tenant_is_refused_over_http(tokens: Tokens, blank: str) -> None:
    for client in (tokens.submit_all, tokens.fleet):
        spec = {"job_type": "scripted", "payload": OK, "tenant_id": blank}
        answer = await client.post("/api/v1/jobs", json=spec)
        assert refused(answer, "tenant_id", "a tenant cannot be"), answer.text
        answer = await client.post("/api/v1/jobs/batch", json={"jobs": [spec]})
        assert refused(answer, "jobs.0.tenant_id", "a tenant cannot be"), answer.text
    for path in ("/api/v1/jobs", "/api/v1/dead-letters", "/api/v1/usage"):
        answer = await tokens.fleet.get(path, params={"tenant_id": blank})
        assert refused(answer, "tenant_id"), f"{path}: {answer.text}"


async def test_a_token_stored_with_a_blank_tenant_reads_no_tenant_s_rows(
    orc: Orchestrator, server: ApiServer, db: psycopg.AsyncConnection[Any]
) -> None:
    """A token made before a blank tenant was refused: the rollups' rows of no tenant (tenant
    ``''``) are never its, over the API or in its dashboard session; its other tenants' are."""
    old = "tenant-old"  # a tenant of its own: the overview's cache is per set of tenants
    for tenant in ("", old):
        await db.execute(
            "INSERT INTO orc_job_rollups SELECT 60, date_trunc('minute', now())"
            " - interval '5 minutes', 'scripted', 'default', %s, 4, 0, 0, 0, 0, 0, 4,"
            " 1000, 400, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0",
            (tenant,),
        )
    for stored in ([""], ["", old], [" "]):
        secret = await token(orc.stores.tokens, "old", Scope.READ, tenants=[old])
        await db.execute("UPDATE orc_api_tokens SET tenants = %s WHERE name = 'old'", (stored,))
        async with httpx.AsyncClient(
            base_url=server.url, headers={"Authorization": f"Bearer {secret}"}
        ) as client:
            answer = await client.get("/api/v1/stats", params={"by": "tenant"})
            assert answer.status_code == 200, answer.text
            keys = [series["key"] for series in answer.json()["jobs"]]
            assert keys == ([{"tenant": old}] if old in stored else []), (stored, keys)
        with ui_session(server, secret) as (browser, _):
            overview = browser.get("/ui/fragments/overview").text
            finished = re.search(r"failed of (\d+) finished", overview)
            shown = int(finished.group(1)) if finished else None
            assert shown == (4 if old in stored else None), stored
            assert (shown is None) == ("none finished rolled up yet" in overview), stored
        await db.execute("DELETE FROM orc_api_tokens WHERE name = 'old'")


async def test_a_blank_tenant_is_refused_on_every_other_path(
    orc: Orchestrator, dsn: str, db: psycopg.AsyncConnection[Any], tmp_path: Any
) -> None:
    # The command line, as a real process: `--tenant "$UNSET"`.
    for blank in ("", "  "):
        made = cli(dsn, "tokens", "create", "ci", "--scope", "read", "--tenant", blank)
        one_error_line(made, "argument --tenant: a tenant cannot be")
        for argv in (["submit", "scripted", "--payload", '{"script": ["ok"]}'], ["jobs"],
                     ["dlq", "list"], ["stats"], ["usage"]):  # fmt: skip
            one_error_line(cli(dsn, *argv, "--tenant", blank), "a tenant cannot be")
    assert "ci" not in cli(dsn, "tokens", "list").stdout
    # The Python API.
    with pytest.raises(TokenError, match="tenant: a tenant cannot be empty"):
        await orc.stores.tokens.create("ci", [Scope.READ], ["acme", ""], by="tests")
    with pytest.raises(SubmitError, match="tenant_id: Value error, a tenant cannot be only"):
        await orc.submit("scripted", OK, tenant_id=" ")
    for read in (
        orc.list_jobs(tenant_id=""), orc.dead_letters(tenant_id=" "), orc.approvals(tenants=[""]),
        orc.stats(tenants=[" "]), orc.llm_usage(tenant_id=""), orc.list_schedules(tenants=[""]),
    ):  # fmt: skip
        with pytest.raises(InvalidArgument, match="a tenant cannot be"):
            await read
    with pytest.raises(ConfigError, match="tenant_id: a tenant cannot be only whitespace"):
        orc.schedule("nightly", "scripted", cron="0 0 * * *", tenant_id=" ")
    with pytest.raises(ConfigError, match="tab:1: schedule 'scripted': tenant_id: a tenant can"):
        crontab.parse("0 0 * * * scripted ?tenant=%20", "tab")
    # The retry config file: a schedule's tenant, a token budget's, a limit's weights.
    for table in (
        '[job_types.scripted]\nschedule = { cron = "0 0 * * *", tenant_id = " " }\n',
        '[token_budgets." "]\ntokens = 10\n',
        '[token_budgets.""]\ntokens = 10\n',
        '[limits.l]\nconcurrency = 1\nweights = { "" = 2 }\n',
    ):
        with pytest.raises(retry_config.ConfigError, match=r"names no tenant|a tenant cannot be"):
            retry_config.parse_bytes(table.encode(), tmp_path / "retry.toml")
    assert await stored_jobs(db) == []


# -- 6 and 9. the dashboard of a tenant ---------------------------------------------------------


def zombies_shown(browser: httpx.Client) -> int:
    found = re.search(
        r'<span class="n">(\d+)</span><span>zombies</span>',
        browser.get("/ui/fragments/overview").text,
    )
    assert found
    return int(found.group(1))


async def zombies_seen(server: ApiServer, secret: str, count: int) -> list[int]:
    """What the overview showed as zombies, read until it shows ``count`` (one read of the
    overview serves a set of tenants for 2 s: an earlier one may be served first)."""
    shown: list[int] = []
    with ui_session(server, secret) as (browser, _):

        async def counted() -> bool:
            shown.append(zombies_shown(browser))
            return shown[-1] == count

        await wait_for(counted, timeout=10, interval=0.5)
    return shown


async def test_a_tenant_s_overview_counts_its_own_zombies(
    tokens: Tokens, server: ApiServer, db: psycopg.AsyncConnection[Any]
) -> None:
    """Two zombies of tenant-b and one of tenant-a: tenant-a's overview shows its one."""
    ids = []
    for tenant in (THEIRS, THEIRS, MINE):
        spec = {"job_type": "scripted", "payload": OK, "tenant_id": tenant}
        ids.append((await tokens.fleet.post("/api/v1/jobs", json=spec)).json()["job_id"])
    await db.execute(
        "UPDATE orc_jobs SET status = 'RUNNING', attempt = 1, lease_token = gen_random_uuid(), "
        "locked_by = 'gone', heartbeat_at = now() - interval '1 hour' WHERE id = ANY(%s)",
        ([UUID(i) for i in ids],),
    )
    for name, count in (("read_a", 1), ("read_b", 2), ("fleet", 3)):
        shown = await zombies_seen(server, tokens.secrets[name], count)
        assert set(shown) <= {0, count}, (name, shown)  # before the zombies were made, or its own


async def test_a_job_page_a_token_may_not_see_is_a_404(tokens: Tokens, server: ApiServer) -> None:
    jobs = {}
    for tenant in (MINE, THEIRS, None):
        spec = {"job_type": "scripted", "payload": OK, "tenant_id": tenant, "run_at": FAR}
        jobs[tenant] = (await tokens.fleet.post("/api/v1/jobs", json=spec)).json()["job_id"]
    with ui_session(server, tokens.secrets["read_a"]) as (browser, _):
        for hidden in (jobs[THEIRS], jobs[None], str(uuid4())):
            page = browser.get(f"/ui/jobs/{hidden}")
            assert page.status_code == 404, (hidden, page.status_code)
            assert "<h1>Not found</h1>" in page.text and "scripted" not in page.text
            assert page.headers["content-type"].startswith("text/html")
        own = browser.get(f"/ui/jobs/{jobs[MINE]}")
        assert own.status_code == 200 and "Not found" not in own.text
    with ui_session(server, tokens.secrets["fleet"]) as (browser, _):
        for tenant in (THEIRS, None):
            assert browser.get(f"/ui/jobs/{jobs[tenant]}").status_code == 200


# -- 10. dependencies (docs/workflows.md) -----------------------------------------------------


async def test_a_tenant_cannot_depend_on_another_tenant_s_job(
    tokens: Tokens, db: psycopg.AsyncConnection[Any]
) -> None:
    # Another tenant's job is refused exactly as one that does not exist (the answer says
    # nothing of whether it does), alone or in a batch, whoever submits; nothing is stored.
    theirs = (await tokens.fleet.post("/api/v1/jobs", json={
        "job_type": "scripted", "payload": OK, "tenant_id": THEIRS, "run_at": FAR,
    })).json()["job_id"]  # fmt: skip
    before = await stored_jobs(db)
    details = {}
    for parent in (theirs, str(uuid4())):
        one = {"job_type": "scripted", "payload": OK, "depends_on": [parent]}
        answer = await tokens.submit_a.post("/api/v1/jobs", json=one)
        assert refused(answer, f"depends_on: no job {parent} of its tenant"), answer.text
        details[parent] = answer.json()["detail"].replace(parent, "ID")
        batch = {
            "jobs": [
                {"job_type": "scripted", "payload": OK},
                {**one, "depends_on": [0, {"job": parent, "on_failure": "run"}]},
            ]
        }
        answer = await tokens.submit_a.post("/api/v1/jobs/batch", json=batch)
        assert refused(answer, "job 1 of the submit", f"no job {parent}"), answer.text
        mine = {**one, "tenant_id": MINE}
        answer = await tokens.submit_all.post("/api/v1/jobs", json=mine)
        assert refused(answer, f"no job {parent}"), answer.text
    assert len(set(details.values())) == 1, details
    assert await stored_jobs(db) == before
    cur = await db.execute("SELECT has_dependants FROM orc_jobs WHERE id = %s", (theirs,))
    assert await cur.fetchone() == (False,)  # not even marked as depended on


async def test_a_tenant_s_token_sees_only_its_part_of_a_graph(
    tokens: Tokens, db: psycopg.AsyncConnection[Any]
) -> None:
    # A graph never crosses tenants (the submit and the spawn refuse it); rows planted across
    # them by hand are still not shown to another tenant's token, and a job of another tenant
    # is a 404 with all its relatives.
    async def job(tenant: str, **spec: Any) -> str:
        body = {"job_type": "scripted", "payload": OK, "tenant_id": tenant, "run_at": FAR, **spec}
        answer = await tokens.fleet.post("/api/v1/jobs", json=body)
        assert answer.status_code == 201, answer.text
        return str(answer.json()["job_id"])

    parent = await job(MINE)
    child = await job(MINE, depends_on=[parent])
    spawned = [await job(MINE), await job(MINE)]
    planted = await job(THEIRS)  # made last: children are listed in the order made
    await db.execute(
        "INSERT INTO orc_job_children (parent_id, step, key, n, child_id, cancel_with_parent)"
        " SELECT %s, 1, 'spawn1', n, c, true FROM unnest(%s::uuid[]) WITH ORDINALITY AS u (c, n)",
        (parent, [*spawned, planted]),
    )  # fmt: skip
    await db.execute(
        "INSERT INTO orc_job_dependencies (job_id, awaited_id, ord, on_failure)"
        " VALUES (%s, %s, 2, 'run')",
        (child, planted),
    )  # fmt: skip
    mine = tokens.read_a
    parents = (await mine.get(f"/api/v1/jobs/{child}/parents")).json()
    assert [p["job_id"] for p in parents["jobs"]] == [parent], parents
    children = (await mine.get(f"/api/v1/jobs/{parent}/children", params={"limit": 1})).json()
    assert [c["job_id"] for c in children["jobs"]] == spawned[:1]
    after = {"after": children["next_cursor"]}
    rest = (await mine.get(f"/api/v1/jobs/{parent}/children", params=after)).json()
    assert [c["job_id"] for c in rest["jobs"]] == spawned[1:] and rest["next_cursor"] is None
    everyone = (await tokens.fleet.get(f"/api/v1/jobs/{parent}/children")).json()
    assert [c["job_id"] for c in everyone["jobs"]] == [*spawned, planted]
    for path in (f"{parent}/children", f"{child}/parents"):
        assert (await tokens.read_b.get(f"/api/v1/jobs/{path}")).status_code == 404
