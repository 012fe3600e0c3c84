"""Local peers on 127.0.0.1 for the demo (and the tests): scripted HTTP answers, and a message
service that receives side effects.

    GET  /flaky, /bad, /down                  429 twice then 200; always 400; always 503
    POST /messages {"invocation_id", "text"}  -> 201 {"message_id", "text"}  (every delivery is
                                               counted, duplicates included)
    GET  /messages/<invocation_id>            -> 200 {"message_id", "text"} | 404
    POST /oncall {"text", ...}                -> 200; an on-call webhook: what people are told

``MessageService.hold(text)`` records a matching message, then keeps the request open until
``release()``: the sender can be killed after the message was delivered but before it learnt
so (the window the side-effect ledger exists for).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import quote, unquote

import httpx

from checkpoints import Reconciled


@dataclass
class MessageService:
    url: str = ""
    deliveries: Counter[str] = field(default_factory=Counter)  # invocation id -> deliveries
    messages: dict[str, dict[str, Any]] = field(default_factory=dict)
    held: threading.Event = field(default_factory=threading.Event)  # a held message arrived
    lock: threading.Lock = field(default_factory=threading.Lock)
    _hold_text: str | None = None
    _release: threading.Event = field(default_factory=threading.Event)

    def hold(self, text: str) -> None:
        self._hold_text, self._release = text, threading.Event()
        self.held.clear()

    def release(self) -> None:
        self._release.set()

    def wait_if_held(self, text: str) -> None:
        """A message ``hold`` named arrived: say so, and answer only once released."""
        if self._hold_text is not None and text == self._hold_text:
            self.held.set()
            self._release.wait(60)

    def deliver(self, invocation_id: str, text: str) -> dict[str, Any]:
        with self.lock:
            self.deliveries[invocation_id] += 1
            record = {"message_id": f"m-{len(self.messages) + 1}", "text": text}
            return self.messages.setdefault(invocation_id, record)

    def duplicates(self) -> dict[str, int]:
        return {key: n for key, n in self.deliveries.items() if n > 1}


@dataclass
class Peers:
    url: str
    messages: MessageService
    hits: Counter[str]
    oncall: list[dict[str, Any]] = field(default_factory=list)


def _handler(peers: Peers) -> type[BaseHTTPRequestHandler]:
    service = peers.messages

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            peers.hits[self.path] += 1
            n = peers.hits[self.path]
            if self.path.startswith("/messages/"):
                with service.lock:
                    record = service.messages.get(unquote(self.path.removeprefix("/messages/")))
                self._reply(*((200, record) if record else (404, {"error": "not found"})))
            elif self.path == "/flaky" and n <= 2:
                self._reply(429, {"error": "rate limited"}, {"Retry-After": "1"})
            elif self.path == "/flaky":
                self._reply(200, {"ok": True, "after_requests": n})
            elif self.path == "/bad":
                self._reply(400, {"error": "malformed request"})
            elif self.path == "/down":
                self._reply(503, {"error": "temporarily unavailable"})
            else:
                self._reply(404, {"error": "not found"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/oncall":
                peers.oncall.append(body)
                return self._reply(200, {"ok": True})
            record = service.deliver(body["invocation_id"], body["text"])
            service.wait_if_held(body["text"])
            self._reply(201, record)

        def _reply(self, status: int, body: object, headers: dict[str, str] | None = None) -> None:
            send_json(self, status, body, headers)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


def send_json(
    handler: BaseHTTPRequestHandler,
    status: int,
    body: object,
    headers: dict[str, str] | None = None,
) -> None:
    """Answer with ``body`` as JSON (``bytes`` are sent as they are, JSON or not)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    for name, value in (headers or {}).items():
        handler.send_header(name, value)
    handler.end_headers()
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        handler.wfile.write(data)  # the client may be gone (killed, or timed out)


@contextlib.contextmanager
def serve() -> Iterator[Peers]:
    """Run the peers in a thread, for the duration of the block."""
    peers = Peers(url="", messages=MessageService(), hits=Counter())
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(peers))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    peers.url = peers.messages.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield peers
    finally:
        peers.messages.release()
        server.shutdown()
        server.server_close()


async def send(url: str, invocation_id: str, text: str) -> dict[str, Any]:
    """A side-effecting call: post a message, with the invocation id as idempotency key."""
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(
            f"{url}/messages", json={"invocation_id": invocation_id, "text": text}
        )
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result


async def find(url: str, invocation_id: str) -> Reconciled | None:
    """reconcile(): ask the service whether the message was delivered."""
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(f"{url}/messages/{quote(invocation_id, safe='')}")
    if response.status_code == 404:
        return None
    response.raise_for_status()
    return Reconciled(response.json())
