"""The worker's probes, for Kubernetes: a tiny HTTP server on ``health_port``.

    GET /healthz   200 whenever the worker's event loop answers: the process is alive, and
                   restarting it would not help, even while the database is away
    GET /readyz    200 while the worker accepts work and the database answers (within 1 s);
                   503 with the reason ("draining", "database unreachable", "waiting for the
                   database" at start-up: orchestrator.runtime.startup) otherwise
    GET /metrics   the process's metrics (orchestrator.runtime.metrics), in the format the
                   scraper's Accept header asks for (Prometheus text or OpenMetrics)

It answers from the worker's own event loop: a blocked loop fails the liveness probe, which is
the point. A database outage makes every worker not ready, never not alive, so Kubernetes waits
for the database instead of restarting the fleet in a loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from orchestrator.domain.errors import ConfigError

logger = logging.getLogger(__name__)

#: (body, content type) of the metrics, in the format a scraper's Accept header asks for.
Exposition = Callable[[str], Awaitable[tuple[bytes, str]]]
MAX_HEADERS = 100  # lines of a request's header read at most


class HealthServer:
    def __init__(
        self,
        *,
        port: int,
        ready: Callable[[], bool],
        database_ok: Callable[[], Awaitable[bool]],
        metrics: Exposition | None = None,
        not_ready: str = "draining",
        host: str = "0.0.0.0",
        setting: str = "ORCHESTRATOR_HEALTH_PORT",
    ) -> None:
        """``not_ready``: what /readyz says while ``ready()`` is false; ``setting``: the
        setting an error about the port names."""
        self.setting = setting
        self.port = port
        self.host = host
        self.not_ready = not_ready
        self.ready = ready
        self.database_ok = database_ok
        self.metrics = metrics
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._accept, self.host, self.port)
        except OSError as exc:
            raise ConfigError(
                f"{self.setting}: cannot listen on port {self.port}: "
                f"{exc.strerror or exc} (another process on this machine? give each its own "
                "port)"
            ) from None
        logger.info("health endpoints on port %d", self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for handler in self._handlers:
            handler.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Runs each probe in a task of the server's own, not asyncio's: on Python 3.11 the
        stream's own task, cancelled before its first step (asyncio.run cancelling what is left
        as the process exits), made asyncio log an error from its done-callback."""
        handler = asyncio.get_running_loop().create_task(self._serve(reader, writer))
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(2):
                request = await reader.readline()
                accept = await _accept_header(reader)
            path = request.split()[1].decode() if len(request.split()) > 1 else ""
            content_type = "text/plain"
            if path == "/healthz":
                status, body = 200, b"ok"
            elif path == "/readyz":
                status, text = await self._readiness()
                body = text.encode()
            elif path == "/metrics" and self.metrics is not None:
                status, (body, content_type) = 200, await self.metrics(accept)
            else:
                status, body = 404, b"not found"
            reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
            writer.write(
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (TimeoutError, ConnectionError, IndexError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _readiness(self) -> tuple[int, str]:
        if not self.ready():
            return 503, self.not_ready
        try:
            ok = await asyncio.wait_for(self.database_ok(), 1.0)
        except Exception:
            ok = False
        return (200, "ready") if ok else (503, "database unreachable")


async def _accept_header(reader: asyncio.StreamReader) -> str:
    """The request's Accept header ("" without one), read through the blank line that ends
    the header."""
    accept = ""
    for _ in range(MAX_HEADERS):
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        if name.strip().lower() == "accept":
            accept = value.strip()
    return accept
