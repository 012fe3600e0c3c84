"""A provider's rate limits, learned from its replies' headers (docs/flow-control.md, "Limits
learned from the provider"). As pure rules (orchestrator.domain.flow_learned): what the headers
of either family say, whatever their case or their garbage, and a key's allowances once it
learned (a configured limit a ceiling, a lower provider limit binding): a model written here,
which the database's rule (orc_flow_limit_of_v1, the one in production) must answer as. And
through the real thing: worker processes, the local LLM
server sending Anthropic's or OpenAI's headers, the built-in ``llm_generate`` and a task's own
client: a key learns its limit from headers alone and every worker meets it; a spent limit
holds the key until its reset; a pause's end (that hold's, a 429's, an operator's) hands the
key's room to its line with nothing of the key running."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import httpx
import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st

from demo import llm_server as llm
from orchestrator import Orchestrator
from orchestrator.domain.flow_learned import (
    LIMITS,
    MAX_HOLD_SECONDS,
    Reading,
    learned,
    readings,
)
from tests.support import flow_app
from tests.support.flow_learned_model import Allowances, allowances, in_effect
from tests.support.harness import wait_for
from tests.support.workers import WorkerProcess
from tests.test_flow_calls import KEY, NOT_ZOMBIES, most_in_any_interval, spends

NOW = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)

counts = st.integers(min_value=1, max_value=10**9)
left = st.integers(min_value=0, max_value=10**9)
resets = st.floats(min_value=0, max_value=3_600, allow_nan=False).map(lambda s: round(s, 3))
maybe = st.one_of(st.none(), counts)


def said(style: str, name: str, limit: int, remaining: int, reset: float) -> dict[str, str]:
    """One limit's three headers, as Anthropic (an RFC 3339 reset) or OpenAI (a duration)
    sends them."""
    if style == "anthropic":
        when = (NOW + timedelta(seconds=reset)).isoformat(timespec="milliseconds")
        return {f"anthropic-ratelimit-{name}-{part}": value
                for part, value in (("limit", str(limit)), ("remaining", str(remaining)),
                                    ("reset", when.replace("+00:00", "Z")))}  # fmt: skip
    minutes, seconds = divmod(reset, 60)
    duration = f"{int(minutes)}m{seconds:.3f}s" if minutes else f"{seconds:.3f}s"
    return {f"x-ratelimit-{part}-{name}": value
            for part, value in (("limit", str(limit)), ("remaining", str(remaining)),
                                ("reset", duration))}  # fmt: skip


limits_said = st.dictionaries(st.sampled_from(LIMITS), st.tuples(counts, left, resets), min_size=1)


@given(
    style=st.sampled_from(["anthropic", "openai"]),
    said_limits=limits_said,
    upper=st.booleans(),
)
def test_the_headers_of_either_family_are_read_in_any_case(
    style: str, said_limits: dict[str, tuple[int, int, float]], upper: bool
) -> None:
    headers: dict[str, str] = {}
    for name, (limit, remaining, reset) in said_limits.items():
        headers |= said(style, name, limit, remaining, reset)
    if upper:
        headers = {name.upper(): value for name, value in headers.items()}
    found = readings(headers, now=NOW)
    assert found.keys() == said_limits.keys()
    for name, (limit, remaining, reset) in said_limits.items():
        reading = found[name]
        assert (reading.limit, reading.remaining) == (limit, remaining)
        assert reading.reset == pytest.approx(reset, abs=0.002)


@given(said_limits=limits_said)
def test_what_a_reply_teaches(said_limits: dict[str, tuple[int, int, float]]) -> None:
    """Requests from the requests limit; units from the input and output token limits
    together, else the tokens limit; the hold is the latest reset of the limits spent."""
    headers: dict[str, str] = {}
    for name, (limit, remaining, reset) in said_limits.items():
        headers |= said("anthropic", name, limit, remaining, reset)
    reply = learned(headers, now=NOW)
    assert reply is not None
    limit = {name: values[0] for name, values in said_limits.items()}
    assert reply.requests == limit.get("requests")
    if "input-tokens" in limit and "output-tokens" in limit:
        assert reply.units == limit["input-tokens"] + limit["output-tokens"]
    elif "tokens" in limit:
        assert reply.units == limit["tokens"]
    else:
        assert reply.units == limit.get("input-tokens", limit.get("output-tokens"))
    spent = {name for name, (_, remaining, _) in said_limits.items() if remaining == 0}
    assert set(reply.spent) == spent
    if spent:
        latest = max(said_limits[name][2] for name in spent)
        assert reply.hold == pytest.approx(latest, abs=0.002)
        assert all(name in reply.reason for name in spent)
    else:
        assert reply.hold is None


NAMES = [f"anthropic-ratelimit-{n}-{p}" for n in LIMITS for p in ("limit", "remaining", "reset")]
NAMES += [
    f"x-ratelimit-{p}-{n}" for n in ("requests", "tokens") for p in ("limit", "remaining", "reset")
]
ODD = ["-1", "0", "nan", "inf", "1e400", "12.7", "3m", "ms", "1h2m3.5s", "2026-13-45T00:00:00Z",
       "  7  ", "-4s", "0.5"]  # fmt: skip


@given(
    st.dictionaries(
        st.one_of(st.sampled_from(NAMES), st.text(max_size=30)),
        st.one_of(st.text(max_size=40), st.sampled_from(ODD)),
    )
)
def test_a_provider_s_odd_headers_never_fail_a_call(headers: dict[str, str]) -> None:
    """Whatever the headers hold, reading them raises nothing, and what is read is sane: a
    limit of at least 1, a remainder of at least 0, a hold from 0 to a day."""
    reply = learned(headers, now=NOW)
    for reading in readings(headers, now=NOW).values():
        assert reading != Reading(None, None, None)
        assert reading.limit is None or reading.limit >= 1
        assert reading.remaining is None or reading.remaining >= 0
        assert reading.reset is None or 0 <= reading.reset <= MAX_HOLD_SECONDS
    if reply is not None:
        assert reply.requests is None or reply.requests >= 1
        assert reply.units is None or reply.units >= 1
        assert reply.hold is None or 0 <= reply.hold <= MAX_HOLD_SECONDS


@given(
    sent=st.floats(min_value=0, max_value=0.999),
    way=st.floats(min_value=0, max_value=1),
    skew=st.floats(min_value=-86_400, max_value=86_400),
    reset=resets,
)
def test_a_hold_is_read_against_the_reply_s_date_whatever_the_worker_s_clock(
    sent: float, way: float, skew: float, reset: float
) -> None:
    """A reply sent ``sent`` into the second its ``Date`` names says a spent limit resets
    ``reset`` seconds later; the worker reads it ``way`` seconds after, its clock off by
    ``skew``. The hold is the true time left within the ``Date``'s slack: never more than 2 s
    short, never longer than the reply's age. (Against the worker's clock, an hour fast held
    nothing, an hour slow an hour more.)"""
    provider = NOW + timedelta(seconds=sent)
    until = provider + timedelta(seconds=reset)
    headers = {"Date": format_datetime(NOW, usegmt=True),
               "anthropic-ratelimit-requests-remaining": "0",
               "anthropic-ratelimit-requests-reset": until.isoformat().replace("+00:00", "Z")}  # fmt: skip
    read_at = provider + timedelta(seconds=way)
    reply = learned(headers, now=read_at + timedelta(seconds=skew))
    assert reply is not None and reply.hold is not None
    left = (until - read_at).total_seconds()
    assert max(0.0, left - 2) - 1e-3 <= reply.hold <= max(0.0, left + sent + way) + 1e-3
    assert learned({**headers, "Date": "soon"}, now=read_at) == learned(
        {name: v for name, v in headers.items() if name != "Date"}, now=read_at
    )  # a Date that does not parse: the worker's clock, as without one


def test_what_the_local_server_and_providers_send_is_read() -> None:
    openai = {"x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "0",
              "x-ratelimit-reset-requests": "6m0s", "x-ratelimit-limit-tokens": "150000",
              "x-ratelimit-remaining-tokens": "149984", "x-ratelimit-reset-tokens": "6ms"}  # fmt: skip
    assert learned(openai, now=NOW) == learned(openai, now=NOW + timedelta(days=1))
    reply = learned(openai, now=NOW)
    assert reply is not None
    assert (reply.requests, reply.units, reply.hold, reply.spent) == (60, 150000, 360.0,
                                                                      ("requests",))  # fmt: skip
    anthropic = {"anthropic-ratelimit-requests-limit": "50",
                 "anthropic-ratelimit-requests-remaining": "49",
                 "anthropic-ratelimit-requests-reset": "2026-11-27T12:00:01Z",
                 "anthropic-ratelimit-input-tokens-limit": "30000",
                 "anthropic-ratelimit-input-tokens-remaining": "0",
                 "anthropic-ratelimit-input-tokens-reset": "2026-11-27T12:00:07.5Z",
                 "anthropic-ratelimit-output-tokens-limit": "8000",
                 "anthropic-ratelimit-tokens-limit": "8000"}  # fmt: skip
    reply = learned(anthropic, now=NOW)
    assert reply is not None
    assert (reply.requests, reply.units, reply.hold, reply.spent) == (50, 38000, 7.5,
                                                                      ("input-tokens",))  # fmt: skip
    assert learned({"content-type": "application/json"}, now=NOW) is None


@given(configured=maybe, learned_limit=maybe)
def test_a_configured_limit_is_a_ceiling_and_a_lower_provider_limit_binds(
    configured: int | None, learned_limit: int | None
) -> None:
    allowed = in_effect(configured, learned_limit)
    if configured is None and learned_limit is None:
        assert allowed is None
        return
    assert allowed in (configured, learned_limit)
    assert configured is None or allowed <= configured  # never raised above the configured one
    assert learned_limit is None or allowed <= learned_limit  # never above the provider's


@given(configured=st.tuples(maybe, maybe), learned_limits=st.tuples(maybe, maybe))
def test_a_limit_that_does_not_learn_keeps_its_own_allowances(
    configured: tuple[int | None, int | None], learned_limits: tuple[int | None, int | None]
) -> None:
    mine, theirs = Allowances(*configured), Allowances(*learned_limits)
    assert allowances(mine, theirs, learn=False) == mine
    merged = allowances(mine, theirs, learn=True)
    assert merged == Allowances(
        in_effect(mine.requests, theirs.requests), in_effect(mine.units, theirs.units)
    )
    assert allowances(merged, theirs, learn=True) == merged  # learning it again changes nothing


@pytest.mark.parametrize(
    ("learn", "configured", "learned_limits"),
    [
        (True, (None, None), (None, None)),  # headers alone, nothing said yet
        (True, (None, None), (40, 9000)),  # headers alone
        (True, (50, 40000), (40, 90000)),  # requests lowered, units capped by the configured
        (True, (10, None), (None, 500)),  # units learned where none is configured
        (False, (50, 40000), (40, 9000)),  # a limit that does not learn
    ],
)
async def test_the_gate_merges_by_the_same_rule(
    db: psycopg.AsyncConnection[Any],
    learn: bool,
    configured: tuple[int | None, int | None],
    learned_limits: tuple[int | None, int | None],
) -> None:
    """The database's rule (orc_flow_limit_of_v1, which the claims, the calls and the keys'
    readers meet) answers as the model."""
    cur = await db.execute(
        "SELECT (m).requests, (m).units FROM (SELECT orc_flow_limit_of_v1("
        "  jsonb_populate_record(NULL::orc_flow_keys, jsonb_build_object("
        "    'learned_requests', %s::int, 'learned_units', %s::bigint)),"
        "  jsonb_populate_record(NULL::orc_flow_limits, jsonb_build_object("
        "    'requests', %s::int, 'units', %s::bigint, 'learn', %s::boolean))) AS m) AS s",
        (*learned_limits, *configured, learn),
    )
    assert await cur.fetchone() == tuple(
        vars(allowances(Allowances(*configured), Allowances(*learned_limits), learn=learn)).values()
    )


# -- through worker processes and the local LLM server -------------------------------------------

APP = "tests.support.flow_app:orc"
ASK = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
#: The server's window; a key's interval is a little longer (SLACK), so that the few
#: milliseconds between a call's sending, from which its spend is dated, and its arrival at the
#: server are not what these tests are about: they are about what the key learned.
WINDOW = 2.8
SLACK = 0.2


def worker(stack: contextlib.ExitStack, dsn: str, server: llm.LocalLLM, config: Any,
           concurrency: int = 5, **env: Any) -> WorkerProcess:  # fmt: skip
    settings = {
        "ORCHESTRATOR_RETRY_CONFIG": config, "ORCHESTRATOR_WORKER_CONCURRENCY": concurrency,
        "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": KEY, **NOT_ZOMBIES, **env,
    }  # fmt: skip
    return stack.enter_context(WorkerProcess(dsn, APP, **settings))


async def all_completed(orc: Orchestrator, ids: list[Any], timeout: float = 60) -> None:
    async def done() -> bool:
        return all([(await orc.get_job(j)).finished_at is not None for j in ids])

    await wait_for(done, timeout=timeout)
    for job_id in ids:
        job = await orc.get_job(job_id)
        assert (job.status.value, job.retry_count) == ("COMPLETED", 0), job


async def test_a_key_learns_its_provider_s_limit_from_headers_alone_for_the_whole_fleet(
    dsn: str, make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    """A limit with no number, ``learn = true``: the first job's reply (llm_generate, Anthropic's
    headers) teaches its key the server's 4 requests per window. That worker stops; two fresh
    ones, which never saw a reply, then run 12 jobs at once: the key lets at most 4 through per window,
    and the server refuses none. (Without the learned limit in the key's row, the fresh
    workers' claims would all go at once.)"""
    config = flow_app.config(f"learn = true\ninterval_seconds = {WINDOW + SLACK}")
    orc = make_orc(retry_config=config)
    flow_app.register(orc)
    await orc.open()
    with llm.serve(api_key=KEY, requests_per_window=4, window_seconds=WINDOW) as server:
        with contextlib.ExitStack() as first:
            worker(first, dsn, server, config)
            await all_completed(orc, [await orc.submit("llm_generate", ASK)])
        [key] = await orc.flow_keys("anthropic:m")
        assert (key.learn, key.requests, key.learned_requests, key.units) == (True, 4, 4, None)
        with contextlib.ExitStack() as fleet:
            for _ in range(2):
                worker(fleet, dsn, server, config)
            ids = [await orc.submit("llm_generate", ASK) for _ in range(12)]
            await all_completed(orc, ids)
        assert server.rate_limited == 0 and server.accepted == 13
    requests, _ = most_in_any_interval(await spends(db, "anthropic:m"), WINDOW + SLACK)
    assert requests <= 4  # (a loaded machine may not fill a window: at most, not ==)


@pytest.mark.parametrize(("configured", "in_effect_"), [(3, 3), (50, 4)])
async def test_a_configured_limit_is_a_ceiling_a_lower_provider_limit_lowers_it(
    dsn: str, make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any],
    configured: int, in_effect_: int,
) -> None:  # fmt: skip
    """The server allows 4 requests per window. A key configured at 3 stays at 3 (the provider's
    higher limit never raises it); one configured at 50 is lowered to 4 once a reply said so.
    Either way, 8 jobs then run within the key's allowance, none refused by the server."""
    config = flow_app.config(
        f"requests = {configured}\nlearn = true\ninterval_seconds = {WINDOW + SLACK}"
    )
    orc = make_orc(retry_config=config)
    flow_app.register(orc)
    await orc.open()
    with llm.serve(api_key=KEY, requests_per_window=4, window_seconds=WINDOW) as server:
        with contextlib.ExitStack() as stack:
            worker(stack, dsn, server, config, concurrency=8)
            await all_completed(orc, [await orc.submit("llm_generate", ASK)])
            [key] = await orc.flow_keys("anthropic:m")
            assert (key.requests, key.learned_requests) == (in_effect_, 4)
            await all_completed(orc, [await orc.submit("llm_generate", ASK) for _ in range(8)])
        assert server.rate_limited == 0
    requests, _ = most_in_any_interval(await spends(db, "anthropic:m"), WINDOW + SLACK)
    assert requests <= in_effect_  # (a loaded machine may not fill a window: at most, not ==)


@pytest.mark.parametrize("style", ["anthropic", "openai"])
async def test_a_limit_with_nothing_remaining_holds_the_key_until_its_reset(
    dsn: str, make_orc: Callable[..., Orchestrator], style: str
) -> None:
    """Another client of the same API key (this test, with two requests of its own) spends part
        of the server's 4 requests per window, which the key's own window does not see. The next
        job's reply says none remains, until the oldest request's reset: the key holds until then
        (a pause by the provider, fleet-wide), so the job submitted next waits for it instead of
        meeting a 429. Anthropic's headers through llm_generate; OpenAI's through a task's
    own client (``chat``, which gives each reply's headers to ``ctx.record_rate_limits``)."""
    config = flow_app.config(f"learn = true\ninterval_seconds = {WINDOW + SLACK}")
    orc = make_orc(retry_config=config)
    flow_app.register(orc)
    await orc.open()
    job_type, payload = (
        ("llm_generate", ASK) if style == "anthropic" else ("chat", {"model": "m", "calls": 1})
    )
    with llm.serve(
        api_key=KEY, requests_per_window=4, window_seconds=WINDOW, ratelimit_headers=style
    ) as server, contextlib.ExitStack() as stack:  # fmt: skip
        worker(stack, dsn, server, config)
        await all_completed(orc, [await orc.submit(job_type, payload)])  # learns 4
        async with httpx.AsyncClient(headers={"x-api-key": KEY}) as other_client:
            for _ in range(2):
                other = await other_client.post(f"{server.url}/v1/messages", json=ASK)
                assert other.status_code == 200
        await all_completed(orc, [await orc.submit(job_type, payload)])  # the window's last
        [key] = await orc.flow_keys("anthropic:m")
        assert key.paused_by == "provider" and key.paused_until is not None
        assert "requests limit has nothing remaining" in (key.pause_reason or "")
        assert key.requests_used == 2  # its own window had room: the hold is the provider's
        then = await orc.submit(job_type, payload)
        await all_completed(orc, [then])
        assert server.rate_limited == 0
        events = await orc.job_events(then)
        assert [
            e.payload["waiting_on"] for e in events if e.kind == "job.waiting_for_capacity"
        ] == ["paused"]
        [started] = [e.at for e in events if e.kind == "job.running"]
        assert started >= key.paused_until - timedelta(milliseconds=50)


#: Each writer of a pause, as it pauses a key for ``seconds`` from now: a reply saying the
#: requests limit has nothing remaining (a learned hold), a 429's hint, an operator.
PAUSES = {
    "held": "SELECT orc_flow_learn_v1(%(key)s, NULL, NULL, %(seconds)s,"
            " 'the provider''s requests limit has nothing remaining until its reset')",
    "429": "SELECT orc_flow_throttled_v2(%(key)s, %(seconds)s, 'rate_limit_error')",
    "operator": "SELECT orc_flow_pause_v1(%(key)s, %(seconds)s, 'provider incident', 'ops')",
}  # fmt: skip


@pytest.mark.parametrize("writer", list(PAUSES))
async def test_a_pause_s_end_hands_the_key_s_room_to_its_waiters_with_nothing_running(
    dsn: str, make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any],
    writer: str,
) -> None:  # fmt: skip
    """A learned key (headers alone) is paused for 6 s, longer than the pump's one-second
    horizon, and 6 jobs submitted then park behind the pause; nothing of the key runs, so no
    release or admission will pump it. At the pause's end its room goes to them: each starts
    within seconds of it, none before. The workers' safety net runs once a year here, so its
    one-minute backstop cannot be what wakes them (before, nothing else did: a learned storm's
    line stood still for 45 s after the provider's hold, its key no longer paused)."""
    config = flow_app.config("learn = true\ninterval_seconds = 10")
    orc = make_orc(retry_config=config)
    flow_app.register(orc)
    await orc.open()
    with llm.serve(api_key=KEY, requests_per_window=100, window_seconds=10) as server, \
            contextlib.ExitStack() as stack:  # fmt: skip
        worker(stack, dsn, server, config, concurrency=10, ORCHESTRATOR_SAFETY_NET_CRON="0 0 1 1 *")
        await all_completed(orc, [await orc.submit("llm_generate", ASK)])  # learns 100 per 10 s
        await db.execute(PAUSES[writer], {"key": "anthropic:m", "seconds": 6})
        [key] = await orc.flow_keys("anthropic:m")
        assert key.paused_until is not None and key.requests == 100
        ids = [await orc.submit("llm_generate", ASK) for _ in range(6)]
        await all_completed(orc, ids, timeout=40)
        assert server.rate_limited == 0
    for job_id in ids:
        events = await orc.job_events(job_id)
        assert [
            e.payload["waiting_on"] for e in events if e.kind == "job.waiting_for_capacity"
        ] == ["paused"]
        [started] = [e.at for e in events if e.kind == "job.running"]
        assert key.paused_until - timedelta(milliseconds=50) <= started
        assert started <= key.paused_until + timedelta(seconds=10)  # not the backstop's minute
