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
  (rate limits, overload, bad keys, bad requests, server errors): as given (``retry_after``,
  ``retry_after_ms``), as an HTTP-date so many seconds after the reply (``retry_at``), or as a
  spent requests limit's ``anthropic-ratelimit-requests-{remaining,reset}`` (0, and an RFC 3339
  time so many seconds after the reply: ``reset_in``).
- ``Stall``: a stream that stops after a few deltas and stays open (a hung connection).
- ``StreamError``: a stream that fails mid-way with an SSE ``error`` event, as the API does.
- ``ToolUse``: one ``tool_use`` block, stop_reason "tool_use".

Prompt caching is counted as the API counts it: the words of the content blocks up to the last
one marked ``cache_control`` are ``cache_creation_input_tokens`` the first time that prefix is
seen and ``cache_read_input_tokens`` after, not ``input_tokens``.

Without a script the answer depends only on the request, so an interrupted agent run and an
uninterrupted one see the same turns: with ``tools``, ``agent_steps`` tool calls (inputs built
from the tools' schemas), then a text that summarises the tool results; without, an echo.

Rate-limit mode (off unless a limit is given; one allowance for the whole server, as for one API
key, all models together): at most ``requests_per_window`` requests and ``tokens_per_window``
tokens accepted in any sliding window of ``window_seconds`` (60 by default), and at most
``max_concurrent`` requests in flight (from their acceptance until their reply, a whole stream,
has been sent). A request's tokens are its input tokens as the server reports them in ``usage``
(the words of its messages' text; the system prompt and tools are not counted) plus its
``max_tokens``: output is counted up front at its most, as Anthropic's limiter does, and never
refunded. The limits are checked after the key and the body's validity (a 401 or 400 is not
counted) and before the script: an accepted request counts even if its script answers an error.
A request beyond the allowance gets a 429 ``rate_limit_error`` in the API's error shape with
``retry-after``: whole seconds, rounded up, until it would fit (until the oldest requests leave
the window; 1 s for a concurrency refusal); ``retry-after-ms`` too only with
``retry_after_ms=True``. A refused request does not count against the window. A request larger
than ``tokens_per_window`` on its own could never fit: a 400 ``invalid_request_error``.

Every reply to ``/v1/messages`` in this mode (a success, a scripted error, a 429) carries
``anthropic-ratelimit-requests-{limit,remaining,reset}`` (with a request limit) and
``anthropic-ratelimit-tokens-{limit,remaining,reset}`` (with a token limit): ``remaining`` what
the window still allows after this request, ``reset`` (RFC 3339) when the oldest request counted
leaves the window and frees its request and tokens (now when none is counted). With
``ratelimit_headers="openai"`` they are OpenAI's instead, ``x-ratelimit-{limit,remaining,reset}-
{requests,tokens}``, their ``reset`` a duration (``1.250s``).

Every reply carries a ``date`` header (the server's clock, whole seconds), as every HTTP server
with a clock sends one (RFC 9110, 6.6.1).

Stats (``GET /_stats``, and properties): requests by model and in all, and ``accepted`` (by the
limits: every request that got past them, all of them when no limit is set), ``rate_limited``
(429s sent by the limits, not scripted ones), ``max_in_flight`` (the most requests in flight at
once) and ``accepted_tokens`` (tokens of the accepted requests, counted as above).

    with serve(api_key="k") as llm: ...                      # in process, a background thread
    with serve(requests_per_window=10, tokens_per_window=5_000, window_seconds=2) as llm: ...
    python -m demo.llm_server --port 0 --chunks 20 --chunk-every 0.5
    python -m demo.llm_server --rpm 50 --tpm 40000 --window 60 --max-concurrent 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import re
import signal
import threading
import time
from asyncio import StreamReader, StreamWriter
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import formatdate
from http.client import responses
from typing import Any, Literal, TypedDict, Unpack

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
    retry_at: float | None = None  # seconds after the reply, sent as an HTTP-date retry-after
    reset_in: float | None = None  # seconds after the reply, a spent requests limit's reset


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
    requests_per_window: int | None
    tokens_per_window: int | None
    window_seconds: float
    max_concurrent: int | None
    retry_after_ms: bool
    ratelimit_headers: Literal["anthropic", "openai"]


@dataclass
class _Answer:
    content: list[Json]
    stop_reason: str
    chunks: int | None = None
    every: float = 0.0
    cut_after: int | None = None  # Stall / StreamError: text deltas sent before the cut
    error_type: str | None = None  # StreamError: the SSE error sent at the cut


@dataclass(frozen=True)
class _Verdict:
    accepted: bool
    wait: float  # refused: seconds until the request would fit
    headers: dict[str, str]


class _Window:
    """The rate-limit mode's sliding window (see the module's docstring); not thread-safe: the
    server's lock guards it."""

    def __init__(
        self,
        requests: int | None,
        tokens: int | None,
        seconds: float,
        concurrent: int | None,
        style: Literal["anthropic", "openai"] = "anthropic",
    ) -> None:
        for name, value in (("requests_per_window", requests), ("tokens_per_window", tokens),
                            ("max_concurrent", concurrent)):  # fmt: skip
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if not seconds > 0:
            raise ValueError(f"window_seconds must be > 0, got {seconds}")
        self.requests, self.tokens, self.seconds = requests, tokens, seconds
        self.concurrent = concurrent
        self.style = style
        self.entries: deque[tuple[float, int]] = deque()  # (accepted at, tokens), oldest first
        self.in_window = 0  # tokens of the entries
        self.in_flight = 0

    @property
    def limited(self) -> bool:
        return self.requests is not None or self.tokens is not None or self.concurrent is not None

    def too_large(self, cost: int) -> bool:
        return self.tokens is not None and cost > self.tokens

    def admit(self, cost: int, now: float) -> _Verdict:
        while self.entries and self.entries[0][0] <= now - self.seconds:
            self.in_window -= self.entries.popleft()[1]
        wait = 0.0
        if self.requests is not None and len(self.entries) >= self.requests:
            wait = max(wait, self._frees_at(len(self.entries) - self.requests, now))
        if self.tokens is not None and self.in_window + cost > self.tokens:
            excess, freed = self.in_window + cost - self.tokens, 0
            for index, (_, tokens) in enumerate(self.entries):
                freed += tokens
                if freed >= excess:
                    wait = max(wait, self._frees_at(index, now))
                    break
        busy = self.concurrent is not None and self.in_flight >= self.concurrent
        accepted = wait == 0 and not busy
        if accepted:
            self.entries.append((now, cost))
            self.in_window += cost
            self.in_flight += 1
        return _Verdict(accepted, max(wait, 1.0 if busy else 0.0), self._headers(now))

    def _frees_at(self, index: int, now: float) -> float:
        """Seconds until the ``index``-th oldest entry leaves the window."""
        return max(self.entries[index][0] + self.seconds - now, 1e-3)

    def _headers(self, now: float) -> dict[str, str]:
        frees = self._frees_at(0, now) if self.entries else 0.0
        reset = _rfc3339(frees) if self.style == "anthropic" else f"{frees:.3f}s"
        headers: dict[str, str] = {}
        for name, limit, used in (
            ("requests", self.requests, len(self.entries)),
            ("tokens", self.tokens, self.in_window),
        ):
            if limit is None:
                continue
            said = {"limit": str(limit), "remaining": str(max(0, limit - used)), "reset": reset}
            for part, value in said.items():
                header = (
                    f"anthropic-ratelimit-{name}-{part}"
                    if self.style == "anthropic"
                    else f"x-ratelimit-{part}-{name}"
                )
                headers[header] = value
        return headers


def _rfc3339(seconds_from_now: float, now: float | None = None) -> str:
    when = datetime.fromtimestamp((time.time() if now is None else now) + seconds_from_now, UTC)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


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
        requests_per_window: int | None = None,
        tokens_per_window: int | None = None,
        window_seconds: float = 60.0,
        max_concurrent: int | None = None,
        retry_after_ms: bool = False,
        ratelimit_headers: Literal["anthropic", "openai"] = "anthropic",
    ) -> None:
        self.url = ""
        self._port, self._chunks, self._every = port, chunks, chunk_every
        self._agent_steps, self._api_key = agent_steps, api_key
        self._window = _Window(
            requests_per_window, tokens_per_window, window_seconds, max_concurrent,
            ratelimit_headers,
        )  # fmt: skip
        self._send_retry_after_ms = retry_after_ms
        self._lock = threading.Lock()
        self._requests: Counter[str] = Counter()
        self._total = 0
        self._accepted = self._rate_limited = self._max_in_flight = self._accepted_tokens = 0
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

    @property
    def accepted(self) -> int:
        """Requests that got past the rate limits (all valid ones when none is set)."""
        with self._lock:
            return self._accepted

    @property
    def rate_limited(self) -> int:
        """429s sent by the rate limits (scripted ones apart)."""
        with self._lock:
            return self._rate_limited

    @property
    def max_in_flight(self) -> int:
        """The most accepted requests in flight at once so far."""
        with self._lock:
            return self._max_in_flight

    @property
    def accepted_tokens(self) -> int:
        """Tokens of the accepted requests: input tokens + max_tokens each."""
        with self._lock:
            return self._accepted_tokens

    def stats(self) -> Json:
        """What ``GET /_stats`` answers."""
        with self._lock:
            return {
                "total": self._total,
                "by_model": dict(self._requests),
                "accepted": self._accepted,
                "rate_limited": self._rate_limited,
                "max_in_flight": self._max_in_flight,
                "accepted_tokens": self._accepted_tokens,
            }

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
            return await _send_json(writer, 200, self.stats(), keep)
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
        input_tokens = _words(_text(body["messages"]))
        cost = input_tokens + body["max_tokens"]
        window = self._window
        if window.too_large(cost):
            problem = (
                f"this request's {cost} tokens (input + max_tokens) exceed the "
                f"{window.tokens} tokens allowed per window: it can never fit"
            )
            return await _send_error(writer, Status(400, "invalid_request_error", problem), keep)
        with self._lock:
            verdict = window.admit(cost, time.monotonic())
            if not verdict.accepted:
                self._rate_limited += 1
            else:
                self._accepted += 1
                self._accepted_tokens += cost
                self._max_in_flight = max(self._max_in_flight, window.in_flight)
        if not verdict.accepted:
            limited = Status(
                429,
                "rate_limit_error",
                "rate limit exceeded: this request would exceed the allowance of the window",
                retry_after=str(math.ceil(verdict.wait)),
                retry_after_ms=str(math.ceil(verdict.wait * 1_000))
                if self._send_retry_after_ms
                else None,
            )
            return await _send_error(writer, limited, keep, verdict.headers)
        try:
            return await self._reply(body, model, number, input_tokens, verdict.headers,
                                     reader, writer, keep)  # fmt: skip
        finally:
            with self._lock:
                window.in_flight -= 1

    async def _reply(
        self,
        body: Json,
        model: str,
        number: int,
        input_tokens: int,
        headers: dict[str, str],
        reader: StreamReader,
        writer: StreamWriter,
        keep: bool,
    ) -> bool:
        with self._lock:
            script = self._scripts.get(model)
            reply = (script.pop(0) if len(script) > 1 else script[0]) if script else None
        if isinstance(reply, Status):
            return await _send_error(writer, reply, keep, headers)
        answer = self._answer(reply, body, number)
        said = [
            b["text"] if b["type"] == "text" else json.dumps(b["input"]) for b in answer.content
        ]
        usage = {
            "input_tokens": input_tokens,
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
            return await _stream(reader, writer, message, answer, keep, headers)
        if answer.cut_after is None:
            return await _send_json(writer, 200, message, keep, headers)
        if answer.error_type is None:  # a stall: never answer
            await _until_eof(reader)
            return False
        status = _STATUS_OF.get(answer.error_type, 500)
        failed = Status(status, answer.error_type, "stream failed")
        return await _send_error(writer, failed, keep, headers)

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
    headers: dict[str, str],
) -> bool:
    head = {"content-type": "text/event-stream", "cache-control": "no-cache", **headers}
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
    headers = {"date": formatdate(usegmt=True), **headers,
               "connection": "keep-alive" if keep else "close"}  # fmt: skip
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


async def _send_error(
    writer: StreamWriter, error: Status, keep: bool, headers: dict[str, str] | None = None
) -> bool:
    now = time.time()
    retry = {"retry-after": error.retry_after, "retry-after-ms": error.retry_after_ms}
    if error.retry_at is not None:
        retry["retry-after"] = formatdate(now + error.retry_at, usegmt=True)
    if error.reset_in is not None:
        retry["anthropic-ratelimit-requests-remaining"] = "0"
        retry["anthropic-ratelimit-requests-reset"] = _rfc3339(error.reset_in, now)
    retry["date"] = formatdate(now, usegmt=True)  # the instant the times above are from
    headers = (headers or {}) | {name: value for name, value in retry.items() if value is not None}
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
    limits = parser.add_argument_group("rate limits (off unless one is given)")
    limits.add_argument("--rpm", type=int, default=None, dest="requests_per_window",
                        help="requests accepted per window")  # fmt: skip
    limits.add_argument("--tpm", type=int, default=None, dest="tokens_per_window",
                        help="tokens (input + max_tokens) accepted per window")  # fmt: skip
    limits.add_argument("--window", type=float, default=60.0, dest="window_seconds",
                        help="the sliding window, in seconds (default 60)")  # fmt: skip
    limits.add_argument("--max-concurrent", type=int, default=None,
                        help="requests in flight at once")  # fmt: skip
    limits.add_argument("--retry-after-ms", action="store_true",
                        help="send retry-after-ms with retry-after on a 429")  # fmt: skip
    limits.add_argument("--ratelimit-headers", choices=("anthropic", "openai"),
                        default="anthropic", help="whose rate-limit headers to send")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        llm = LocalLLM(**vars(args))
    except ValueError as exc:
        parser.error(str(exc))
    asyncio.run(_run(llm))


if __name__ == "__main__":
    main()
