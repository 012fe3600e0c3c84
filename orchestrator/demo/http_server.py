"""A small HTTP server on 127.0.0.1 with scripted answers, for the demo."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Handler(BaseHTTPRequestHandler):
    hits: Counter[str]

    def do_GET(self) -> None:
        self.hits[self.path] += 1
        n = self.hits[self.path]
        if self.path == "/flaky" and n <= 2:
            self._reply(429, {"error": "rate limited"}, {"Retry-After": "1"})
        elif self.path == "/flaky":
            self._reply(200, {"ok": True, "after_requests": n})
        elif self.path == "/bad":
            self._reply(400, {"error": "malformed request"})
        elif self.path == "/down":
            self._reply(503, {"error": "temporarily unavailable"})
        else:
            self._reply(404, {"error": "not found"})

    def _reply(self, status: int, body: object, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def serve() -> Iterator[str]:
    """Run the server in a thread; yields its base URL."""
    handler = type("Handler", (_Handler,), {"hits": Counter()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
