"""A local stand-in for the Anthropic Messages API on 127.0.0.1, so tests, benchmarks and the
demo drive the real ``anthropic`` SDK (its retries, error classes and stream parser) offline.

``POST /v1/messages`` answers as JSON or, with ``"stream": true``, as server-sent events in
the real API's order (message_start, content_block_start, ping, deltas, content_block_stop,
message_delta, message_stop). Every request is counted per model (``GET /_stats`` too). Given
an ``api_key``, a request must carry it as ``x-api-key`` or as ``Authorization: Bearer`` (how
the ``anthropic`` SDK 2.x sends ``api_key``), or gets a 401.

Replies are scripted per model with ``llm.script(model, [...])``; the last one repeats:

- ``Text``: a normal answer, streamed in ``chunks`` deltas ``every`` seconds apart (slow but
  steady streams that must not be mistaken for hung ones).
- ``Status``: an HTTP error in the API's error shape, with ``retry-after`` headers if given
  (rate limits, overload, bad keys, bad requests, server errors).
- ``Stall``: a stream that stops after a few deltas and stays open (a hung connection).
- ``StreamError``: a stream that fails mid-way with an SSE ``error`` event, as the API does.
- ``ToolUse``: one ``tool_use`` block, stop_reason "tool_use".

Prompt caching is counted as the API counts it: the words of the content blocks up to the last
one marked ``cache_control`` are ``cache_creation_input_tokens`` the first time that prefix is
seen and ``cache_read_input_tokens`` after, not ``input_tokens``.

Without a script the answer depends only on the request, so an interrupted agent run and an
uninterrupted one see the same turns: with ``tools``, ``agent_steps`` tool calls (inputs built
from the tools' schemas), then a text that summarises the tool results; without, an echo.

    with serve(api_key="k") as llm: ...                      # in process, a background thread
    python -m demo.llm_server --port 0 --chunks 20 --chunk-every 0.5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import signal
import threading
from asyncio import StreamReader, StreamWriter
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from http.client import responses
from typing import Any, TypedDict, Unpack

Json = dict[str, Any]


@dataclass(frozen=True)
class Text:
    text: str
    chunks: int | None = None  # text deltas when streaming; None: one per word
    every: float = 0.0  # seconds before each delta


@dataclass(frozen=True)
class Status:
    status: int
    error_type: str
    message: str = "scripted error"
    retry_after: str | None = None
    retry_after_ms: str | None = None


@dataclass(frozen=True)
class Stall:
    after_chunks: int = 2


@dataclass(frozen=True)
class StreamError:
    error_type: str = "overloaded_error"
    after_chunks: int = 1


@dataclass(frozen=True)
class ToolUse:
    name: str
    input: Json


Reply = Text | Status | Stall | StreamError | ToolUse

#: The status a non-streaming request gets for a scripted ``StreamError``.
_STATUS_OF = {"invalid_request_error": 400, "rate_limit_error": 429, "overloaded_error": 529}
_REASONS = {**responses, 529: "Overloaded"}


class Options(TypedDict, total=False):
    port: int
    chunks: int | None
    chunk_every: float
    agent_steps: int
    api_key: str | None


@dataclass
class _Answer:
    content: list[Json]
    stop_reason: str
    chunks: int | None = None
    every: float = 0.0
    cut_after: int | None = None  # Stall / StreamError: text deltas sent before the cut
    error_type: str | None = None  # StreamError: the SSE error sent at the cut


class LocalLLM:
    """The server; its counters and scripts are safe to use from any thread."""

    def __init__(
        self,
        *,
        port: int = 0,
        chunks: int | None = None,
        chunk_every: float = 0.0,
        agent_steps: int = 3,
        api_key: str | None = None,
    ) -> None:
        self.url = ""
        self._port, self._chunks, self._every = port, chunks, chunk_every
        self._agent_steps, self._api_key = agent_steps, api_key
        self._lock = threading.Lock()
        self._requests: Counter[str] = Counter()
        self._total = 0
        self._last: dict[str, Json] = {}
        self._scripts: dict[str, list[Reply]] = {}
        self._cached: set[str] = set()  # prompt prefixes written to the cache
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def requests(self) -> Counter[str]:
        """Requests to /v1/messages by model (a copy), errors included."""
        with self._lock:
            return self._requests.copy()

    @property
    def total(self) -> int:
        """All requests to /v1/messages, including those without a readable model."""
        with self._lock:
            return self._total

    def last_body(self, model: str) -> Json:
        with self._lock:
            return self._last[model]

    def script(self, model: str, replies: list[Reply]) -> None:
        with self._lock:
            self._scripts[model] = list(replies)

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._connection, "127.0.0.1", self._port, backlog=4096
        )
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def aclose(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._connections:
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()

    async def _connection(self, reader: StreamReader, writer: StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            while await self._exchange(reader, writer):
                pass
        except (ConnectionError, EOFError, asyncio.LimitOverrunError, ValueError):
            pass  # the client went away (EOFError: mid-request), or did not speak HTTP/1.1
        except asyncio.CancelledError:
            pass  # aclose(); Python 3.11's start_server logs a handler that ends cancelled
        finally:
            self._connections.discard(task)
            writer.close()

    async def _exchange(self, reader: StreamReader, writer: StreamWriter) -> bool:
        """Answer one request; whether the connection stays open for another."""
        head = await reader.readuntil(b"\r\n\r\n")
        request_line, *lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
        method, target, version = request_line.split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines)}
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        path = target.partition("?")[0]
        if (method, path) == ("GET", "/_stats"):
            with self._lock:
                stats = {"total": self._total, "by_model": dict(self._requests)}
            return await _send_json(writer, 200, stats, keep)
        if (method, path) != ("POST", "/v1/messages"):
            return await _send_error(writer, Status(404, "not_found_error", f"no {path}"), keep)
        return await self._messages(headers, body, reader, writer, keep)

    async def _messages(
        self,
        headers: dict[str, str],
        raw: bytes,
        reader: StreamReader,
        writer: StreamWriter,
        keep: bool,
    ) -> bool:
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        model = body.get("model") if isinstance(body, dict) else None
        with self._lock:
            self._total += 1
            number = self._total
            if isinstance(model, str):
                self._requests[model] += 1
                self._last[model] = body
        key = headers.get("x-api-key") or headers.get("authorization", "").removeprefix("Bearer ")
        if self._api_key is not None and key != self._api_key:
            bad_key = Status(401, "authentication_error", "invalid x-api-key")
            return await _send_error(writer, bad_key, keep)
        if problem := _problem(body):
            return await _send_error(writer, Status(400, "invalid_request_error", problem), keep)
        assert isinstance(body, dict) and isinstance(model, str)
        with self._lock:
            script = self._scripts.get(model)
            reply = (script.pop(0) if len(script) > 1 else script[0]) if script else None
        if isinstance(reply, Status):
            return await _send_error(writer, reply, keep)
        answer = self._answer(reply, body, number)
        said = [
            b["text"] if b["type"] == "text" else json.dumps(b["input"]) for b in answer.content
        ]
        usage = {
            "input_tokens": _words(_text(body["messages"])),
            "output_tokens": _words(" ".join(said)),
        }
        if prefix := _cached_prefix(body["messages"]):  # prompt caching, as the API counts it
            with self._lock:
                kind = "read" if prefix in self._cached else "creation"
                self._cached.add(prefix)
            cached = _words(prefix)
            usage["input_tokens"] -= cached
            usage[f"cache_{kind}_input_tokens"] = cached
        message: Json = {
            "id": f"msg_{number}",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": answer.content,
            "stop_reason": answer.stop_reason,
            "stop_sequence": None,
            "usage": usage,
        }
        if body.get("stream") is True:
            return await _stream(reader, writer, message, answer, keep)
        if answer.cut_after is None:
            return await _send_json(writer, 200, message, keep)
        if answer.error_type is None:  # a stall: never answer
            await _until_eof(reader)
            return False
        status = _STATUS_OF.get(answer.error_type, 500)
        return await _send_error(writer, Status(status, answer.error_type, "stream failed"), keep)

    def _answer(self, reply: Reply | None, body: Json, number: int) -> _Answer:
        match reply:
            case Text(text, chunks, every):
                return _Answer([_text_block(text, chunks)], "end_turn", chunks, every)
            case ToolUse(name, tool_input):
                block = {
                    "type": "tool_use",
                    "id": f"toolu_{number}",
                    "name": name,
                    "input": tool_input,
                }
                return _Answer([block], "tool_use")
            case Stall(after):
                return _Answer([_partial(after)], "end_turn", cut_after=after)
            case StreamError(error_type, after):
                return _Answer(
                    [_partial(after)], "end_turn", cut_after=after, error_type=error_type
                )
        return self._default(body)

    def _default(self, body: Json) -> _Answer:
        messages: list[Json] = body["messages"]
        tools: list[Json] = body.get("tools") or []
        step = 1 + sum(m.get("role") == "assistant" for m in messages)
        if tools and step <= self._agent_steps:
            tool = tools[(step - 1) % len(tools)]
            schema = tool.get("input_schema", {}).get("properties", {})
            tool_input = {p: _example(s.get("type"), p, step) for p, s in schema.items()}
            blocks = [
                _text_block(f"Step {step}: calling {tool['name']}.", self._chunks),
                {
                    "type": "tool_use",
                    "id": f"toolu_{step}_1",
                    "name": tool["name"],
                    "input": tool_input,
                },
            ]
            return _Answer(blocks, "tool_use", self._chunks, self._every)
        if tools:
            results = [
                _text(block.get("content", ""))
                for m in messages
                if isinstance(m.get("content"), list)
                for block in m["content"]
                if block.get("type") == "tool_result"
            ]
            text = f"Finished after {len(results)} tool calls: {'; '.join(results) or 'none'}."
        else:
            users = [m for m in messages if m.get("role") == "user"]
            text = "Echo: " + (_text(users[-1].get("content")) if users else "")
        return _Answer([_text_block(text, self._chunks)], "end_turn", self._chunks, self._every)


def _problem(body: object) -> str | None:
    """What makes a request body invalid, if anything."""
    if not isinstance(body, dict):
        return "the request body is not a JSON object"
    wanted = {"model": str, "messages": list, "max_tokens": int}
    for field, kind in wanted.items():
        if field not in body:
            return f"{field}: Field required"
        if not isinstance(body[field], kind):
            return f"{field}: Input should be a valid {kind.__name__}"
    if not all(isinstance(m, dict) for m in body["messages"]):
        return "messages: each message should be an object"
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) and "name" in t for t in tools):
        return "tools: each tool should be an object with a name"
    return None


def _example(kind: object, name: str, step: int) -> object:
    """A tool input value for a JSON schema type, different at each step."""
    values = {"string": f"{name}-{step}", "integer": step, "number": float(step), "boolean": True}
    return values.get(str(kind), [] if kind == "array" else {})


def _text(content: object) -> str:
    """The text in message content: a string, blocks, tool results, or a list of messages."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(t for item in content if (t := _text(item)))
    if isinstance(content, dict):
        return _text(content.get("text", content.get("content", "")))
    return ""


def _cached_prefix(messages: list[Any]) -> str:
    """The text of the messages up to their last block marked ``cache_control`` ('': none)."""
    blocks = [
        b for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
        for b in m["content"]
    ]  # fmt: skip
    marked = [i for i, b in enumerate(blocks) if isinstance(b, dict) and b.get("cache_control")]
    return _text(blocks[: marked[-1] + 1]) if marked else ""


def _words(text: str) -> int:
    return len(text.split())


def _partial(deltas: int) -> Json:
    """A text of one word more than the deltas sent before a stall or a stream error."""
    return _text_block(" ".join(f"part{i}" for i in range(1, deltas + 2)))


def _text_block(text: str, chunks: int | None = None) -> Json:
    """A text block, padded with words when ``chunks`` pieces need more words than it has."""
    missing = (chunks or 0) - len(_pieces(text))
    return {"type": "text", "text": text + " ..." * max(missing, 0)}


def _pieces(text: str, chunks: int | None = None) -> list[str]:
    """``text`` in ``chunks`` pieces of whole words (one per word when None)."""
    words = re.findall(r"\s*\S+\s*", text)
    n = chunks or len(words)
    return ["".join(words[i * len(words) // n : (i + 1) * len(words) // n]) for i in range(n)]


def _events(message: Json, answer: _Answer) -> Iterator[tuple[float, Json]]:
    """The stream of ``message``: each event with the seconds to wait before sending it."""
    usage = {**message["usage"], "output_tokens": 1}
    start = {**message, "content": [], "stop_reason": None, "usage": usage}
    yield 0.0, {"type": "message_start", "message": start}
    for index, block in enumerate(message["content"]):
        deltas: list[tuple[float, Json]]
        if block["type"] == "text":
            first: Json = {"type": "text", "text": ""}
            pieces = _pieces(block["text"], answer.chunks)
            deltas = [(answer.every, {"type": "text_delta", "text": p}) for p in pieces]
        else:
            first, raw = {**block, "input": {}}, json.dumps(block["input"])
            pieces = [raw[i : i + 16] for i in range(0, len(raw), 16)]
            deltas = [(0.0, {"type": "input_json_delta", "partial_json": p}) for p in pieces]
        yield 0.0, {"type": "content_block_start", "index": index, "content_block": first}
        if index == 0:
            yield 0.0, {"type": "ping"}
        for wait, delta in deltas:
            yield wait, {"type": "content_block_delta", "index": index, "delta": delta}
        yield 0.0, {"type": "content_block_stop", "index": index}
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": None}
    usage = {"output_tokens": message["usage"]["output_tokens"]}
    yield 0.0, {"type": "message_delta", "delta": delta, "usage": usage}
    yield 0.0, {"type": "message_stop"}


async def _stream(
    reader: StreamReader,
    writer: StreamWriter,
    message: Json,
    answer: _Answer,
    keep: bool,
) -> bool:
    head = {"content-type": "text/event-stream", "cache-control": "no-cache"}
    writer.write(_head(200, {**head, "transfer-encoding": "chunked"}, keep))
    sent = 0
    for wait, event in _events(message, answer):
        if event["type"] == "content_block_delta":
            if sent == answer.cut_after:
                break
            sent += 1
        if wait:
            await asyncio.sleep(wait)
        await _chunk(writer, event)
    else:  # sent it all
        await _chunk(writer, None)
        return keep
    if answer.error_type is None:  # a stall: nothing more, not even pings
        await _until_eof(reader)
        return False
    await _chunk(writer, _error_body(answer.error_type, "stream failed"))
    await _chunk(writer, None)
    return keep


async def _chunk(writer: StreamWriter, event: Json | None) -> None:
    """One SSE event as one HTTP chunk; None: the last, empty chunk."""
    payload = f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode() if event else b""
    writer.write(b"%x\r\n%s\r\n" % (len(payload), payload))
    await writer.drain()


async def _until_eof(reader: StreamReader) -> None:
    while await reader.read(65536):
        pass


def _head(status: int, headers: dict[str, str], keep: bool) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, '')}"]
    headers = {**headers, "connection": "keep-alive" if keep else "close"}
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _send_json(
    writer: StreamWriter, status: int, obj: Json, keep: bool, headers: dict[str, str] | None = None
) -> bool:
    body = json.dumps(obj).encode()
    head = {"content-type": "application/json", "content-length": str(len(body))}
    writer.write(_head(status, head | (headers or {}), keep) + body)
    await writer.drain()
    return keep


async def _send_error(writer: StreamWriter, error: Status, keep: bool) -> bool:
    retry = {"retry-after": error.retry_after, "retry-after-ms": error.retry_after_ms}
    headers = {name: value for name, value in retry.items() if value is not None}
    body = _error_body(error.error_type, error.message)
    return await _send_json(writer, error.status, body, keep, headers)


def _error_body(error_type: str, message: str) -> Json:
    return {"type": "error", "error": {"type": error_type, "message": message}}


@contextlib.contextmanager
def serve(**options: Unpack[Options]) -> Iterator[LocalLLM]:
    """A ``LocalLLM`` on its own event loop in a background thread, for the ``with`` block."""
    llm = LocalLLM(**options)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="local-llm", daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(llm.start(), loop).result()
        try:
            yield llm
        finally:
            asyncio.run_coroutine_threadsafe(llm.aclose(), loop).result()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


async def _run(llm: LocalLLM) -> None:
    await llm.start()
    print(f"listening on {llm.url}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await llm.aclose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A local Anthropic Messages API (see the source).")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--chunks", type=int, default=None, help="text deltas per answer")
    parser.add_argument("--chunk-every", type=float, default=0.0, help="seconds between deltas")
    parser.add_argument("--agent-steps", type=int, default=3, help="tool calls before the end")
    parser.add_argument("--api-key", default=None, help="the key to require")
    args = parser.parse_args(argv)
    asyncio.run(_run(LocalLLM(**vars(args))))


if __name__ == "__main__":
    main()
