"""The worker's probes, for Kubernetes: a tiny HTTP server on ``health_port``.

    GET /healthz   200 when the event loop answers and the database is reachable (1 s), else 503
    GET /readyz    200 while the worker accepts work, 503 once it drains

It answers from the worker's own event loop: a blocked loop fails the liveness probe, which is
the point.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)


class HealthServer:
    def __init__(
        self,
        *,
        port: int,
        ready: Callable[[], bool],
        database_ok: Callable[[], Awaitable[bool]],
    ) -> None:
        self.port = port
        self.ready = ready
        self.database_ok = database_ok
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "0.0.0.0", self.port)
        logger.info("health endpoints on port %d", self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 2)
            path = request.split()[1].decode() if len(request.split()) > 1 else ""
            if path == "/healthz":
                ok = await self._database()
                status, body = (200, "ok") if ok else (503, "database unreachable")
            elif path == "/readyz":
                status, body = (200, "ready") if self.ready() else (503, "draining")
            else:
                status, body = 404, "not found"
            reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
            writer.write(
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}".encode()
            )
            await writer.drain()
        except (TimeoutError, ConnectionError, IndexError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _database(self) -> bool:
        try:
            return await asyncio.wait_for(self.database_ok(), 1.0)
        except Exception:
            return False
