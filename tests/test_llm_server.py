"""The local Anthropic Messages API (demo/llm_server.py), driven by the real
``anthropic`` SDK with ``max_retries=0``: one SDK call is one request."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from typing import Any

import anthropic
import httpx
import httpx2
import pytest
from anthropic.types import (
    Message,
    MessageParam,
    ToolParam,
    ToolResultBlockParam,
    UserMessageParam,
)

from demo.llm_server import (
    LocalLLM,
    Stall,
    Status,
    StreamError,
    Text,
    ToolUse,
    serve,
)
from demo.llm_server import main as server_main
from orchestrator.domain.classification import classify, ratelimit_reset

KEY = "test-key"
HELLO: list[MessageParam] = [{"role": "user", "content": "hello there"}]
TOOLS: list[ToolParam] = [
    {
        "name": "search",
        "description": "Search the web.",
        "input_schema": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        },
    },
    {
        "name": "fetch",
        "description": "Fetch a page.",
        "input_schema": {
            "type": "object",
            "properties": {
                "url": {"type": "string"},
                "score": {"type": "number"},
                "fresh": {"type": "boolean"},
                "tags": {"type": "array"},
                "meta": {"type": "object"},
            },
        },
    },
]


@pytest.fixture
def llm() -> Iterator[LocalLLM]:
    with serve(api_key=KEY) as server:
        yield server


def make_client(url: str, *, api_key: str = KEY) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key=api_key, max_retries=0)


@pytest.fixture
async def client(llm: LocalLLM) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with make_client(llm.url) as sdk:
        yield sdk


async def ask(client: anthropic.AsyncAnthropic, model: str = "m") -> Message:
    return await client.messages.create(model=model, max_tokens=100, messages=HELLO)


async def ask_streaming(client: anthropic.AsyncAnthropic, model: str = "m") -> Message:
    async with client.messages.stream(model=model, max_tokens=100, messages=HELLO) as stream:
        return await stream.get_final_message()


async def test_json_answer(client: anthropic.AsyncAnthropic) -> None:
    message = await ask(client)
    assert message.id == "msg_1"
    assert message.model == "m"
    assert message.content[0].type == "text"
    assert message.content[0].text == "Echo: hello there"
    assert message.stop_reason == "end_turn"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (2, 3)


async def test_streaming_answer(client: anthropic.AsyncAnthropic) -> None:
    async with client.messages.stream(model="m", max_tokens=100, messages=HELLO) as stream:
        deltas = [text async for text in stream.text_stream]
        message = await stream.get_final_message()
    assert deltas == ["Echo: ", "hello ", "there"]
    assert message.content[0].type == "text"
    assert message.content[0].text == "Echo: hello there"
    assert message.stop_reason == "end_turn"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (2, 3)


async def test_stream_event_order(client: anthropic.AsyncAnthropic, llm: LocalLLM) -> None:
    llm.script("m", [Text("one two")])
    stream = await client.messages.create(model="m", max_tokens=100, messages=HELLO, stream=True)
    events = [event async for event in stream]
    assert [event.type for event in events] == [
        "message_start",
        "content_block_start",  # the SDK drops the ping that follows
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0].type == "message_start"
    assert events[0].message.usage.output_tokens == 1
    assert events[0].message.stop_reason is None
    raw = await raw_stream(llm.url, {"model": "m", "max_tokens": 9, "messages": HELLO})
    assert [name for name, _ in raw][:3] == ["message_start", "content_block_start", "ping"]
    assert all(data["type"] == name for name, data in raw)


async def raw_stream(url: str, body: dict[str, Any]) -> list[tuple[str, Any]]:
    """The SSE events of a streamed request, read with plain httpx: (event, data)."""
    async with httpx.AsyncClient(base_url=url, headers={"x-api-key": KEY}) as http:
        response = await http.post("/v1/messages", json={**body, "stream": True})
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["transfer-encoding"] == "chunked"
    blocks = [b.split("\n") for b in response.text.split("\n\n") if b]
    return [(event[len("event: ") :], json.loads(data[len("data: ") :])) for event, data in blocks]


async def test_rate_limit_with_retry_after(client: anthropic.AsyncAnthropic, llm: LocalLLM) -> None:
    llm.script("m", [Status(429, "rate_limit_error", "slow down", retry_after="2")])
    with pytest.raises(anthropic.RateLimitError) as caught:
        await ask(client)
    assert caught.value.response.headers["retry-after"] == "2"
    assert "retry-after-ms" not in caught.value.response.headers
    assert caught.value.type == "rate_limit_error"
    assert caught.value.api_message == "slow down"


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (Status(529, "overloaded_error"), anthropic.OverloadedError),
        (Status(500, "api_error"), anthropic.InternalServerError),
        (Status(503, "api_error", retry_after_ms="250"), anthropic.ServiceUnavailableError),
        (Status(400, "invalid_request_error"), anthropic.BadRequestError),
        (Status(401, "authentication_error"), anthropic.AuthenticationError),
    ],
)
async def test_scripted_status(
    client: anthropic.AsyncAnthropic, llm: LocalLLM, reply: Status, error: type[Exception]
) -> None:
    llm.script("m", [reply])
    for call in (ask, ask_streaming):
        with pytest.raises(error) as caught:
            await call(client, "m")
        assert isinstance(caught.value, anthropic.APIStatusError)
        assert caught.value.status_code == reply.status
        assert caught.value.type == reply.error_type
        if reply.retry_after_ms:
            assert caught.value.response.headers["retry-after-ms"] == reply.retry_after_ms
    assert issubclass(anthropic.OverloadedError, anthropic.InternalServerError)


async def test_wrong_key(llm: LocalLLM) -> None:
    async with make_client(llm.url, api_key="wrong-key") as wrong:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            await ask(wrong)
    assert caught.value.type == "authentication_error"
    assert caught.value.api_message == "invalid x-api-key"
    assert KEY not in str(caught.value.body) and "wrong-key" not in str(caught.value.body)
    assert llm.requests["m"] == 1  # counted all the same
    async with httpx.AsyncClient(base_url=llm.url) as http:  # the x-api-key header works too
        body = {"model": "m", "max_tokens": 5, "messages": HELLO}
        assert (await http.post("/v1/messages", json=body, headers={"x-api-key": KEY})).is_success
        assert (await http.post("/v1/messages", json=body)).status_code == 401


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"{not json", "not a JSON object"),
        (b'{"messages": [], "max_tokens": 5}', "model: Field required"),
        (b'{"model": "m", "max_tokens": 5}', "messages: Field required"),
        (b'{"model": "m", "messages": []}', "max_tokens: Field required"),
        (b'{"model": "m", "messages": [], "max_tokens": "5"}', "max_tokens: Input should be"),
    ],
)
async def test_malformed_request(llm: LocalLLM, content: bytes, problem: str) -> None:
    async with httpx.AsyncClient(base_url=llm.url, headers={"x-api-key": KEY}) as http:
        response = await http.post("/v1/messages", content=content)
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert problem in error["error"]["message"]
    assert llm.total == 1


async def test_bad_request_through_sdk(client: anthropic.AsyncAnthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        await client.messages.create(
            model="m", max_tokens=5, messages=HELLO, extra_body={"max_tokens": None}
        )
    assert caught.value.type == "invalid_request_error"
    assert caught.value.api_message is not None
    assert "max_tokens" in caught.value.api_message


async def test_stall_blocks_after_the_deltas(
    client: anthropic.AsyncAnthropic, llm: LocalLLM
) -> None:
    llm.script("m", [Stall(after_chunks=2)])
    stream = await client.messages.create(model="m", max_tokens=9, messages=HELLO, stream=True)
    seen = [event.type async for event in take(stream, 4)]
    assert seen == ["message_start", "content_block_start"] + ["content_block_delta"] * 2
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(anext(stream), 0.3)
    with pytest.raises(anthropic.APITimeoutError):  # not streaming: no answer at all
        await client.messages.create(model="m", max_tokens=9, messages=HELLO, timeout=0.3)
    assert llm.requests["m"] == 2


async def take(stream: AsyncIterator[Any], n: int) -> AsyncIterator[Any]:
    for _ in range(n):
        yield await anext(stream)


async def test_stall_is_closed_when_the_server_stops() -> None:
    with serve() as stalling:
        stalling.script("m", [Stall(after_chunks=1)])
        sdk = make_client(stalling.url)
        stream = await sdk.messages.create(model="m", max_tokens=9, messages=HELLO, stream=True)
        assert [e.type async for e in take(stream, 3)][-1] == "content_block_delta"
        pending = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.1)
        assert not pending.done()
    # The connection was closed under the stream. Mid-stream, the SDK does not wrap transport
    # errors in APIConnectionError: httpx2's own error arrives.
    with pytest.raises(httpx2.RemoteProtocolError):
        await asyncio.wait_for(pending, 1)
    await sdk.close()


async def test_stream_error_mid_stream(client: anthropic.AsyncAnthropic, llm: LocalLLM) -> None:
    llm.script("m", [StreamError("overloaded_error", after_chunks=2)])
    texts: list[str] = []
    async with client.messages.stream(model="m", max_tokens=9, messages=HELLO) as stream:
        with pytest.raises(anthropic.APIStatusError) as caught:
            async for text in stream.text_stream:
                texts.append(text)
    assert texts == ["part1 ", "part2 "]
    # The HTTP status was 200, so the SDK cannot map it to OverloadedError: the bare base class.
    assert type(caught.value) is anthropic.APIStatusError
    assert caught.value.status_code == 200
    assert caught.value.type == "overloaded_error"
    with pytest.raises(anthropic.OverloadedError):  # without streaming: an HTTP 529
        await ask(client)
    assert (await ask(client, "other")).content  # the connection is still usable


async def test_slow_steady_stream(client: anthropic.AsyncAnthropic, llm: LocalLLM) -> None:
    llm.script("m", [Text("one two three four five six", chunks=3, every=0.05)])
    arrivals: list[float] = []
    started = time.monotonic()
    async with client.messages.stream(model="m", max_tokens=9, messages=HELLO) as stream:
        async for _ in stream.text_stream:
            arrivals.append(time.monotonic() - started)
        message = await stream.get_final_message()
    assert message.content[0].type == "text"
    assert message.content[0].text == "one two three four five six"
    assert len(arrivals) == 3
    assert arrivals[-1] >= 0.15  # three deltas, each sent 0.05 s after the one before
    assert message.usage.output_tokens == 6


async def test_padded_chunks() -> None:
    with serve(chunks=6, chunk_every=0.01) as padded:
        async with make_client(padded.url) as sdk:
            async with sdk.messages.stream(model="m", max_tokens=9, messages=HELLO) as stream:
                deltas = [text async for text in stream.text_stream]
            assert len(deltas) == 6 and all(deltas)
            assert "".join(deltas).startswith("Echo: hello there")
            same = await ask(sdk)  # JSON gives the same (padded) text
            assert same.content[0].type == "text"
            assert same.content[0].text == "".join(deltas)


async def test_scripted_tool_use(client: anthropic.AsyncAnthropic, llm: LocalLLM) -> None:
    llm.script("m", [ToolUse("lookup", {"key": "a", "n": [1, 2]}), Text("done")])
    first = await ask_streaming(client)
    assert first.stop_reason == "tool_use"
    (block,) = first.content
    assert block.type == "tool_use"
    assert (block.id, block.name, block.input) == ("toolu_1", "lookup", {"key": "a", "n": [1, 2]})
    second, third = await ask(client), await ask(client)  # the last reply repeats
    assert [m.content[0].type == "text" and m.content[0].text for m in (second, third)] == [
        "done",
        "done",
    ]


async def run_agent(client: anthropic.AsyncAnthropic, *, stream: bool) -> list[Message]:
    """Call tools until the model ends its turn; each tool returns a result naming its input."""
    messages: list[MessageParam] = [{"role": "user", "content": "research retry budgets"}]
    turns: list[Message] = []
    while not turns or turns[-1].stop_reason == "tool_use":
        kwargs: dict[str, Any] = {"model": "agent", "max_tokens": 100, "tools": TOOLS}
        if stream:
            async with client.messages.stream(messages=messages, **kwargs) as events:
                turns.append(await events.get_final_message())
        else:
            turns.append(await client.messages.create(messages=messages, **kwargs))
        messages.append({"role": "assistant", "content": turns[-1].content})
        results: list[ToolResultBlockParam] = [
            {
                "type": "tool_result",
                "tool_use_id": b.id,
                "content": f"{b.name}:{json.dumps(b.input)}",
            }
            for b in turns[-1].content
            if b.type == "tool_use"
        ]
        if results:
            user: UserMessageParam = {"role": "user", "content": results}
            messages.append(user)
    return turns


async def test_default_agent_mode(client: anthropic.AsyncAnthropic, llm: LocalLLM) -> None:
    turns = await run_agent(client, stream=True)
    assert [t.stop_reason for t in turns] == ["tool_use"] * 3 + ["end_turn"]
    calls = [b for t in turns for b in t.content if b.type == "tool_use"]
    assert [(c.id, c.name) for c in calls] == [
        ("toolu_1_1", "search"),
        ("toolu_2_1", "fetch"),
        ("toolu_3_1", "search"),
    ]
    assert calls[0].input == {"query": "query-1", "limit": 1}
    assert calls[1].input == {"url": "url-2", "score": 2.0, "fresh": True, "tags": [], "meta": {}}
    assert calls[2].input == {"query": "query-3", "limit": 3}
    texts = [b.text for t in turns for b in t.content if b.type == "text"]
    assert texts[:3] == [
        "Step 1: calling search.",
        "Step 2: calling fetch.",
        "Step 3: calling search.",
    ]
    assert texts[3] == (
        'Finished after 3 tool calls: search:{"query": "query-1", "limit": 1}; '
        'fetch:{"url": "url-2", "score": 2.0, "fresh": true, "tags": [], "meta": {}}; '
        'search:{"query": "query-3", "limit": 3}.'
    )
    assert llm.last_body("agent")["messages"][-1]["content"][0]["tool_use_id"] == "toolu_3_1"
    # Deterministic: the same conversation without streaming gets the same answers.
    again = await run_agent(client, stream=False)
    assert [t.model_dump(exclude={"id"}) for t in again] == [
        t.model_dump(exclude={"id"}) for t in turns
    ]


async def test_agent_steps_option() -> None:
    with serve(agent_steps=1) as short:
        async with make_client(short.url) as sdk:
            turns = await run_agent(sdk, stream=False)
    assert [t.stop_reason for t in turns] == ["tool_use", "end_turn"]


async def test_counting(client: anthropic.AsyncAnthropic, llm: LocalLLM) -> None:
    llm.script("flaky", [Status(529, "overloaded_error"), Text("ok")])
    with pytest.raises(anthropic.OverloadedError):
        await ask(client, "flaky")
    await ask(client, "flaky")
    await ask_streaming(client, "flaky")
    await ask(client, "steady")
    async with make_client(llm.url, api_key="nope") as wrong:
        with pytest.raises(anthropic.AuthenticationError):
            await ask(wrong, "steady")
    assert llm.requests == {"flaky": 3, "steady": 2}
    assert llm.total == 5
    assert llm.last_body("flaky")["stream"] is True
    assert llm.last_body("steady")["messages"] == HELLO
    async with httpx.AsyncClient(base_url=llm.url) as http:
        stats = (await http.get("/_stats")).json()
    assert stats == {
        "total": 5,
        "by_model": {"flaky": 3, "steady": 2},
        "accepted": 4,  # the wrong key's request never reached the limits
        "rate_limited": 0,
        "max_in_flight": 1,
        "accepted_tokens": 4 * (2 + 100),
    }


async def test_as_a_process() -> None:
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "demo.llm_server", "--port", "0", "--api-key", KEY),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 10)).decode()
        assert line.startswith("listening on http://127.0.0.1:")
        url = line.split()[-1]
        async with make_client(url) as sdk:
            assert (await ask_streaming(sdk, "p")).content[0].type == "text"
        async with httpx.AsyncClient(base_url=url) as http:
            stats = (await http.get("/_stats")).json()
            assert (stats["total"], stats["by_model"], stats["accepted"]) == (1, {"p": 1}, 1)
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 5) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_concurrent_streams() -> None:
    with serve(chunks=5, chunk_every=0.02) as busy:
        async with make_client(busy.url) as sdk:
            started = time.monotonic()
            messages = await asyncio.gather(*(ask_streaming(sdk, "m") for _ in range(200)))
            elapsed = time.monotonic() - started
    assert all(m.content[0].type == "text" and m.usage.output_tokens == 5 for m in messages)
    assert len({m.id for m in messages}) == 200
    assert busy.total == 200
    assert elapsed < 10  # one after another would take 200 x 0.1 s


# -- the rate-limit mode ------------------------------------------------------------------------

ASK = 2 + 100  # HELLO's input tokens + max_tokens: what one ask() costs against the window


async def ask_raw(client: anthropic.AsyncAnthropic, model: str = "m") -> httpx2.Headers:
    raw = await client.messages.with_raw_response.create(
        model=model, max_tokens=100, messages=HELLO
    )
    assert (await raw.parse()).content[0].type == "text"
    return raw.headers


async def refused(client: anthropic.AsyncAnthropic) -> anthropic.RateLimitError:
    with pytest.raises(anthropic.RateLimitError) as info:
        await ask(client)
    return info.value


def _reset_in(value: str) -> float:
    return (datetime.fromisoformat(value) - datetime.now(UTC)).total_seconds()


async def test_requests_per_window_with_retry_after_and_the_ratelimit_headers() -> None:
    with serve(requests_per_window=3, window_seconds=2) as llm:
        async with make_client(llm.url) as sdk:
            remaining = []
            for _ in range(3):
                headers = await ask_raw(sdk)
                assert headers["anthropic-ratelimit-requests-limit"] == "3"
                assert 0 < _reset_in(headers["anthropic-ratelimit-requests-reset"]) <= 2
                assert "anthropic-ratelimit-tokens-limit" not in headers  # no token limit set
                remaining.append(headers["anthropic-ratelimit-requests-remaining"])
            assert remaining == ["2", "1", "0"]
            error = await refused(sdk)
            assert error.body == {
                "type": "error",
                "error": {
                    "type": "rate_limit_error",
                    "message": "rate limit exceeded: this request would exceed the allowance "
                    "of the window",
                },
            }
            headers = error.response.headers
            assert headers["retry-after"] == "2"  # whole seconds, rounded up
            assert "retry-after-ms" not in headers
            assert headers["anthropic-ratelimit-requests-remaining"] == "0"
            # What the orchestrator reads of it: a rate limit, the header's hint.
            classified = classify(error)
            assert (classified.throttle, classified.retry_after) == ("rate_limited", 2)
            assert 0 < (ratelimit_reset(headers, now=datetime.now(UTC)) or 0) <= 2
            await asyncio.sleep(2.05)
            await ask(sdk)  # the window slid past the first three
        assert (llm.accepted, llm.rate_limited, llm.accepted_tokens) == (4, 1, 4 * ASK)
        assert llm.total == 5


async def test_a_refused_request_does_not_count_and_the_window_slides() -> None:
    with serve(requests_per_window=2, window_seconds=1.5) as llm:
        async with make_client(llm.url) as sdk:
            await ask(sdk)
            first_done = time.monotonic()  # the first was accepted before this
            await asyncio.sleep(0.6)
            await ask(sdk)
            for _ in range(5):
                await refused(sdk)
            # The first request leaves the window 1.5 s after it was accepted; the refused
            # ones never entered it, so exactly one request fits then.
            await asyncio.sleep(max(0.0, first_done + 1.55 - time.monotonic()))
            await ask(sdk)
            error = await refused(sdk)
            # The next slot frees when the second request leaves, about 0.5 s from now.
            assert error.response.headers["retry-after"] == "1"
        assert (llm.accepted, llm.rate_limited) == (3, 6)


async def test_tokens_per_window_count_input_and_max_tokens() -> None:
    with serve(tokens_per_window=2 * ASK + 50, window_seconds=60) as llm:
        async with make_client(llm.url) as sdk:
            first = await ask_raw(sdk)
            second = await ask_raw(sdk)
            assert first["anthropic-ratelimit-tokens-limit"] == str(2 * ASK + 50)
            assert first["anthropic-ratelimit-tokens-remaining"] == str(ASK + 50)
            assert second["anthropic-ratelimit-tokens-remaining"] == "50"
            assert "anthropic-ratelimit-requests-limit" not in first
            error = await refused(sdk)
            assert 58 <= int(error.response.headers["retry-after"]) <= 60
            # A smaller request still fits in what is left.
            small = await sdk.messages.create(model="m", max_tokens=48, messages=HELLO)
            assert small.usage.input_tokens == 2
            with pytest.raises(anthropic.BadRequestError, match="can never fit"):
                await sdk.messages.create(model="m", max_tokens=4 * ASK, messages=HELLO)
        assert (llm.accepted, llm.rate_limited) == (3, 1)
        assert llm.accepted_tokens == 2 * ASK + 50


async def test_retry_after_ms_only_when_asked() -> None:
    with serve(requests_per_window=1, window_seconds=1.5, retry_after_ms=True) as llm:
        async with make_client(llm.url) as sdk:
            await ask(sdk)
            headers = (await refused(sdk)).response.headers
            assert headers["retry-after"] == "2"
            assert 1_000 < int(headers["retry-after-ms"]) <= 1_500


async def test_max_concurrent_refuses_requests_beyond_the_cap() -> None:
    with serve(max_concurrent=2, chunks=5, chunk_every=0.1) as llm:
        async with make_client(llm.url) as sdk:
            results = await asyncio.gather(
                *(ask_streaming(sdk) for _ in range(6)), return_exceptions=True
            )
            limited = [r for r in results if isinstance(r, anthropic.RateLimitError)]
            assert len(limited) == 4
            assert all(r.response.headers["retry-after"] == "1" for r in limited)
            assert sum(isinstance(r, Message) for r in results) == 2
            await ask_streaming(sdk)  # the slots came back with the replies
        assert (llm.max_in_flight, llm.accepted, llm.rate_limited) == (2, 3, 4)


async def test_scripted_errors_under_limits_count_and_carry_the_headers() -> None:
    with serve(requests_per_window=5, tokens_per_window=10_000) as llm:
        llm.script("m", [Status(529, "overloaded_error"), Text("fine")])
        async with make_client(llm.url) as sdk:
            with pytest.raises(anthropic.OverloadedError) as info:
                await ask(sdk)
            headers = info.value.response.headers
            assert headers["anthropic-ratelimit-requests-remaining"] == "4"
            assert headers["anthropic-ratelimit-tokens-remaining"] == str(10_000 - ASK)
            assert classify(info.value).throttle == "overloaded"
            streamed = await ask_streaming(sdk)
            assert streamed.content[0].type == "text"
        assert (llm.accepted, llm.rate_limited) == (2, 0)


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="requests_per_window must be at least 1"):
        LocalLLM(requests_per_window=0)
    with pytest.raises(ValueError, match="window_seconds must be > 0"):
        LocalLLM(window_seconds=0)


def test_the_cli_refuses_a_bad_limit_without_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        server_main(["--rpm", "0"])
    assert info.value.code == 2
    assert "requests_per_window must be at least 1, got 0" in capsys.readouterr().err


async def test_the_cli_limits() -> None:
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "demo.llm_server", "--port", "0", "--rpm", "2", "--tpm", "1000",
          "--window", "30", "--max-concurrent", "4"),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        url = (await asyncio.wait_for(process.stdout.readline(), 10)).decode().split()[-1]
        async with make_client(url) as sdk:
            headers = await ask_raw(sdk)
            assert headers["anthropic-ratelimit-tokens-remaining"] == str(1000 - ASK)
            await ask(sdk)
            assert 28 <= int((await refused(sdk)).response.headers["retry-after"]) <= 30
        async with httpx.AsyncClient(base_url=url) as http:
            stats = (await http.get("/_stats")).json()
        assert {k: stats[k] for k in ("accepted", "rate_limited", "max_in_flight")} == {
            "accepted": 2, "rate_limited": 1, "max_in_flight": 1,
        }  # fmt: skip
        assert stats["accepted_tokens"] == 2 * ASK
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 5) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
