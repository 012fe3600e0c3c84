"""The clients one worker's attempts share, made on first use and closed when the worker stops:
each job type's HTTP client (``ctx.http``) and any client a task asks for (``ctx.shared``).
Connections are reused across attempts, and a thousand concurrent jobs do not make a thousand
clients. Each worker has its own, so one worker stopping never closes another's."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Protocol, TypeVar, cast

import httpx

from orchestrator.runtime.calls import http_client
from retry_config import JobRetryConfig

if TYPE_CHECKING:
    from orchestrator.runtime.tracing import Tracing


class AsyncClosable(Protocol):
    async def aclose(self) -> None: ...


C = TypeVar("C", bound=AsyncClosable)


class Clients:
    def __init__(self, tracing: Tracing | None = None) -> None:
        self.tracing = tracing
        self._clients: dict[Hashable, AsyncClosable] = {}

    def http(self, job_type: str, config: JobRetryConfig) -> httpx.AsyncClient:
        """The job type's HTTP client, with its connect and total call timeouts (and a span
        per request when tracing is on): a new one when a reload changed them."""
        key = ("http", job_type, config.call_timeout_ms, config.connect_timeout_ms)
        return self.shared(key, lambda: http_client(config, self.tracing))

    def shared(self, key: Hashable, make: Callable[[], C]) -> C:
        """One client per ``key``, made by ``make()`` the first time."""
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = make()
        return cast("C", client)

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()
