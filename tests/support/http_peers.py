"""Plain HTTP peers on 127.0.0.1 for the job-type tests, one server, scripted per path:

    ANY  /status/<name>            the next scripted answer of <name>: a status, (status,
                                   Retry-After), Slow(seconds) or MALFORMED (200, JSON declared,
                                   not JSON); once the script is used up, 200 {"ok": true}
    POST /hooks/<name>             a webhook receiver: records the body and headers, then
                                   answers like /status/<name>
    POST /bot<token>/sendMessage   Telegram's Bot API: 401 for a token other than TOKEN;
                                   otherwise the next scripted answer of the chat id:
                                   "ok" | ("429", retry_after) | ("400", description) |
                                   ("500", _) in Telegram's {"ok": false, ...} shape

Every request is counted by its script name. ``refused_url`` is a port on which nothing
listens (a bound socket that never accepts): connecting is refused.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from demo.peers import send_json

TOKEN = "123456:telegram-test-token"
MALFORMED = "malformed"


@dataclass(frozen=True)
class Slow:
    seconds: float  # then 200


@dataclass
class Peers:
    url: str = ""
    refused_url: str = ""
    requests: Counter[str] = field(default_factory=Counter)
    received: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    scripts: dict[str, list[Any]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def script(self, name: str, answers: list[Any]) -> None:
        """Answers for the next requests of ``name``: a status, or (status, retry_after)."""
        with self.lock:
            self.scripts[name] = list(answers)

    def next(self, name: str) -> Any:
        with self.lock:
            self.requests[name] += 1
            answers = self.scripts.get(name)
            return answers.pop(0) if answers else None


@contextlib.contextmanager
def serve() -> Iterator[Peers]:
    peers = Peers()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _answer(self) -> None:
            body = self._body()
            path = self.path.split("?")[0]
            if path.startswith("/bot"):
                return self._telegram(path, body)
            kind, _, name = path.strip("/").partition("/")
            if kind == "hooks":
                with peers.lock:
                    peers.received[name].append(
                        {"body": body.decode(), "headers": dict(self.headers.items())}
                    )
            elif kind != "status":
                return self._reply(404, {"error": "not found"})
            answer = peers.next(name)
            if isinstance(answer, Slow):
                time.sleep(answer.seconds)
                answer = None
            if answer == MALFORMED:
                return self._reply(200, b'{"ok": tr')
            status, retry_after = answer if isinstance(answer, tuple) else (answer or 200, None)
            headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
            self._reply(status, {"ok": status < 400, "request": peers.requests[name]}, headers)

        def _telegram(self, path: str, body: bytes) -> None:
            token, _, method = path.removeprefix("/bot").partition("/")
            if token != TOKEN or method != "sendMessage":
                peers.next("telegram:unauthorized")
                return self._reply(
                    401, {"ok": False, "error_code": 401, "description": "Unauthorized"}
                )
            message = json.loads(body)
            chat = str(message["chat_id"])
            answer = peers.next(f"telegram:{chat}") or "ok"
            if answer == "ok":
                with peers.lock:
                    peers.received[f"telegram:{chat}"].append(message)
                    message_id = len(peers.received[f"telegram:{chat}"])
                return self._reply(200, {"ok": True, "result": {"message_id": message_id}})
            code, detail = answer
            error: dict[str, Any] = {"ok": False, "error_code": int(code), "description": detail}
            if code == "429":
                error["description"] = f"Too Many Requests: retry after {detail}"
                error["parameters"] = {"retry_after": detail}
            self._reply(int(code), error)

        do_GET = do_POST = do_PUT = _answer

        def _reply(self, status: int, body: object, headers: dict[str, str] | None = None) -> None:
            send_json(self, status, body, headers)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    refusing = socket.socket()
    refusing.bind(("127.0.0.1", 0))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    peers.url = f"http://127.0.0.1:{server.server_address[1]}"
    peers.refused_url = f"http://127.0.0.1:{refusing.getsockname()[1]}"
    try:
        yield peers
    finally:
        refusing.close()
        server.shutdown()
        server.server_close()
