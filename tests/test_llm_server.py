"""The local Anthropic Messages API (demo/llm_server.py), driven by the real
``anthropic`` SDK with ``max_retries=0``: one SDK call is one request."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
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
    assert stats == {"total": 5, "by_model": {"flaky": 3, "steady": 2}}


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
            assert (await http.get("/_stats")).json() == {"total": 1, "by_model": {"p": 1}}
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
