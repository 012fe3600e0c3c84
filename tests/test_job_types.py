"""The built-in job types (tasks/) against real protocol peers on 127.0.0.1: the real anthropic
SDK against the local Messages API server, httpx against plain HTTP endpoints, a webhook
receiver and a Telegram-style bot API. Each failure class reaches the state the design's decision
tree says, with the delay it says, read from the job's events; limits shortened in
tests/support/job_types.toml (backoff 50 ms doubling, cap 3 s, no jitter, HTTP and notification calls
1 s)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import psycopg
import pytest

from demo import llm_server as llm
from orchestrator import InvalidPayload, Orchestrator, Status
from orchestrator.domain.models import JobEvent
from orchestrator.interfaces.render import event_detail
from tests.support import exposition, http_peers, job_types_app
from tests.support.external import MessageService, message_service
from tests.support.harness import ROOT, WorkerRun, finished
from tests.support.workers import WorkerProcess

CONFIG = ROOT / "tests" / "support" / "job_types.toml"
KEY = "sk-test-0123456789abcdef"
ESCALATE_TO = "ops"


@pytest.fixture
def peers() -> Iterator[http_peers.Peers]:
    with http_peers.serve() as p:
        yield p


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


@pytest.fixture
def orc(
    make_orc: Callable[..., Orchestrator], peers: http_peers.Peers, monkeypatch: pytest.MonkeyPatch
) -> Orchestrator:
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", http_peers.TOKEN)
    target = {"channel": "webhook", "url": f"{peers.url}/hooks/{ESCALATE_TO}"}
    made = make_orc(retry_config=CONFIG, escalation_target=target)
    job_types_app.register(made)
    return made


async def run(orc: Orchestrator, job_type: str, payload: Any, timeout: float = 20) -> UUID:
    async with WorkerRun(orc) as worker:
        job_id = await orc.submit(job_type, payload)
        await worker.until_finished(job_id, timeout=timeout)
    return job_id


def failures(events: list[JobEvent]) -> list[tuple[str, str, str | None, float | None]]:
    """(classification, code, layer, backoff_ms) of each job.failed, in order."""
    return [
        (
            e.payload["error"]["classification"],
            e.payload["error"]["code"],
            e.payload.get("layer"),
            e.payload.get("backoff_ms"),
        )
        for e in events
        if e.kind == "job.failed"
    ]


def kinds(events: list[JobEvent]) -> list[str]:
    return [e.kind for e in events]


# -- http_request and webhook_dispatch --------------------------------------------------------


async def test_http_429_retry_after_is_capped(orc: Orchestrator, peers: http_peers.Peers) -> None:
    peers.script("limited", [(429, 3600)])
    job_id = await run(orc, "http_request", {"url": f"{peers.url}/status/limited"})
    events = await orc.job_events(job_id)
    assert failures(events) == [("TRANSIENT_APP", "HTTP_429", "app", 3000.0)]  # cap_ms
    assert (await orc.get_job(job_id)).status is Status.COMPLETED


async def test_http_502_is_infrastructure_retried_by_graphile_formula(
    orc: Orchestrator, peers: http_peers.Peers
) -> None:
    peers.script("gateway", [502])
    job_id = await run(orc, "http_request", {"url": f"{peers.url}/status/gateway"})
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    assert job.status is Status.COMPLETED and job.retry_count == 0  # no app budget used
    [(classification, code, layer, backoff)] = failures(events)
    assert (classification, code, layer) == ("TRANSIENT_INFRA", "HTTP_502", "infra")
    assert backoff == pytest.approx(2718.282, abs=1)  # exp(min(10, 1)) s


async def test_http_400_fails_and_a_human_is_notified_in_the_same_transaction(
    orc: Orchestrator, peers: http_peers.Peers, db: psycopg.AsyncConnection[Any]
) -> None:
    peers.script("bad", [400])
    job_id = await run(orc, "http_request", {"url": f"{peers.url}/status/bad"})
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    assert job.status is Status.FAILED and peers.requests["bad"] == 1
    assert failures(events) == [("PERMANENT", "HTTP_400", None, None)]
    assert kinds(events)[-3:] == ["job.dead_lettered", "job.failed", "job.degraded"]
    degraded = events[-1].payload
    assert degraded["action"] == "notify_human"
    escalation = UUID(degraded["escalation_job_id"])
    # Written by the transaction that failed the job: both rows carry its transaction id.
    cur = await db.execute(
        "SELECT count(DISTINCT xmin::text) FROM orc_job_events"
        " WHERE (job_id, kind) IN ((%s, 'job.failed'), (%s, 'job.created'))",
        [job_id, escalation],
    )
    assert (await cur.fetchone()) == (1,)
    notice = await orc.get_job(escalation)
    assert notice.job_type == "send_notification"
    assert notice.payload["about_job_id"] == str(job_id)
    assert "Manual review required" in notice.payload["text"]
    async with WorkerRun(orc) as worker:
        await worker.until_finished(escalation)
    [delivered] = peers.received[ESCALATE_TO]
    assert json.loads(delivered["body"])["about_job_id"] == str(job_id)


async def test_webhook_is_signed_and_keeps_its_idempotency_key_across_retries(
    orc: Orchestrator, peers: http_peers.Peers, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOOK_SIGNING_KEY", "whsec-0123456789")
    peers.script("orders", [(503, 0)])
    job_id = await run(
        orc,
        "webhook_dispatch",
        {"url": f"{peers.url}/hooks/orders", "event": "order.paid", "data": {"n": 1},
         "signing_secret": "HOOK_SIGNING_KEY"},
    )  # fmt: skip
    job = await orc.get_job(job_id)
    assert job.status is Status.COMPLETED and set(job.result) == {"status", "headers", "body"}
    first, second = peers.received["orders"]
    assert first["body"] == second["body"]
    assert first["headers"]["idempotency-key"] == second["headers"]["idempotency-key"]
    expected = hmac.new(b"whsec-0123456789", first["body"].encode(), hashlib.sha256).hexdigest()
    assert first["headers"]["x-webhook-signature"] == f"sha256={expected}"
    assert "whsec-0123456789" not in json.dumps(job.model_dump(mode="json"))


async def test_unknown_job_payload_is_refused_at_submit(orc: Orchestrator) -> None:
    async with orc:
        with pytest.raises(InvalidPayload, match="url"):
            await orc.submit("webhook_dispatch", {"event": "x"})
        with pytest.raises(InvalidPayload, match="unknown tool 'nope'"):
            await orc.submit("execute_tool", {"tool": "nope"})
        with pytest.raises(InvalidPayload, match="unknown tools"):
            await orc.submit("run_agent", {"prompt": "hi", "model": "m", "tools": ["nope"]})


# -- each failure class of each HTTP-based type -----------------------------------------------

APPROVAL_ID = "0192f1b0-0000-7000-8000-000000000001"

#: job type -> payload addressing the peer's script ``name`` on ``base``.
HTTP_TYPES: dict[str, Callable[[str, str], dict[str, Any]]] = {
    "http_request": lambda base, name: {"url": f"{base}/status/{name}"},
    "webhook_dispatch": lambda base, name: {"url": f"{base}/hooks/{name}", "event": "order.paid"},
    "send_notification": lambda base, name: {
        "channel": "webhook", "url": f"{base}/hooks/{name}", "text": "deploy finished"
    },
    "approval_notify": lambda base, name: {
        "target": {"channel": "webhook", "url": f"{base}/hooks/{name}"},
        "approval_id": APPROVAL_ID, "question": "Deploy?",
    },
}  # fmt: skip
NOTIFICATIONS = {"send_notification", "approval_notify"}  # app budget 1, 1 run, a fallback
INFRA_CODE = "CONNECT_ERROR"


def expected_failures(job_type: str, case: str) -> tuple[Status, list[Any]]:
    """The decision tree with tests/support/job_types.toml's numbers: backoff 50 ms doubling,
    app budget 2 (notifications 1), 2 runs per dispatch (notifications 1)."""
    notification = job_type in NOTIFICATIONS
    app, infra = "TRANSIENT_APP", "TRANSIENT_INFRA"
    match case:
        case "503-retry-after":  # the server's hint honoured
            return Status.COMPLETED, [(app, "HTTP_503", "app", 1000.0)]
        case "response-timeout":  # connected, no answer within call_timeout_ms
            return Status.COMPLETED, [(app, "RESPONSE_TIMEOUT", "app", 50.0)]
        case "400":
            return Status.FAILED, [("PERMANENT", "HTTP_400", None, None)]
        case "503-exhausted":
            retries = [
                (app, "HTTP_503", "app", 50.0 * 2**n) for n in range(1 if notification else 2)
            ]
            return Status.FAILED, [*retries, (app, "HTTP_503", None, None)]
        case "connection-refused":  # the Graphile formula, then FAILED on the last run
            runs = [] if notification else [(infra, INFRA_CODE, "infra", pytest.approx(2718.282))]
            return Status.FAILED, [*runs, (infra, INFRA_CODE, None, None)]
        case "malformed-json":
            return Status.FAILED, [("INVALID_OUTPUT", "OUTPUT_INVALID", None, None)]
    raise AssertionError(case)


SCRIPTS: dict[str, list[Any]] = {
    "503-retry-after": [(503, 1)],
    "response-timeout": [http_peers.Slow(1.5)],
    "400": [400],
    "503-exhausted": [503] * 5,
    "connection-refused": [],
    "malformed-json": [http_peers.MALFORMED],
}
FAILURE_CASES = [
    (job_type, case)
    for job_type in HTTP_TYPES
    for case in SCRIPTS
    if not (case == "malformed-json" and job_type in NOTIFICATIONS)  # no output to validate
]


@pytest.mark.parametrize(("job_type", "case"), FAILURE_CASES, ids=map("/".join, FAILURE_CASES))
async def test_each_failure_class_reaches_the_state_and_delay_the_design_says(
    orc: Orchestrator, peers: http_peers.Peers, job_type: str, case: str
) -> None:
    peers.script(case, SCRIPTS[case])
    base = peers.refused_url if case == "connection-refused" else peers.url
    job_id = await run(orc, job_type, HTTP_TYPES[job_type](base, case))
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    status, expected = expected_failures(job_type, case)
    assert (job.status, failures(events)) == (status, expected)
    attempts = len(expected) + (status is Status.COMPLETED)
    assert peers.requests[case] == (0 if case == "connection-refused" else attempts)
    if status is Status.FAILED:
        degraded = events[-1]
        assert degraded.kind == "job.degraded"
        fallback = job_type in NOTIFICATIONS  # a notification's content is logged, no escalation
        assert degraded.payload["action"] == ("fallback" if fallback else "notify_human")
    if case == "malformed-json":
        assert job.last_error is not None and job.last_error.output == '{"ok": tr'


@pytest.mark.parametrize(
    ("answer", "token", "code"),
    [(("400", "Bad Request: chat not found"), http_peers.TOKEN, "TELEGRAM_400"),
     ("ok", "999:wrong-token", "TELEGRAM_401")],
    ids=["chat-not-found", "bad-token"],
)  # fmt: skip
async def test_telegram_client_errors_are_permanent_and_take_the_fallback(
    orc: Orchestrator,
    peers: http_peers.Peers,
    monkeypatch: pytest.MonkeyPatch,
    answer: Any,
    token: str,
    code: str,
) -> None:
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", token)
    peers.script("telegram:9", [answer])
    job_id = await run(orc, "send_notification", telegram("9") | {"base_url": peers.url})
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    assert job.status is Status.FAILED
    assert failures(events) == [("PERMANENT", code, None, None)]
    assert events[-1].kind == "job.degraded" and events[-1].payload["action"] == "fallback"
    assert job.last_error is not None and token not in job.last_error.message


# -- llm_generate -----------------------------------------------------------------------------


def ask(model: str) -> dict[str, Any]:
    return {"model": model, "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}


async def test_llm_streams_and_keeps_usage(orc: Orchestrator, model_server: llm.LocalLLM) -> None:
    job_id = await run(orc, "llm_generate", ask("plain"))
    job = await orc.get_job(job_id)
    assert job.status is Status.COMPLETED
    assert job.result["text"] == "Echo: hi"
    assert job.result["usage"]["output_tokens"] > 0 and job.result["stop_reason"] == "end_turn"
    assert model_server.requests["plain"] == 1
    assert model_server.last_body("plain")["stream"] is True


async def test_llm_calls_and_their_tokens_are_counted_by_the_model_asked_for(
    orc: Orchestrator, model_server: llm.LocalLLM
) -> None:
    model_server.script(
        "m",
        [llm.Status(429, "rate_limit_error"), llm.Status(529, "overloaded_error"),
         llm.Text("fine now"), llm.Status(400, "invalid_request_error")],
    )  # fmt: skip
    job_id = await run(orc, "llm_generate", ask("m"))
    usage = (await orc.get_job(job_id)).result["usage"]
    refused = await orc.get_job(await run(orc, "llm_generate", ask("m")))
    assert refused.status is Status.FAILED
    body, _ = await orc.metrics.exposition("")
    found = exposition.samples(body.decode())

    def calls(outcome: str) -> float:
        return exposition.value(found, "orchestrator_llm_calls_total", model="m", outcome=outcome)

    def tokens(kind: str) -> float:
        return exposition.value(found, "orchestrator_llm_tokens_total", model="m", kind=kind)

    outcomes = ("rate_limited", "overloaded", "error", "ok")
    assert [calls(outcome) for outcome in outcomes] == [1, 1, 1, 1]
    assert (tokens("input"), tokens("output")) == (usage["input_tokens"], usage["output_tokens"])
    assert usage["output_tokens"] > 0
    assert KEY not in body.decode()  # no secret in the metrics


@pytest.mark.parametrize(
    ("reply", "code", "backoff"),
    [
        (llm.Status(429, "rate_limit_error", retry_after="2"), "LLM_RATE_LIMITED", 2000.0),
        (llm.Status(429, "rate_limit_error", retry_after="60"), "LLM_RATE_LIMITED", 3000.0),
        (llm.Status(529, "overloaded_error"), "LLM_OVERLOADED", 50.0),
        (llm.StreamError("overloaded_error"), "LLM_OVERLOADED", 50.0),
        (llm.Stall(after_chunks=2), "STREAM_STALLED", 50.0),
    ],
    ids=["429-hint", "429-hint-capped", "529", "overloaded-mid-stream", "stalled"],
)
async def test_llm_transient_app_failures_retry_with_the_delay_the_design_says(
    orc: Orchestrator, model_server: llm.LocalLLM, reply: Any, code: str, backoff: float
) -> None:
    model_server.script("m", [reply, llm.Text("fine now")])
    job_id = await run(orc, "llm_generate", ask("m"))
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    assert job.status is Status.COMPLETED and job.result["text"] == "fine now"
    assert failures(events) == [("TRANSIENT_APP", code, "app", backoff)]
    assert model_server.requests["m"] == 2  # one request per attempt: no hidden retries


async def test_llm_slow_but_steady_stream_is_not_cut(
    orc: Orchestrator, model_server: llm.LocalLLM
) -> None:
    # 6 chunks 0.3 s apart: 1.8 s in all, more than the 0.5 s inter-chunk limit.
    model_server.script("slow", [llm.Text("one two three four five six", chunks=6, every=0.3)])
    job_id = await run(orc, "llm_generate", ask("slow"))
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    assert job.status is Status.COMPLETED and failures(events) == []
    assert job.result["text"] == "one two three four five six"
    assert model_server.requests["slow"] == 1


async def test_llm_total_timeout_cuts_a_steady_stream_that_runs_too_long(
    orc: Orchestrator, model_server: llm.LocalLLM
) -> None:
    long = llm.Text(" ".join(["word"] * 12), chunks=12, every=0.3)  # 3.6 s > 2.5 s total
    model_server.script("long", [long, llm.Text("short")])
    job_id = await run(orc, "llm_generate", ask("long"))
    events = await orc.job_events(job_id)
    assert failures(events) == [("TRANSIENT_APP", "CALL_TIMEOUT", "app", 50.0)]
    assert (await orc.get_job(job_id)).status is Status.COMPLETED


@pytest.mark.parametrize(
    ("reply", "code"),
    [
        (llm.Status(400, "invalid_request_error", "prompt is too long"), "LLM_BAD_REQUEST"),
        (llm.Status(401, "authentication_error"), "LLM_AUTHENTICATION"),
    ],
    ids=["400", "401"],
)
async def test_llm_permanent_failures_fail_at_once(
    orc: Orchestrator, model_server: llm.LocalLLM, reply: Any, code: str
) -> None:
    model_server.script("p", [reply])
    job_id = await run(orc, "llm_generate", ask("p"))
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    assert job.status is Status.FAILED
    assert failures(events) == [("PERMANENT", code, None, None)]
    assert model_server.requests["p"] == 1
    assert events[-1].kind == "job.degraded" and events[-1].payload["action"] == "notify_human"


async def test_llm_server_error_is_infrastructure(
    orc: Orchestrator, model_server: llm.LocalLLM
) -> None:
    model_server.script("e", [llm.Status(500, "api_error"), llm.Text("ok")])
    job_id = await run(orc, "llm_generate", ask("e"))
    [(classification, code, layer, _)] = failures(await orc.job_events(job_id))
    assert (classification, code, layer) == ("TRANSIENT_INFRA", "LLM_SERVER_ERROR", "infra")
    assert model_server.requests["e"] == 2


SCHEMA = {
    "type": "object",
    "required": ["severity"],
    "properties": {"severity": {"enum": [1, 2, 3]}},
}


@pytest.mark.parametrize(
    ("text", "problem"),
    [('{"severity": 2}', None),
     ("Severity: two", "its text is not JSON"),
     ('{"severity": 7}', "does not meet output_schema at severity: 7 is not one of [1, 2, 3]")],
    ids=["fits", "not-json", "off-schema"],
)  # fmt: skip
async def test_llm_reply_is_validated_against_the_output_schema(
    orc: Orchestrator, model_server: llm.LocalLLM, text: str, problem: str | None
) -> None:
    model_server.script("s", [llm.Text(text)])
    job_id = await run(orc, "llm_generate", ask("s") | {"output_schema": SCHEMA})
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    assert model_server.requests["s"] == 1
    assert "output_schema" not in model_server.last_body("s")  # checked here, not sent
    if problem is None:
        assert job.status is Status.COMPLETED and job.result["output"] == {"severity": 2}
        return
    assert job.status is Status.FAILED
    assert failures(events) == [("INVALID_OUTPUT", "OUTPUT_INVALID", None, None)]
    assert job.last_error is not None and job.last_error.output == text
    assert problem in job.last_error.message


async def test_llm_output_schema_that_is_not_a_schema_is_refused_at_submit(
    orc: Orchestrator,
) -> None:
    async with orc:
        with pytest.raises(InvalidPayload, match="not a valid JSON Schema"):
            await orc.submit("llm_generate", ask("s") | {"output_schema": {"type": "thing"}})


async def test_llm_unreachable_is_infrastructure_then_fails_on_the_last_run(
    orc: Orchestrator, peers: http_peers.Peers, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    monkeypatch.setenv("ANTHROPIC_BASE_URL", peers.refused_url)
    job_id = await run(orc, "llm_generate", ask("m"))
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    assert job.status is Status.FAILED
    infra = "TRANSIENT_INFRA"
    assert failures(events) == [
        (infra, "LLM_CONNECTION_ERROR", "infra", pytest.approx(2718.282)),
        (infra, "LLM_CONNECTION_ERROR", None, None),
    ]


async def test_an_api_key_echoed_in_an_error_is_redacted_from_what_is_stored(
    orc: Orchestrator, model_server: llm.LocalLLM
) -> None:
    model_server.script("k", [llm.Status(403, "permission_error", f"key {KEY} may not do this")])
    job_id = await run(orc, "llm_generate", ask("k"))
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    stored = json.dumps([job.model_dump(mode="json"), [e.payload for e in events]])
    assert job.status is Status.FAILED
    assert KEY not in stored
    assert "key [REDACTED:ANTHROPIC_API_KEY] may not do this" in stored


# -- execute_tool -----------------------------------------------------------------------------


async def test_invalid_tool_output_fails_the_job_and_keeps_the_output(orc: Orchestrator) -> None:
    job_id = await run(orc, "execute_tool", {"tool": "bad_output", "args": {"query": "q"}})
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    assert job.status is Status.FAILED
    assert failures(events) == [("INVALID_OUTPUT", "OUTPUT_INVALID", None, None)]
    assert job.last_error is not None
    assert job.last_error.output == {"rows": "three rows", "query": "q"}
    assert "bad_output" in job.last_error.message


async def test_tool_timeout_is_the_tools_own_and_transient(orc: Orchestrator) -> None:
    job_id = await run(orc, "execute_tool", {"tool": "slow", "args": {"query": "q"}})
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    assert [f[:2] for f in failures(events)] == [("TRANSIENT_APP", "CALL_TIMEOUT")] * 3
    assert job.status is Status.FAILED and job.last_error is not None
    assert "tool 'slow' timed out after 0.2 seconds" in job.last_error.message
    assert events[-1].payload["message"].startswith("Tool execution failed after all retries")


async def test_a_dropped_connection_in_a_tool_is_retried_by_the_infrastructure_layer(
    orc: Orchestrator,
) -> None:
    job_id = await run(orc, "execute_tool", {"tool": "flaky", "args": {"query": uuid4().hex}})
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    assert job.status is Status.COMPLETED and job.retry_count == 0
    [(classification, code, layer, backoff)] = failures(events)
    assert (classification, code, layer) == ("TRANSIENT_INFRA", "ECONNRESET", "infra")
    assert backoff == pytest.approx(2718.282, abs=1)  # exp(min(10, 1)) s


async def test_tool_permission_denied_is_permanent(orc: Orchestrator) -> None:
    job_id = await run(orc, "execute_tool", {"tool": "denied", "args": {"query": "q"}})
    assert failures(await orc.job_events(job_id)) == [("PERMANENT", "EACCES", None, None)]


async def test_a_tool_runs_once_through_the_ledger(
    orc: Orchestrator, service: MessageService
) -> None:
    job_id = await run(orc, "execute_tool", {"tool": "send_message", "args": {"text": "hello"}})
    job = await orc.get_job(job_id)
    assert job.result == {"delivered": True, "text": "hello"}
    assert service.deliveries[f"{job_id}.1.tool"] == 1


# -- send_notification and approval_notify ----------------------------------------------------


def telegram(chat: str, text: str = "deploy finished") -> dict[str, Any]:
    return {"channel": "telegram", "chat_id": chat, "base_url": "", "text": text}


async def test_telegram_rate_limit_is_retried_after_its_hint(
    orc: Orchestrator, peers: http_peers.Peers
) -> None:
    peers.script("telegram:42", [("429", 1)])
    job_id = await run(orc, "send_notification", telegram("42") | {"base_url": peers.url})
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    assert job.status is Status.COMPLETED and job.result["message_id"] == "1"
    assert failures(events) == [("TRANSIENT_APP", "RETRY_LATER", "app", 1000.0)]


async def test_notification_exhaustion_takes_the_fallback_and_redacts_the_token(
    orc: Orchestrator, peers: http_peers.Peers, db: psycopg.AsyncConnection[Any]
) -> None:
    peers.script("telegram:7", [("500", "down")] * 5)
    payload = telegram("7", "the build is red") | {"base_url": peers.url}
    job_id = await run(orc, "send_notification", payload)
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    assert job.status is Status.FAILED and peers.requests["telegram:7"] == 1
    degraded = events[-1]
    assert degraded.kind == "job.degraded" and degraded.payload["action"] == "fallback"
    assert degraded.payload["fallback"] == "log_notification_content"
    assert degraded.payload["content"]["text"] == "the build is red"
    assert "escalation_job_id" not in degraded.payload
    cur = await db.execute("SELECT count(*) FROM orc_jobs")
    assert (await cur.fetchone()) == (1,)  # no human notification about a notification
    assert job.last_error is not None
    assert http_peers.TOKEN not in job.last_error.message + job.last_error.stack
    assert "[REDACTED:TELEGRAM_BOT_TOKEN]" in job.last_error.message


async def test_approval_notify_posts_the_question_with_how_to_answer(
    orc: Orchestrator, peers: http_peers.Peers
) -> None:
    notice = {
        "target": {"channel": "webhook", "url": f"{peers.url}/hooks/approvals"},
        "approval_id": "0192f1b0-0000-7000-8000-000000000001",
        "question": "Deploy to production?",
    }
    job_id = await run(orc, "approval_notify", notice)
    assert (await orc.get_job(job_id)).status is Status.COMPLETED
    [received] = peers.received["approvals"]
    text = json.loads(received["body"])["text"]
    assert "Deploy to production?" in text and "approvals approve 0192f1b0" in text


# -- run_agent --------------------------------------------------------------------------------


def agent_task(model: str) -> dict[str, Any]:
    return {"prompt": "tell the team", "model": model, "tools": ["send_message"]}


async def test_run_agent_runs_three_tool_steps_then_answers(
    orc: Orchestrator, model_server: llm.LocalLLM, service: MessageService
) -> None:
    job_id = await run(orc, "run_agent", agent_task("agent"))
    job = await orc.get_job(job_id)
    assert job.status is Status.COMPLETED
    transcript = job.result
    assert transcript["steps"] == 4 and model_server.requests["agent"] == 4
    assert [(c["step"], c["tool"], c["args"]) for c in transcript["tool_calls"]] == [
        (n, "send_message", {"text": f"text-{n}"}) for n in (1, 2, 3)
    ]
    assert transcript["answer"].startswith("Finished after 3 tool calls")
    assert [m["role"] for m in transcript["messages"]] == ["user"] + ["assistant", "user"] * 3 + [
        "assistant"
    ]
    assert sorted(service.deliveries.values()) == [1, 1, 1]
    assert transcript["usage"]["output_tokens"] > 0


async def test_run_agent_killed_in_step_2_resumes_there_without_repeating_a_tool_call(
    orc: Orchestrator, model_server: llm.LocalLLM, service: MessageService, dsn: str
) -> None:
    env = {
        "ORCHESTRATOR_RETRY_CONFIG": str(CONFIG),
        "TEST_MESSAGE_SERVICE_URL": service.url,
        "ANTHROPIC_BASE_URL": model_server.url,
        "ANTHROPIC_API_KEY": KEY,
    }
    app = "tests.support.job_types_app:orc"
    async with orc:
        with WorkerProcess(dsn, app, **env) as first:
            twin = await orc.submit("run_agent", agent_task("twin"))
            expected = (await finished(orc, twin)).result
            service.hold("text-2")  # record step 2's message, then keep the request open
            job_id = await orc.submit("run_agent", agent_task("agent"))
            await asyncio.to_thread(service.held.wait, 30)
            first.signal(signal.SIGKILL)  # the tool call happened; its step is not committed
            assert first.wait() == -signal.SIGKILL
            service.release()
        assert model_server.requests["agent"] == 2  # steps 1 and 2 asked the model
        with WorkerProcess(dsn, app, **env) as second:
            job = await finished(orc, job_id)
            assert job.status is Status.COMPLETED, second.output()[-3000:]
        steps = await orc.job_steps(job_id)
        events = await orc.job_events(job_id)
    # The same transcript as the uninterrupted twin (but for the model's name in its turns).
    assert job.result == expected | {"turns": [{"step": n, "model": "agent"} for n in range(1, 5)]}
    # Step 2's reply was committed when it arrived: the resumed step asked nothing again.
    assert model_server.requests["agent"] == 4
    step2 = f"{job_id}.2.tool1"
    assert service.deliveries[step2] == 1  # the message was not sent again
    [ledger] = [s for s in steps if s["invocation_id"] == step2]
    assert ledger["status"] == "committed" and ledger["detail"]["reconciled"] is True
    checkpoints = [(s["step"], s["attempt"]) for s in steps if s["kind"] == "checkpoint"]
    assert checkpoints == [(1, 1), (2, 2), (3, 2), (4, 2)]
    assert kinds(events).count("job.zombie_detected") == 1


@pytest.mark.parametrize(
    ("trouble", "code", "backoff"),
    [(llm.Status(429, "rate_limit_error", retry_after="1"), "LLM_RATE_LIMITED", 1000.0),
     (llm.Stall(after_chunks=1), "STREAM_STALLED", 50.0)],
    ids=["429", "stalled-stream"],
)  # fmt: skip
async def test_run_agent_retries_a_step_from_its_checkpoint(
    orc: Orchestrator,
    model_server: llm.LocalLLM,
    service: MessageService,
    trouble: Any,
    code: str,
    backoff: float,
) -> None:
    step1 = llm.ToolUse("send_message", {"text": "hello"})
    model_server.script("m", [step1, trouble, llm.Text("Told them.")])
    job_id = await run(orc, "run_agent", agent_task("m"))
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    assert job.status is Status.COMPLETED and job.result["answer"] == "Told them."
    assert failures(events) == [("TRANSIENT_APP", code, "app", backoff)]
    assert model_server.requests["m"] == 3  # step 1 once, step 2 twice
    assert service.deliveries == {f"{job_id}.1.tool1": 1}  # step 1's call not repeated
    steps = await orc.job_steps(job_id)
    checkpoints = [(s["step"], s["attempt"]) for s in steps if s["kind"] == "checkpoint"]
    assert checkpoints == [(1, 1), (2, 2)]  # step 2 retried in attempt 2, step 1 kept


@pytest.mark.parametrize(
    ("script", "tools", "failure"),
    [([llm.Status(400, "invalid_request_error")], ["send_message"],
      ("PERMANENT", "LLM_BAD_REQUEST", None, None)),
     ([llm.Status(500, "api_error")], ["send_message"],  # the type's one run: FAILED at once
      ("TRANSIENT_INFRA", "LLM_SERVER_ERROR", None, None)),
     ([llm.ToolUse("bad_output", {"query": "q"})], ["bad_output"],
      ("INVALID_OUTPUT", "OUTPUT_INVALID", None, None))],
    ids=["llm-400", "llm-500-last-run", "tool-output-invalid"],
)  # fmt: skip
async def test_run_agent_terminal_failures(
    orc: Orchestrator,
    model_server: llm.LocalLLM,
    script: list[Any],
    tools: list[str],
    failure: tuple[Any, ...],
) -> None:
    model_server.script("m", script)
    job_id = await run(orc, "run_agent", agent_task("m") | {"tools": tools})
    job, events = await orc.get_job(job_id), await orc.job_events(job_id)
    assert job.status is Status.FAILED and failures(events) == [failure]
    assert model_server.requests["m"] == 1
    assert events[-1].kind == "job.degraded" and events[-1].payload["action"] == "notify_human"


# -- model fallback (llm_generate, run_agent) ---------------------------------------------------

FALLBACK = 'fallback_models = ["b", "c"]\nfallback_after_seconds = 5\n'


@pytest.fixture
def falling_back(
    make_orc: Callable[..., Orchestrator], peers: http_peers.Peers, tmp_path: Path
) -> Orchestrator:
    """The job-type tests' orchestrator with fallback models b then c for both LLM types."""
    text = CONFIG.read_text()
    for table in ("[job_types.llm_generate]\n", "[job_types.run_agent]\n"):
        assert table in text
        text = text.replace(table, table + FALLBACK)
    config = tmp_path / "fallback.toml"
    config.write_text(text)
    target = {"channel": "webhook", "url": f"{peers.url}/hooks/{ESCALATE_TO}"}
    made = make_orc(retry_config=config, escalation_target=target)
    job_types_app.register(made)
    return made


def fallbacks(events: list[JobEvent]) -> list[tuple[Any, ...]]:
    return [
        (e.payload["from"], e.payload["to"], e.payload["reason"], e.payload["code"],
         e.payload["retry_after"], e.payload["step"])
        for e in events
        if e.kind == "job.model_fallback"
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("trouble", "reason", "code", "hint"),
    [(llm.Status(529, "overloaded_error"), "overloaded", "LLM_OVERLOADED", None),
     (llm.StreamError("overloaded_error"), "overloaded", "LLM_OVERLOADED", None),
     (llm.Status(429, "rate_limit_error", retry_after="60"), "rate_limited",
      "LLM_RATE_LIMITED", 60)],
    ids=["529", "overloaded-mid-stream", "429-past-the-threshold"],
)  # fmt: skip
async def test_llm_generate_falls_back_to_the_next_model_within_the_attempt(
    falling_back: Orchestrator,
    model_server: llm.LocalLLM,
    trouble: Any,
    reason: str,
    code: str,
    hint: float | None,
) -> None:
    model_server.script("a", [trouble])
    model_server.script("b", [llm.Text("from b")])
    job_id = await run(falling_back, "llm_generate", ask("a"))
    job, events = await falling_back.get_job(job_id), await falling_back.job_events(job_id)
    assert job.status is Status.COMPLETED and job.attempt == 1
    assert job.result["text"] == "from b"
    assert (job.result["model"], job.result["answered_by"]) == ("b", "b")
    assert failures(events) == []
    assert fallbacks(events) == [("a", "b", reason, code, hint, None)]
    [moved] = [e for e in events if e.kind == "job.model_fallback"]
    shown = f", hint {hint}s" if hint else ""
    assert event_detail(moved) == f"a {reason} ({code}{shown}): now b"  # as `status` shows it
    assert kinds(events) == ["job.created", "job.running", "job.model_fallback", "job.completed"]
    assert (model_server.requests["a"], model_server.requests["b"]) == (1, 1)
    assert model_server.requests["c"] == 0
    body, _ = await falling_back.metrics.exposition("")
    found = exposition.samples(body.decode())
    throttle = "overloaded" if reason == "overloaded" else "rate_limited"
    assert exposition.value(found, "orchestrator_llm_calls_total", model="a", outcome=throttle) == 1
    assert exposition.value(found, "orchestrator_llm_calls_total", model="b", outcome="ok") == 1


@pytest.mark.parametrize(
    ("trouble", "code", "backoff"),
    [(llm.Status(429, "rate_limit_error", retry_after="2"), "LLM_RATE_LIMITED", 2000.0),
     (llm.Status(429, "rate_limit_error"), "LLM_RATE_LIMITED", 50.0),
     (llm.Status(503, "api_error"), "LLM_UNAVAILABLE", 50.0),
     (llm.Stall(after_chunks=1), "STREAM_STALLED", 50.0)],
    ids=["429-within-the-threshold", "429-without-a-hint", "503", "stalled"],
)  # fmt: skip
async def test_llm_generate_stays_on_its_model_for_other_failures(
    falling_back: Orchestrator,
    model_server: llm.LocalLLM,
    trouble: Any,
    code: str,
    backoff: float,
) -> None:
    model_server.script("a", [trouble, llm.Text("from a")])
    job_id = await run(falling_back, "llm_generate", ask("a"))
    job, events = await falling_back.get_job(job_id), await falling_back.job_events(job_id)
    assert job.status is Status.COMPLETED and job.result["answered_by"] == "a"
    assert failures(events) == [("TRANSIENT_APP", code, "app", backoff)]
    assert fallbacks(events) == []
    assert model_server.requests["b"] == 0


async def test_llm_generate_tries_each_model_once_then_fails_as_before(
    falling_back: Orchestrator, model_server: llm.LocalLLM
) -> None:
    overloaded = llm.Status(529, "overloaded_error")
    model_server.script("a", [overloaded, llm.Text("a again")])
    model_server.script("b", [overloaded])
    model_server.script("c", [llm.Status(429, "rate_limit_error", retry_after="60")])
    job_id = await run(falling_back, "llm_generate", ask("a"))
    job, events = await falling_back.get_job(job_id), await falling_back.job_events(job_id)
    # The list spent, c's rate limit is the attempt's failure; the next attempt starts at a.
    assert job.status is Status.COMPLETED and job.result["answered_by"] == "a"
    assert fallbacks(events) == [
        ("a", "b", "overloaded", "LLM_OVERLOADED", None, None),
        ("b", "c", "overloaded", "LLM_OVERLOADED", None, None),
    ]
    assert failures(events) == [("TRANSIENT_APP", "LLM_RATE_LIMITED", "app", 3000.0)]
    assert [model_server.requests[m] for m in "abc"] == [2, 1, 1]


async def test_llm_generate_never_falls_back_on_a_permanent_error(
    falling_back: Orchestrator, model_server: llm.LocalLLM
) -> None:
    model_server.script("a", [llm.Status(400, "invalid_request_error")])
    job_id = await run(falling_back, "llm_generate", ask("a"))
    job, events = await falling_back.get_job(job_id), await falling_back.job_events(job_id)
    assert job.status is Status.FAILED
    assert failures(events) == [("PERMANENT", "LLM_BAD_REQUEST", None, None)]
    assert fallbacks(events) == [] and model_server.requests["b"] == 0


async def test_run_agent_keeps_the_model_it_fell_back_to_across_steps_and_attempts(
    falling_back: Orchestrator, model_server: llm.LocalLLM, service: MessageService
) -> None:
    def tool(text: str) -> llm.ToolUse:
        return llm.ToolUse("send_message", {"text": text})

    overloaded = llm.Status(529, "overloaded_error")
    model_server.script("a", [tool("one"), overloaded])
    model_server.script("b", [tool("two"), overloaded, llm.Text("Told them.")])
    model_server.script("c", [overloaded])
    job_id = await run(falling_back, "run_agent", agent_task("a"))
    job, events = await falling_back.get_job(job_id), await falling_back.job_events(job_id)
    assert job.status is Status.COMPLETED and job.result["answer"] == "Told them."
    # Step 1 on a; step 2 moved to b; step 3 found b then c overloaded: the attempt failed and
    # the next one resumed step 3 on b (the transcript's model), never going back to a.
    assert fallbacks(events) == [
        ("a", "b", "overloaded", "LLM_OVERLOADED", None, 2),
        ("b", "c", "overloaded", "LLM_OVERLOADED", None, 3),
    ]
    assert failures(events) == [("TRANSIENT_APP", "LLM_OVERLOADED", "app", 50.0)]
    moved = next(e for e in events if e.kind == "job.model_fallback")
    assert event_detail(moved) == "step 2: a overloaded (LLM_OVERLOADED): now b"
    assert [(t["step"], t["model"]) for t in job.result["turns"]] == [(1, "a"), (2, "b"), (3, "b")]
    assert [model_server.requests[m] for m in "abc"] == [2, 3, 1]
    assert service.deliveries == {f"{job_id}.1.tool1": 1, f"{job_id}.2.tool1": 1}
    # The transcript sent to b at step 3 is the one a and b built, as the model saw it.
    sent = model_server.last_body("b")["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user", "assistant", "user"]
    steps = await falling_back.job_steps(job_id)
    checkpoints = [(s["step"], s["attempt"]) for s in steps if s["kind"] == "checkpoint"]
    assert checkpoints == [(1, 1), (2, 1), (3, 2)]


def test_the_fallback_rule() -> None:
    from orchestrator import Classified, ErrorClass
    from tasks.llm import fallback_chain, fallback_reason

    app = ErrorClass.TRANSIENT_APP
    assert fallback_chain("a", ["b", "a", "c", "b"]) == ["a", "b", "c"]
    assert fallback_chain("a", []) == ["a"]
    for code in ("LLM_OVERLOADED", "HTTP_529"):
        assert fallback_reason(Classified(app, code), 30) == "overloaded"
        assert fallback_reason(Classified(app, code, retry_after=1), 30) == "overloaded"
    for code in ("LLM_RATE_LIMITED", "HTTP_429"):
        assert fallback_reason(Classified(app, code, retry_after=31), 30) == "rate_limited"
        assert fallback_reason(Classified(app, code, retry_after=30), 30) is None
        assert fallback_reason(Classified(app, code), 30) is None  # no hint: same model
        assert fallback_reason(Classified(app, code, retry_after=0.5), 0) == "rate_limited"
    for code in ("LLM_UNAVAILABLE", "HTTP_503", "STREAM_STALLED", "LLM_TIMEOUT"):
        assert fallback_reason(Classified(app, code, retry_after=600), 30) is None


async def test_llm_generate_waits_out_the_rate_limit_of_the_local_server(
    orc: Orchestrator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server's rate-limit mode, end to end: the second call in the window gets a 429 whose
    # retry-after the job honours, and it is counted as rate_limited.
    with llm.serve(api_key=KEY, requests_per_window=1, window_seconds=3) as limited:
        monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
        monkeypatch.setenv("ANTHROPIC_BASE_URL", limited.url)
        async with WorkerRun(orc) as worker:
            first = await orc.submit("llm_generate", ask("m"))
            await worker.until_finished(first)
            second = await orc.submit("llm_generate", ask("m"))
            await worker.until_finished(second, timeout=20)
        assert (limited.accepted, limited.rate_limited) == (2, 1)
    job, events = await orc.get_job(second), await orc.job_events(second)
    assert job.status is Status.COMPLETED and job.attempt == 2
    # retry-after: the whole seconds until the first call leaves the 3 s window (3, or 2 on a
    # slow machine that took over a second to start the second job)
    [failure] = failures(events)
    assert failure[:3] == ("TRANSIENT_APP", "LLM_RATE_LIMITED", "app")
    assert failure[3] in (2000.0, 3000.0)
    body, _ = await orc.metrics.exposition("")
    found = exposition.samples(body.decode())
    calls = exposition.value(found, "orchestrator_llm_calls_total", model="m", outcome="ok")
    limited_calls = exposition.value(
        found, "orchestrator_llm_calls_total", model="m", outcome="rate_limited"
    )
    assert (calls, limited_calls) == (2, 1)


async def test_run_agent_resumed_after_a_fallback_keeps_the_reply_and_the_model_of_the_ledger(
    falling_back: Orchestrator, model_server: llm.LocalLLM
) -> None:
    # Step 2 falls back from a to b, b's reply is committed in the ledger, then the step fails
    # (its tool overran) before its checkpoint: the resumed step takes b's reply from the
    # ledger (asking nobody again) and records b as the model that answered it, although the
    # last checkpoint still said a; step 3 asks b.
    query = str(uuid4())
    model_server.script(
        "a", [llm.ToolUse("lookup", {"query": "q"}), llm.Status(529, "overloaded_error")]
    )
    model_server.script("b", [llm.ToolUse("slow_once", {"query": query}), llm.Text("Done.")])
    task = {"prompt": "look it up", "model": "a", "tools": ["lookup", "slow_once"]}
    job_id = await run(falling_back, "run_agent", task)
    job, events = await falling_back.get_job(job_id), await falling_back.job_events(job_id)
    assert job.status is Status.COMPLETED and job.result["answer"] == "Done."
    assert failures(events) == [("TRANSIENT_APP", "CALL_TIMEOUT", "app", 50.0)]
    assert fallbacks(events) == [("a", "b", "overloaded", "LLM_OVERLOADED", None, 2)]
    assert [(t["step"], t["model"]) for t in job.result["turns"]] == [(1, "a"), (2, "b"), (3, "b")]
    assert [model_server.requests[m] for m in "abc"] == [2, 2, 0]
    assert job_types_app.SLOW_ONCE_CALLS[query] == 2
