"""Slow peers on 127.0.0.1, for the call timeouts: a server that answers at once but sends its
body a chunk at a time, and a listener that never completes a TCP handshake."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


@dataclass
class Trickle:
    """``GET /trickle?chunks=N&every=S``: 200 and its headers at once, then one chunk every S
    seconds. Each gap is short, so only a limit on the whole call can cut it."""

    url: str = ""
    requests: Counter[str] = field(default_factory=Counter)
    chunks_sent: Counter[str] = field(default_factory=Counter)


@contextlib.contextmanager
def trickle_server() -> Iterator[Trickle]:
    peer = Trickle()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            peer.requests[url.path] += 1
            query = {key: values[0] for key, values in parse_qs(url.query).items()}
            chunks, every = int(query.get("chunks", "1")), float(query.get("every", "0"))
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                for n in range(chunks):
                    time.sleep(every)
                    data = f"chunk {n}\n".encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                    peer.chunks_sent[url.path] += 1
                self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    peer.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield peer
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def unreachable() -> Iterator[str]:
    """A URL whose TCP connect hangs: a listener with a full accept queue that never accepts
    (Linux drops further SYNs), as a black-holed route does."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(3):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        for filler in fillers:
            filler.close()
        listener.close()
