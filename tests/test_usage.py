"""Token accounting and budgets (docs/configuration.md, "Token accounting and budgets"), end to
end: the real worker runs ``llm_generate`` and ``run_agent`` against the local LLM server
(demo/llm_server.py) through the real ``anthropic`` SDK, on the real database."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import httpx
import psycopg
import pytest

import retry_config
from demo import llm_server as llm
from orchestrator import Orchestrator, Status
from orchestrator.domain.errors import InvalidArgument, SubmitError
from orchestrator.domain.principals import Scope
from orchestrator.services import archive
from orchestrator.services.fleet import FleetMetrics
from tests.support import exposition, job_types_app
from tests.support.api_server import ApiServer, page_csrf, token
from tests.support.external import MessageService, message_service
from tests.support.harness import ROOT, WorkerRun

CONFIG = ROOT / "tests" / "support" / "job_types.toml"
KEY = "sk-test-usage-0123456789"
#: A job failed for good with no escalation target configured: nobody notified, logged.
NOBODY_NOTIFIED = pytest.mark.logs_errors(r"failed; no escalation target, nobody notified")


@pytest.fixture
def model_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[llm.LocalLLM]:
    with llm.serve(api_key=KEY) as server:
        monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
        monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url)
        yield server


@pytest.fixture
def service(monkeypatch: pytest.MonkeyPatch) -> Iterator[MessageService]:
    with message_service() as svc:
        monkeypatch.setenv("TEST_MESSAGE_SERVICE_URL", svc.url)
        yield svc


def config_with_budgets(tmp_path: Path, budgets: str) -> Path:
    path = tmp_path / "retry_config.toml"
    path.write_text(CONFIG.read_text(encoding="utf-8") + "\n" + budgets, encoding="utf-8")
    return path


@pytest.fixture
def orc(make_orc: Callable[..., Orchestrator], tmp_path: Path) -> Orchestrator:
    # Tenant "capped" may spend 40 tokens a day; every other tenant has no budget.
    path = config_with_budgets(tmp_path, '[token_budgets."capped"]\ntokens = 40\nperiod = "day"\n')
    made = make_orc(retry_config=path)
    job_types_app.register(made)
    return made


def ask(model: str, text: str = "hi", *, cached: str | None = None) -> dict[str, Any]:
    content: Any = text
    if cached is not None:  # a long prefix marked for prompt caching, then the question
        content = [
            {"type": "text", "text": cached, "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": text},
        ]
    return {"model": model, "max_tokens": 64, "messages": [{"role": "user", "content": content}]}


async def run(orc: Orchestrator, *jobs: tuple[str, Any, dict[str, Any]]) -> list[UUID]:
    """Submit the jobs one after the other, each run to its end before the next is submitted."""
    ids = []
    async with WorkerRun(orc) as worker:
        for job_type, payload, options in jobs:
            job_id = await orc.submit(job_type, payload, **options)
            await worker.until_finished(job_id, timeout=20)
            ids.append(job_id)
    return ids


async def usage_rows(db: psycopg.AsyncConnection[Any]) -> list[tuple[Any, ...]]:
    cur = await db.execute(
        "SELECT job_id, attempt, tenant_id, agent_id, job_type, model, input_tokens,"
        " output_tokens, cache_read_tokens, cache_creation_tokens FROM orc_llm_usage ORDER BY id"
    )
    return await cur.fetchall()


async def test_each_call_is_recorded_for_its_job_with_its_cache_tokens(
    orc: Orchestrator, model_server: llm.LocalLLM, db: psycopg.AsyncConnection[Any]
) -> None:
    prefix = "the long shared instructions " * 5  # 20 words, cached
    first, second = await run(
        orc,
        ("llm_generate", ask("m", "one", cached=prefix), {"tenant_id": "t1", "agent_id": "a1"}),
        ("llm_generate", ask("m", "two", cached=prefix), {"tenant_id": "t1", "agent_id": "a1"}),
    )
    rows = await usage_rows(db)
    results = [(await orc.get_job(j)).result["usage"] for j in (first, second)]
    # The first call wrote the prefix to the cache, the second read it; both as the SDK saw them.
    assert [(r[8], r[9]) for r in rows] == [(0, 20), (20, 0)]
    assert [
        (r[6], r[7], r[8], r[9]) for r in rows
    ] == [  # what each job's result says, exactly
        (u["input_tokens"], u["output_tokens"], u["cache_read_input_tokens"] or 0,
         u["cache_creation_input_tokens"] or 0)
        for u in results
    ]  # fmt: skip
    assert [r[:6] for r in rows] == [
        (first, 1, "t1", "a1", "llm_generate", "m"),
        (second, 1, "t1", "a1", "llm_generate", "m"),
    ]
    usage = await orc.job_usage(first)
    assert usage.token_budget is None and len(usage.calls) == 1
    assert usage.total.total_tokens == sum(rows[0][6:10]) > 20
    assert usage.calls[0].call_id.startswith("msg_")  # the provider's message id


@NOBODY_NOTIFIED
async def test_the_usage_of_a_call_stays_when_its_attempt_then_fails(
    orc: Orchestrator, model_server: llm.LocalLLM, db: psycopg.AsyncConnection[Any]
) -> None:
    schema = {"type": "object"}  # the reply is plain text, not JSON: INVALID_OUTPUT, terminal
    (job_id,) = await run(orc, ("llm_generate", ask("m") | {"output_schema": schema}, {}))
    job = await orc.get_job(job_id)
    assert job.status is Status.FAILED and job.last_error is not None
    assert job.last_error.code == "OUTPUT_INVALID"
    rows = await usage_rows(db)
    assert len(rows) == 1 and rows[0][0] == job_id and rows[0][7] > 0  # the tokens were spent


async def test_a_failed_call_records_no_usage_and_its_retry_records_its_own(
    orc: Orchestrator, model_server: llm.LocalLLM, db: psycopg.AsyncConnection[Any]
) -> None:
    model_server.script("m", [llm.Status(429, "rate_limit_error"), llm.Text("fine now")])
    (job_id,) = await run(orc, ("llm_generate", ask("m"), {}))
    assert (await orc.get_job(job_id)).status is Status.COMPLETED
    rows = await usage_rows(db)
    assert [(r[0], r[1]) for r in rows] == [(job_id, 2)]  # the second attempt's call only


async def test_a_call_is_written_once_however_often_its_write_is_tried(
    orc: Orchestrator, model_server: llm.LocalLLM, db: psycopg.AsyncConnection[Any]
) -> None:
    (job_id,) = await run(orc, ("llm_generate", ask("m"), {}))
    usage = await orc.job_usage(job_id)
    (call,) = usage.calls
    from orchestrator.storage.usage import CallUsage

    again = CallUsage(
        job_id=job_id, call_id=call.call_id, attempt=1, tenant_id=None, agent_id=None,
        job_type="llm_generate", model="m", input_tokens=1, output_tokens=1,
        cache_read_tokens=0, cache_creation_tokens=0,
    )  # fmt: skip
    async with orc:
        assert await orc.stores.usage.record(again) is False
    assert len(await usage_rows(db)) == 1


async def test_totals_group_by_tenant_and_model_over_a_time_range(
    orc: Orchestrator, model_server: llm.LocalLLM
) -> None:
    before = datetime.now(UTC)
    ids = await run(
        orc,
        ("llm_generate", ask("m1", "a b c"), {"tenant_id": "t1", "agent_id": "x"}),
        ("llm_generate", ask("m1", "a b"), {"tenant_id": "t1", "agent_id": "y"}),
        ("llm_generate", ask("m2", "a"), {"tenant_id": "t1"}),
        ("llm_generate", ask("m1", "a b c d"), {"tenant_id": "t2"}),
        ("llm_generate", ask("m1", "z"), {}),
    )
    after = datetime.now(UTC)
    async with orc:
        totals = await orc.llm_usage(by="tenant,model", since=before, until=after)
        by_agent = await orc.llm_usage(by=["agent"], tenant_id="t1", model="m1")
        one = await orc.llm_usage(by=[], since=before)
        mine = await orc.llm_usage(by="tenant", tenants=["t2"])
        earlier = await orc.llm_usage(by="tenant", until=before)
        later = await orc.llm_usage(by="tenant", since=after)
        per_job = await orc.llm_usage(by="job", job_id=ids[0])
    got = {(t.tenant_id, t.model): (t.calls, t.input_tokens) for t in totals}
    # The echo's input is the words sent: 3 + 2 for (t1, m1).
    assert got == {("t1", "m1"): (2, 5), ("t1", "m2"): (1, 1), ("t2", "m1"): (1, 4),
                   (None, "m1"): (1, 1)}  # fmt: skip
    assert all(t.agent_id is None and t.job_id is None for t in totals)  # not grouped by
    assert {(t.agent_id, t.input_tokens) for t in by_agent} == {("x", 3), ("y", 2)}
    assert len(one) == 1 and one[0].calls == 5 and one[0].input_tokens == 11
    assert [(t.tenant_id, t.calls) for t in mine] == [("t2", 1)]
    assert earlier == [] and later == []
    assert [(t.job_id, t.calls) for t in per_job] == [(ids[0], 1)]


async def test_bad_usage_queries_are_refused_naming_the_problem(orc: Orchestrator) -> None:
    now = datetime.now(UTC)
    async with orc:
        with pytest.raises(InvalidArgument, match="cannot group usage by 'customer'"):
            await orc.llm_usage(by="tenant,customer")
        with pytest.raises(InvalidArgument, match="is not after since"):
            await orc.llm_usage(since=now, until=now - timedelta(hours=1))
        with pytest.raises(SubmitError, match="token_budget"):
            await orc.submit("llm_generate", ask("m"), token_budget=0)


@NOBODY_NOTIFIED
async def test_a_job_past_its_token_budget_fails_permanently_before_its_next_call(
    orc: Orchestrator, model_server: llm.LocalLLM, service: MessageService
) -> None:
    # run_agent asks the model once per step; the first reply alone spends the budget.
    task = {"prompt": "tell the team", "model": "agent", "tools": ["send_message"]}
    (job_id,) = await run(orc, ("run_agent", task, {"token_budget": 5}))
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    assert job.status is Status.FAILED and job.last_error is not None
    assert job.last_error.code == "TOKEN_BUDGET_EXHAUSTED"
    assert job.last_error.classification == "PERMANENT"
    assert "the job's token budget is spent" in job.last_error.message
    assert model_server.requests["agent"] == 1  # step 2's call was never made
    assert sorted(service.deliveries.values()) == [1]  # step 1's tool call was made, once
    assert job.retry_count == 0 and job.attempt == 1  # not retried
    assert [e.kind for e in events].count("job.dead_lettered") == 1
    async with orc:
        (letter,) = await orc.dead_letters()
        usage = await orc.job_usage(job_id)
    assert letter.job_id == job_id and letter.error.code == "TOKEN_BUDGET_EXHAUSTED"
    assert usage.token_budget == 5 and usage.total.total_tokens >= 5 and len(usage.calls) == 1


async def test_a_job_within_its_token_budget_completes(
    orc: Orchestrator, model_server: llm.LocalLLM
) -> None:
    (job_id,) = await run(orc, ("llm_generate", ask("m"), {"token_budget": 1_000}))
    assert (await orc.get_job(job_id)).status is Status.COMPLETED
    async with orc:
        assert (await orc.job_usage(job_id)).token_budget == 1_000


@NOBODY_NOTIFIED
async def test_a_tenant_past_its_budget_for_the_period_has_its_next_calls_refused(
    orc: Orchestrator, model_server: llm.LocalLLM
) -> None:
    long = " ".join(["word"] * 30)  # 30 input tokens, and an echo of 31 output: over 40
    first, second, other = await run(
        orc,
        ("llm_generate", ask("m", long), {"tenant_id": "capped"}),
        ("llm_generate", ask("m"), {"tenant_id": "capped"}),
        ("llm_generate", ask("m", long), {"tenant_id": "free"}),
    )
    assert (await orc.get_job(first)).status is Status.COMPLETED  # within it when it started
    refused = await orc.get_job(second)
    assert refused.status is Status.FAILED and refused.last_error is not None
    assert refused.last_error.code == "TOKEN_BUDGET_EXHAUSTED"
    assert "tenant 'capped''s token budget for this day" in refused.last_error.message
    assert refused.attempt == 1 and refused.retry_count == 0
    assert (await orc.get_job(other)).status is Status.COMPLETED  # another tenant: no budget
    assert model_server.requests["m"] == 2  # the refused job never called the model


async def test_a_jobs_usage_goes_when_retention_prunes_the_job(
    make_orc: Callable[..., Orchestrator],
    model_server: llm.LocalLLM,
    db: psycopg.AsyncConnection[Any],
    tmp_path: Path,
) -> None:
    # llm_generate's jobs go as soon as they finish; run_agent's are kept a day.
    path = config_with_budgets(tmp_path, "")
    path.write_text(
        path.read_text().replace(
            "[job_types.run_agent]\n", "[job_types.run_agent]\nretention_days = 1\n"
        )
    )
    orc = make_orc(retry_config=path, job_retention_days=0, archive_dir=tmp_path / "archive")
    job_types_app.register(orc)
    agent = {"prompt": "hello", "model": "m"}  # no tools: one step, one call
    gone, kept = await run(
        orc, ("llm_generate", ask("m"), {"token_budget": 100}), ("run_agent", agent, {})
    )
    await db.execute("UPDATE orc_rollup_watermark SET rolled_up_to = now() + interval '1 minute'")
    async with orc:
        result = await orc.maintenance.run("prune_finished")
    assert result.jobs == 1 and result.llm_usage == 1  # type: ignore[attr-defined]
    (line,) = archive.read(result.archive)  # type: ignore[attr-defined]
    assert line["job"]["id"] == str(gone)  # archived whole, its usage too
    assert [(u["job_id"], u["model"]) for u in line["llm_usage"]] == [(str(gone), "m")]
    assert [r[0] for r in await usage_rows(db)] == [kept]
    cur = await db.execute("SELECT count(*) FROM orc_job_token_budgets")
    assert (await cur.fetchone() or [None])[0] == 0


# -- the HTTP API --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(dsn: str) -> Iterator[ApiServer]:
    with ApiServer(dsn) as running:
        yield running


async def test_the_api_answers_each_tenant_with_its_own_usage_only(
    orc: Orchestrator, model_server: llm.LocalLLM, server: ApiServer
) -> None:
    before = datetime.now(UTC)
    a_job, b_job = await run(
        orc,
        ("llm_generate", ask("model-a", "one two"), {"tenant_id": "acme"}),
        ("llm_generate", ask("model-b", "one two three"), {"tenant_id": "globex"}),
    )
    async with orc:
        everyone = await token(orc.stores.tokens, "usage-all", Scope.READ)
        acme = await token(orc.stores.tokens, "usage-acme", Scope.READ, tenants=["acme"])
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:

        async def get(path: str, secret: str, **params: str) -> httpx.Response:
            return await client.get(
                path, params=params, headers={"Authorization": f"Bearer {secret}"}
            )

        all_of_it = await get(
            "/api/v1/usage", everyone, by="tenant,model", since=before.isoformat()
        )
        assert all_of_it.status_code == 200, all_of_it.text
        got = {(t["tenant_id"], t["model"]): t["input_tokens"] for t in all_of_it.json()["totals"]}
        assert got == {("acme", "model-a"): 2, ("globex", "model-b"): 3}
        # The attacker holds acme's token: globex's usage is not summed in, whatever it asks.
        for params in ({"by": "tenant,model"}, {"by": "job"}, {"by": ""},
                       {"tenant_id": "globex"}, {"model": "model-b"}):  # fmt: skip
            answer = await get("/api/v1/usage", acme, **params)
            assert answer.status_code == 200, answer.text
            assert "globex" not in answer.text and str(b_job) not in answer.text
            assert "model-b" not in answer.text
            totals = answer.json()["totals"]
            assert sum(t["input_tokens"] for t in totals) == (
                0 if "globex" in str(params) or "model-b" in str(params) else 2
            )
        mine = await get(f"/api/v1/jobs/{a_job}/usage", acme)
        assert mine.status_code == 200 and mine.json()["total"]["input_tokens"] == 2
        assert mine.json()["calls"][0]["model"] == "model-a"
        theirs = await get(f"/api/v1/jobs/{b_job}/usage", acme)
        assert theirs.status_code == 404 and theirs.json()["code"] == "JOB_NOT_FOUND"
        bad = await get("/api/v1/usage", everyone, by="tenant,colour")
        assert bad.status_code == 422 and "cannot group usage by 'colour'" in bad.json()["detail"]
        naive = await get("/api/v1/usage", everyone, since="2026-01-01T00:00:00")
        assert naive.status_code == 422 and "since" in naive.json()["detail"]


# -- the command line ----------------------------------------------------------------------------


@pytest.fixture
def cli(dsn: str) -> Callable[..., tuple[int, str, str]]:
    """``orchestrator ARGS`` in a process of its own."""

    def run(*argv: str) -> tuple[int, str, str]:
        environment = {**os.environ, "DATABASE_URL": dsn}
        environment.pop("ORCHESTRATOR_RETRY_CONFIG", None)
        done = subprocess.run(
            [sys.executable, "-m", "orchestrator", *argv], env=environment,
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        return done.returncode, done.stdout, done.stderr

    return run


async def test_the_cli_prints_totals_grouped_over_a_range_and_a_jobs_usage(
    orc: Orchestrator, model_server: llm.LocalLLM, cli: Callable[..., tuple[int, str, str]]
) -> None:
    prefix = "shared words to cache"  # 4 words
    first, _, _ = await run(
        orc,
        (
            "llm_generate",
            ask("m1", "a b c", cached=prefix),
            {"tenant_id": "t1", "token_budget": 500},
        ),
        ("llm_generate", ask("m1", "a b", cached=prefix), {"tenant_id": "t1"}),
        ("llm_generate", ask("m2", "a"), {"tenant_id": "t2"}),
    )
    code, out, err = await asyncio.to_thread(cli, "usage", "--since", "1h", "--by", "tenant,model")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("LLM usage from ") and lines[0].endswith(" to now, by tenant, model")
    assert lines[1].split() == ["tenant", "model", "calls", "input", "output", "cache", "read",
                                "cache", "write", "total"]  # fmt: skip
    rows = {tuple(line.split()[:2]): [int(n) for n in line.split()[2:]] for line in lines[2:-1]}
    # t1, m1: two calls of 3 and 2 input words past the 4 cached ones, written then read.
    t1 = rows[("t1", "m1")]
    assert (t1[0], t1[1], t1[3], t1[4]) == (2, 5, 4, 4) and t1[5] == sum(t1[1:5])
    assert rows[("t2", "m2")][:2] == [1, 1]
    total = next(line for line in lines if line.startswith("all"))
    assert [int(n) for n in total.split()[1:]][:2] == [3, 6]
    code, out, err = await asyncio.to_thread(cli, "usage", "--by", "", "--model", "m9")
    assert code == 0 and out.splitlines()[1] == "  no LLM call recorded in this range"
    code, out, _ = await asyncio.to_thread(cli, "usage", "--by", "job", "--json", "--tenant", "t2")
    assert code == 0 and [t["calls"] for t in json.loads(out)] == [1]
    code, out, _ = await asyncio.to_thread(cli, "status", str(first))
    assert code == 0
    assert out.splitlines()[-1].startswith("LLM usage: 1 calls, ")
    assert " of a budget of 500 (input 3, output " in out and "cache write 4)" in out


@pytest.mark.parametrize(
    ("argv", "problem"),
    [(["usage", "--by", "tenant,colour"], "cannot group usage by 'colour'; group by any of job,"),
     (["usage", "--since", "yesterday"], "or give an age such as 30m, 24h, 7d"),
     (["usage", "--since", "2026-01-01T00:00:00"], "has no timezone"),
     (["usage", "--since", "2h", "--until", "3h"], "is not after since"),
     (["usage", "--job", "nope"], "not a job id: 'nope'"),
     (["submit", "llm_generate", "--token-budget", "0"], "token_budget: Input should be greater than 0")],
    ids=["group", "since", "naive", "range", "job", "budget"],
)  # fmt: skip
async def test_a_cli_mistake_is_one_line_without_a_traceback(
    cli: Callable[..., tuple[int, str, str]], argv: list[str], problem: str, db: Any
) -> None:
    code, out, err = await asyncio.to_thread(cli, *argv)
    assert (code, out) == (2, ""), err
    assert problem in err and "Traceback" not in err and len(err.strip().splitlines()) <= 2


# -- the fleet exporter --------------------------------------------------------------------------


async def test_the_exporter_shows_the_last_hours_tokens_by_tenant_model_and_kind(
    orc: Orchestrator, model_server: llm.LocalLLM, db: psycopg.AsyncConnection[Any]
) -> None:
    prefix = "a cached prefix"  # 3 words
    await run(
        orc,
        ("llm_generate", ask("m1", "a b", cached=prefix), {"tenant_id": "big"}),
        ("llm_generate", ask("m1", "a b c", cached=prefix), {"tenant_id": "big"}),
        ("llm_generate", ask("m2", "a"), {"tenant_id": "small"}),
        ("llm_generate", ask("m2", "a"), {}),
    )
    # A call recorded two hours ago is outside the window.
    await db.execute(
        "INSERT INTO orc_llm_usage (job_id, call_id, attempt, tenant_id, job_type, model,"
        " input_tokens, output_tokens, cache_read_tokens, cache_creation_tokens, recorded_at)"
        " SELECT job_id, 'old', 1, tenant_id, job_type, model, 1000, 1000, 0, 0,"
        " now() - interval '2 hours' FROM orc_llm_usage WHERE tenant_id = 'big' LIMIT 1"
    )
    async with orc:
        wide = FleetMetrics(orc.stores.fleet, zombie_threshold=300, max_tenants=10, min_interval=0)
        narrow = FleetMetrics(orc.stores.fleet, zombie_threshold=300, max_tenants=1, min_interval=0)
        found = exposition.samples((await wide.exposition(""))[0].decode())
        bounded = exposition.samples((await narrow.exposition(""))[0].decode())

    def tokens(where: dict[Any, float], tenant: str, model: str, kind: str) -> float:
        return exposition.value(
            where, "orchestrator_llm_tokens_recent", tenant=tenant, model=model, kind=kind
        )

    assert tokens(found, "big", "m1", "input") == 5
    assert (
        tokens(found, "big", "m1", "cache_creation"),
        tokens(found, "big", "m1", "cache_read"),
    ) == (3, 3)
    assert tokens(found, "small", "m2", "input") == 1 and tokens(found, "", "m2", "input") == 1
    # "Echo: a cached prefix a b" and "... a b c": 6 + 7, not the old call's 1000
    assert tokens(found, "big", "m1", "output") == 13
    # One tenant named at most: the rest are summed under _other.
    assert tokens(bounded, "big", "m1", "input") == 5
    assert tokens(bounded, "_other", "m2", "input") == 2
    assert not [k for k in bounded if "small" in str(k)]


async def test_the_exporter_names_the_most_used_models_and_sums_the_rest(
    orc: Orchestrator, model_server: llm.LocalLLM, db: psycopg.AsyncConnection[Any]
) -> None:
    (job_id,) = await run(orc, ("llm_generate", ask("m"), {"tenant_id": "t"}))
    async with orc:
        own = (await orc.job_usage(job_id)).total.input_tokens
    await db.execute(
        "INSERT INTO orc_llm_usage (job_id, call_id, attempt, tenant_id, job_type, model,"
        " input_tokens, output_tokens, cache_read_tokens, cache_creation_tokens)"
        " SELECT %s, 'c' || n, 1, 't', 'llm_generate', 'model-' || n, 100 + n, 0, 0, 0"
        " FROM generate_series(1, 25) AS n",
        (job_id,),
    )
    async with orc:
        fleet = FleetMetrics(orc.stores.fleet, zombie_threshold=300, max_tenants=10, min_interval=0)
        found = exposition.samples((await fleet.exposition(""))[0].decode())
    models = {dict(k[1])["model"] for k in found if k[0] == "orchestrator_llm_tokens_recent"}
    assert len(models) == 21 and "_other" in models
    assert {f"model-{n}" for n in range(6, 26)} < models  # the 20 most used
    assert (
        exposition.value(
            found, "orchestrator_llm_tokens_recent", tenant="t", model="_other", kind="input"
        )
        == sum(100 + n for n in range(1, 6)) + own
    )


# -- the dashboard -------------------------------------------------------------------------------


async def test_the_dashboard_shows_a_tenants_own_usage_and_a_jobs_tokens(
    orc: Orchestrator, model_server: llm.LocalLLM, server: ApiServer
) -> None:
    a_job, b_job = await run(
        orc,
        ("llm_generate", ask("model-a", "one two"), {"tenant_id": "acme", "token_budget": 900}),
        ("llm_generate", ask("model-b", "one"), {"tenant_id": "globex"}),
    )
    async with orc:
        acme = await token(orc.stores.tokens, "usage-ui-acme", Scope.READ, tenants=["acme"])

    def browse() -> list[httpx.Response]:
        with httpx.Client(base_url=server.url, timeout=10) as browser:
            csrf = page_csrf(browser, "/ui/login")
            signed = browser.post("/ui/login", data={"token": acme, "csrf": csrf})
            assert signed.status_code == 303 and "error" not in signed.headers["location"]
            return [
                browser.get("/ui/usage", params={"range": "1h", "by": "tenant,model"}),
                browser.get("/ui/usage", params={"range": "all", "by": "job"}),
                browser.get(f"/ui/jobs/{a_job}"),
                browser.get(f"/ui/jobs/{b_job}"),
            ]

    by_model, by_job, mine, theirs = await asyncio.to_thread(browse)
    assert by_model.status_code == 200 and '<tr class="usage-row">' in by_model.text
    rows = by_model.text.count('<tr class="usage-row">')
    assert rows == 1 and "model-a" in by_model.text and "acme" in by_model.text
    assert "globex" not in by_model.text and "model-b" not in by_model.text
    assert f'href="/ui/jobs/{a_job}"' in by_job.text and str(b_job) not in by_job.text
    assert mine.status_code == 200 and '<section class="llm-usage">' in mine.text
    assert "tokens in 1 calls of a budget of 900" in mine.text and "model-a" in mine.text
    assert "<h1>Not found</h1>" in theirs.text and "model-b" not in theirs.text


# -- the rollups ---------------------------------------------------------------------------------


async def test_token_totals_outlive_the_usage_rows_in_the_rollups(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    """A job's tokens are rolled up with it (the minute it finished), so retention, which
    deletes a job only once the rollups have counted it, takes its usage rows and leaves the
    totals (GET /api/v1/stats, ``orc.stats``)."""
    orc = make_orc(job_retention_days=0, rollup_settle_seconds=0)
    jobs = [uuid4() for _ in range(3)]
    for job_id, tenant in zip(jobs, ("acme", "acme", "globex"), strict=True):
        await db.execute(  # finished two hours ago, as a worker leaves a job
            "INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts,"
            " max_retries, trace_id, tenant_id, started_at, finished_at) VALUES (%s,"
            " 'llm_generate', 'COMPLETED', '{}', 'llm_generate', 1, 0, 't', %s,"
            " now() - interval '2 hours 1 second', now() - interval '2 hours')",
            (job_id, tenant),
        )
    for n, job_id in enumerate([jobs[0], jobs[0], jobs[1], jobs[2]]):
        await db.execute(
            "INSERT INTO orc_llm_usage (job_id, call_id, attempt, tenant_id, job_type, model,"
            " input_tokens, output_tokens, cache_read_tokens, cache_creation_tokens)"
            " SELECT id, %s, 1, tenant_id, job_type, 'm', 10, 20, 30, 40 FROM orc_jobs"
            " WHERE id = %s",
            (f"call-{n}", job_id),
        )
    since = datetime.now(UTC) - timedelta(hours=3)
    async with orc:
        while (await orc.maintenance.rollup.run_once()).minutes:
            pass
        pruned = await orc.maintenance.run("prune_finished")
        stats = await orc.stats(since=since, step=3600, by=["tenant"])
        left = await orc.llm_usage(by=[])
    assert pruned.jobs == 3 and pruned.llm_usage == 4  # type: ignore[attr-defined]
    assert left == []  # the rows went with their jobs
    points = {s.key["tenant"]: s.points for s in stats.jobs}
    [acme], [globex] = points["acme"], points["globex"]
    assert (acme.completed, acme.llm_calls, acme.input_tokens, acme.output_tokens,
            acme.cache_read_tokens, acme.cache_creation_tokens) == (2, 3, 30, 60, 90, 120)  # fmt: skip
    assert (globex.llm_calls, globex.input_tokens) == (1, 10)


# -- the retry config's budgets ------------------------------------------------------------------


def test_tenant_budgets_are_read_from_the_retry_config_and_checked(tmp_path: Path) -> None:
    good = retry_config.parse(
        {"token_budgets": {"acme": {"tokens": 500, "period": "hour"}, "globex": {"tokens": 9}}},
        tmp_path / "c.toml",
    )
    assert {t: (b.tokens, b.period) for t, b in good.token_budgets.items()} == {
        "acme": (500, "hour"), "globex": (9, "day"),
    }  # fmt: skip
    with pytest.raises(retry_config.ConfigError) as refused:
        retry_config.parse(
            {"token_budgets": {"acme": {"tokens": 0, "period": "week"}, "b": {"token": 5}}},
            tmp_path / "c.toml",
        )
    lines = str(refused.value).splitlines()
    assert any("token_budgets for tenant 'acme': field 'tokens'" in line for line in lines)
    assert any("token_budgets for tenant 'acme': field 'period'" in line for line in lines)
    assert any("tenant 'b': field 'token': Extra inputs" in line for line in lines)
    assert all(line.startswith(f"{tmp_path / 'c.toml'}: ") for line in lines)
    with pytest.raises(retry_config.ConfigError, match=r"\[token_budgets\] must be a table"):
        retry_config.parse({"token_budgets": 5}, tmp_path / "c.toml")


def test_an_edit_of_the_budgets_is_a_change_of_the_config(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    before = retry_config.parse({"token_budgets": {"acme": {"tokens": 5}}}, path)
    after = retry_config.parse(
        {"token_budgets": {"acme": {"tokens": 9}, "globex": {"tokens": 1, "period": "hour"}}}, path
    )
    changes = retry_config.diff(before, after)
    assert changes == {
        "[token_budgets]": {
            "acme.tokens": (5, 9), "globex.period": (None, "hour"), "globex.tokens": (None, 1),
        }
    }  # fmt: skip
    assert retry_config.describe(changes) == [
        '[token_budgets]: acme.tokens 5 -> 9, globex.period unset -> "hour", globex.tokens unset -> 1'
    ]
    assert retry_config.diff(after, after) == {}
