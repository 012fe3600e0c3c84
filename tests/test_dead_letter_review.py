"""Dead-letter review at scale (docs/operations.md, "Dead letters"): the open letters by
default, filters by job type, tenant and error, and bulk requeue and discard, through a real
``orchestrator serve`` (HTTP) and the real CLI (a process): tenant-scoped (another tenant's
token sees, touches and counts none of the other's letters), the two-person rule per letter,
and each bulk call bounded (``more``: the rest is left for the next call)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import psycopg
import pytest

from orchestrator import Orchestrator
from orchestrator.client import AsyncClient
from orchestrator.domain.dead_letters import BULK_MAX
from orchestrator.domain.principals import Scope
from orchestrator.facade import actions
from tests.support.api_server import APP, ROOT, ApiServer, api_orchestrator, token
from tests.support.letters import error_of, plant

OK = {"script": ["ok"]}


@pytest.fixture(scope="module")
def server(dsn: str) -> Iterator[ApiServer]:
    with ApiServer(dsn) as running:
        yield running


@pytest.fixture
async def orc(make_orc: Callable[..., Orchestrator]) -> Orchestrator:
    return await api_orchestrator(make_orc)


async def plant_both(orc: Orchestrator, db: psycopg.AsyncConnection[Any]) -> dict[str, str]:
    """Tenant a: two scripted letters (HTTP 400, one requeued already) and an external one
    (a timeout); tenant b: a scripted letter (HTTP 400)."""
    bad, slow = (
        error_of("HTTP_400", "400 Bad Request", "PERMANENT"),
        error_of("TIMEOUT", "the deadline passed", "TRANSIENT_INFRA"),
    )
    letters = {
        "a_bad": await plant(orc, db, "a", "scripted", bad, OK),
        "a_done": await plant(orc, db, "a", "scripted", bad, OK),
        "a_slow": await plant(orc, db, "a", "external_echo", slow, {"output": 1}),
        "b_bad": await plant(orc, db, "b", "scripted", bad, OK),
    }
    await orc.requeue_dead_letter(letters["a_done"])
    return letters


def client(server: ApiServer, secret: str) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {secret}"}
    return httpx.AsyncClient(base_url=server.url, headers=headers, timeout=30)


async def listed(http: httpx.AsyncClient, **params: str) -> set[str]:
    answer = await http.get("/api/v1/dead-letters", params=params)
    assert answer.status_code == 200, answer.text
    return {letter["id"] for letter in answer.json()["dead_letters"]}


async def test_open_letters_by_default_and_filters_by_type_tenant_and_error(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any], server: ApiServer
) -> None:
    ids = await plant_both(orc, db)
    admin = await token(orc.stores.tokens, "review-admin", Scope.READ)
    of_a = await token(orc.stores.tokens, "review-a", Scope.READ, tenants=["a"])
    async with client(server, admin) as http, client(server, of_a) as a:
        open_ = {ids["a_bad"], ids["a_slow"], ids["b_bad"]}
        assert await listed(http) == open_  # the requeued one is reviewed: not listed
        assert await listed(http, state="all") == {*open_, ids["a_done"]}
        assert await listed(http, state="requeued") == {ids["a_done"]}
        assert await listed(http, job_type="external_echo") == {ids["a_slow"]}
        assert await listed(http, tenant_id="b") == {ids["b_bad"]}
        assert await listed(http, error="bad req") == {ids["a_bad"], ids["b_bad"]}  # any case
        assert await listed(http, error="timeout") == {ids["a_slow"]}  # its code
        assert await listed(http, error="transient") == {ids["a_slow"]}  # its class
        assert await listed(http, error="bad", tenant_id="a", state="all") == {
            ids["a_bad"], ids["a_done"],
        }  # fmt: skip
        bad = await http.get("/api/v1/dead-letters", params={"state": "reviewed"})
        assert bad.status_code == 422 and "state" in bad.text
        # another tenant's token: none of b's, whatever it asks for
        assert await listed(a) == {ids["a_bad"], ids["a_slow"]}
        assert await listed(a, tenant_id="b") == set()
        assert await listed(a, state="all", error="bad") == {ids["a_bad"], ids["a_done"]}
    assert [d.id for d in await orc.dead_letters(state="open", error="TRANSIENT_INFRA")] == [
        uuid.UUID(ids["a_slow"])
    ]


async def test_a_bulk_requeue_takes_only_the_caller_s_tenants_letters(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any], server: ApiServer
) -> None:
    ids = await plant_both(orc, db)
    of_b = await token(orc.stores.tokens, "review-b", Scope.READ, Scope.OPERATE, tenants=["b"])
    of_a = await token(orc.stores.tokens, "review-a", Scope.READ, Scope.OPERATE, tenants=["a"])
    async with client(server, of_b) as b, client(server, of_a) as a:
        # b names a's letters by id: not found, as an id that does not exist; nothing done
        unknown = str(uuid.uuid4())
        given = [ids["a_bad"], ids["a_slow"], unknown]
        answer = await b.post("/api/v1/dead-letters/requeue", json={"dead_letter_ids": given})
        assert answer.status_code == 200, answer.text
        review = answer.json()
        assert [o["outcome"] for o in review["outcomes"]] == ["not_found"] * 3
        assert {o["detail"] for o in review["outcomes"]} == {
            f"no dead letter with id {i}" for i in given
        }
        assert (review["done"], review["refused"], review["more"]) == (0, 3, False)
        # ... or by a filter naming a's tenant: none matches, and no count reveals a's
        for body in ({"tenant_id": "a"}, {"job_type": "external_echo"}):
            answer = await b.post("/api/v1/dead-letters/requeue", json=body)
            assert answer.json() == {"outcomes": [], "more": False, "done": 0, "refused": 0}
        for action in ("discard-confirm", "discard-request"):
            answer = await b.post(
                f"/api/v1/dead-letters/{action}", json={"tenant_id": "a", "reason": "not mine"}
                if action == "discard-request" else {"dead_letter_ids": [ids["a_bad"]]},
            )  # fmt: skip
            assert answer.json()["done"] == 0 and ids["a_slow"] not in answer.text
        assert {d.state for d in await orc.dead_letters(tenant_id="a")} == {"recorded", "requeued"}

        # a's own: every open letter of a's matching (none given: all), each its new job
        answer = await a.post("/api/v1/dead-letters/requeue", json={})
        review = answer.json()
        assert {o["dead_letter_id"] for o in review["outcomes"]} == {ids["a_bad"], ids["a_slow"]}
        assert {o["outcome"] for o in review["outcomes"]} == {"requeued"}
        assert review["done"] == 2 and ids["b_bad"] not in answer.text
        for outcome in review["outcomes"]:
            job = await orc.get_job(outcome["job_id"])
            assert (job.tenant_id, job.replay_of) == ("a", uuid.UUID(outcome["dead_letter_id"]))
        # given again by id: refused, each saying why
        again = await a.post(
            "/api/v1/dead-letters/requeue", json={"dead_letter_ids": [ids["a_bad"]]}
        )
        [outcome] = again.json()["outcomes"]
        assert outcome["outcome"] == "refused" and "already requeued" in outcome["detail"]
    assert (await orc.dead_letter(ids["b_bad"])).state == "recorded"


async def test_a_bulk_discard_takes_two_people_letter_by_letter(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any], server: ApiServer
) -> None:
    ids = await plant_both(orc, db)
    alice = await token(orc.stores.tokens, "alice", Scope.OPERATE)
    bob = await token(orc.stores.tokens, "bob", Scope.OPERATE)
    of_b = await token(orc.stores.tokens, "bob-of-b", Scope.OPERATE, tenants=["b"])
    async with client(server, alice) as a, client(server, bob) as b, client(server, of_b) as bb:
        no_reason = await a.post("/api/v1/dead-letters/discard-request", json={})
        assert no_reason.status_code == 422 and "reason" in no_reason.text
        asked = await a.post(
            "/api/v1/dead-letters/discard-request",
            json={"job_type": "scripted", "reason": "the customer is gone"},
        )
        review = asked.json()
        assert {o["dead_letter_id"] for o in review["outcomes"]} == {ids["a_bad"], ids["b_bad"]}
        assert review["done"] == 2
        # the requester cannot confirm its own requests, by id or by filter
        for body in ({"dead_letter_ids": [ids["a_bad"], ids["b_bad"]]}, {}):
            alone = (await a.post("/api/v1/dead-letters/discard-confirm", json=body)).json()
            assert [o["outcome"] for o in alone["outcomes"]] == ["refused", "refused"]
            assert all("a second reviewer must confirm" in o["detail"] for o in alone["outcomes"])
        # a second person of tenant b only: b's letter, and none of a's counted
        only_b = (await bb.post("/api/v1/dead-letters/discard-confirm", json={})).json()
        assert [(o["dead_letter_id"], o["outcome"]) for o in only_b["outcomes"]] == [
            (ids["b_bad"], "discarded")
        ]
        rest = (await b.post("/api/v1/dead-letters/discard-confirm", json={})).json()
        assert [(o["dead_letter_id"], o["outcome"]) for o in rest["outcomes"]] == [
            (ids["a_bad"], "discarded")
        ]
        # bounded, and one way to choose
        too_many = {"dead_letter_ids": [str(uuid.uuid4()) for _ in range(BULK_MAX + 1)]}
        assert (await b.post("/api/v1/dead-letters/requeue", json=too_many)).status_code == 422
        both = {"dead_letter_ids": [ids["a_slow"]], "tenant_id": "a"}
        answer = await b.post("/api/v1/dead-letters/requeue", json=both)
        assert answer.status_code == 422 and "not both" in answer.text
    discarded = await orc.dead_letter(ids["a_bad"])
    assert (discarded.discard_requested_by, discarded.discarded_by) == ("token:alice", "token:bob")
    # the Python client's bulk calls: the same endpoints
    async with AsyncClient(server.url, alice) as api, AsyncClient(server.url, bob) as other:
        asked_by_client = await api.request_discards("stale", [ids["a_slow"]])
        assert [o.outcome for o in asked_by_client.outcomes] == ["discard_requested"]
        assert (await api.confirm_discards(job_type="external_echo")).refused == 1
        assert (await other.confirm_discards(job_type="external_echo")).done == 1
        assert (await other.requeue_many(tenant_id="a")).outcomes == []
    assert (await orc.dead_letter(ids["a_slow"])).state == "discarded"


async def test_a_bulk_action_takes_at_most_its_bound_and_says_more_match(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(actions, "BULK_MAX", 2)
    bad = error_of("HTTP_400", "400 Bad Request", "PERMANENT")
    planted = [await plant(orc, db, "a", "scripted", bad, OK) for _ in range(3)]
    first = await orc.requeue_dead_letters(tenant_id="a")
    assert (first.done, first.more) == (2, True)
    second = await orc.requeue_dead_letters(tenant_id="a")
    assert (second.done, second.more) == (1, False)
    taken = [o.dead_letter_id for o in [*first.outcomes, *second.outcomes]]
    assert sorted(map(str, taken)) == sorted(planted)
    with pytest.raises(ValueError, match="ids: at most 2 letters a call"):
        await orc.requeue_dead_letters(planted)
    with pytest.raises(ValueError, match="ids: give the letters' ids or filters, not both"):
        await orc.requeue_dead_letters(planted[:1], tenant_id="a")


def cli(dsn: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``orchestrator dlq ...`` as an operator runs it: a real process."""
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "--app", APP, "dlq", *argv],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
        env={**os.environ, "DATABASE_URL": dsn},
    )  # fmt: skip


def letter_ids(listing: str) -> set[str]:
    """The letters a listing names: each row's first column (what is not a row, a header say,
    names none)."""
    found = set()
    for line in listing.splitlines():
        with contextlib.suppress(ValueError, IndexError):
            found.add(str(uuid.UUID(line.split()[0])))
    return found


def refused(done: subprocess.CompletedProcess[str], said: str) -> None:
    assert (done.returncode, done.stdout) == (2, ""), done
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert said in done.stderr, done.stderr


async def test_the_cli_filters_and_acts_in_bulk(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any], dsn: str
) -> None:
    ids = await plant_both(orc, db)
    listed = cli(dsn, "list")
    assert listed.returncode == 0
    assert letter_ids(listed.stdout) == {ids["a_bad"], ids["a_slow"], ids["b_bad"]}
    listed = cli(dsn, "list", "--state", "all", "--type", "scripted", "--tenant", "a")
    assert letter_ids(listed.stdout) == {ids["a_bad"], ids["a_done"]}
    assert letter_ids(cli(dsn, "list", "--error", "TIMEOUT").stdout) == {ids["a_slow"]}
    cut = cli(dsn, "list", "--limit", "1")
    assert len(letter_ids(cut.stdout)) == 1 and "the first 1 shown" in cut.stderr
    assert cli(dsn, "list", "--tenant", "c").stderr == "no open dead letters for tenant c\n"

    # a dead job's id given for its letter's: the letter's id to use
    job_id = str((await orc.dead_letter(ids["a_bad"])).job_id)
    refused(cli(dsn, "requeue", job_id), f"its dead letter is {ids['a_bad']}")
    refused(cli(dsn, "requeue"), "give one or more dead letter ids, or --all-matching")
    refused(cli(dsn, "requeue", "--type", "scripted"), "with --all-matching")
    refused(cli(dsn, "requeue", ids["a_bad"], "--all-matching"), "not both")

    # several ids: each letter's outcome, then how many; one refused: exit 1
    both = cli(dsn, "requeue", ids["a_bad"], ids["a_done"])
    assert both.returncode == 1, both
    lines = both.stdout.splitlines()
    assert lines[0].startswith(f"{ids['a_bad']}  requeued as job ")
    assert lines[1].startswith(f"{ids['a_done']}  dead letter {ids['a_done']} is already")
    assert lines[2] == "requeued: 1 of 2 dead letters, 1 refused or not found"

    # every open letter of a filter: a discard requested, then confirmed by another person
    asked = cli(dsn, "discard", "--all-matching", "--tenant", "b", "--by", "alice", "--reason", "x")
    assert (asked.returncode, asked.stdout.splitlines()[-1]) == (
        0, "discard requested: 1 of 1 dead letter",
    )  # fmt: skip
    alone = cli(dsn, "discard", "--all-matching", "--tenant", "b", "--by", "alice")
    assert alone.returncode == 1 and "a second reviewer must confirm it" in alone.stdout
    confirmed = cli(dsn, "discard", "--all-matching", "--by", "bob")
    assert (confirmed.returncode, confirmed.stdout.splitlines()[-1]) == (
        0, "discarded: 1 of 1 dead letter",
    )  # fmt: skip
    assert (await orc.dead_letter(ids["b_bad"])).state == "discarded"
    rest = cli(dsn, "requeue", "--all-matching", "--error", "transient")
    assert rest.stdout.splitlines()[-1] == "requeued: 1 of 1 dead letter", rest
    assert cli(dsn, "requeue", "--all-matching").stderr == "no dead letter matches\n"
