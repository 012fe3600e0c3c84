"""An external system for side-effect tests: a message service on 127.0.0.1.

    POST /messages {"invocation_id", "text"}  -> 201 {"message_id"}   (every delivery is kept,
                                                                        duplicates included)
    GET  /messages/<invocation_id>            -> 200 {"message_id", "text"} | 404

``hold(text)`` makes the service record a matching message and then keep the request open until
``release()``: the test can kill the sender after the message was delivered but before the
sender learnt it (the window the side-effect ledger exists for).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import quote, unquote

import httpx

from checkpoints import Reconciled


class MessageService:
    def __init__(self) -> None:
        self.deliveries: Counter[str] = Counter()  # invocation_id -> times delivered
        self.messages: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self._hold_text: str | None = None
        self.held = threading.Event()  # set once a held message arrived
        self._release = threading.Event()
        self.url = ""

    def hold(self, text: str) -> None:
        self._hold_text, self._release = text, threading.Event()
        self.held.clear()

    def release(self) -> None:
        self._release.set()

    def deliver(self, invocation_id: str, text: str) -> dict[str, Any]:
        with self.lock:
            self.deliveries[invocation_id] += 1
            record = {"message_id": f"m-{len(self.messages) + 1}", "text": text}
            self.messages.setdefault(invocation_id, record)
            return self.messages[invocation_id]

    def duplicates(self) -> dict[str, int]:
        return {k: n for k, n in self.deliveries.items() if n > 1}


def _handler(service: MessageService) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            record = service.deliver(body["invocation_id"], body["text"])
            if service._hold_text is not None and body["text"] == service._hold_text:
                service.held.set()
                service._release.wait(30)
            self._reply(201, record)

        def do_GET(self) -> None:
            invocation_id = unquote(self.path.removeprefix("/messages/"))
            with service.lock:
                record = service.messages.get(invocation_id)
            self._reply(200, record) if record else self._reply(404, {"error": "not found"})

        def _reply(self, status: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self.wfile.write(data)  # the sender may have been killed while it was held

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


@contextmanager
def message_service() -> Iterator[MessageService]:
    service = MessageService()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(service))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    service.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield service
    finally:
        service.release()
        server.shutdown()
        server.server_close()


async def send(url: str, invocation_id: str, text: str) -> dict[str, Any]:
    """The side-effecting call: post a message, with the invocation id as idempotency key."""
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
