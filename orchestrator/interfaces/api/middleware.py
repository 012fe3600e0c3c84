"""What ``serve``'s own ASGI middlewares share: the ASGI types, and that each sees HTTP requests
only (a lifespan or any other scope passes through untouched)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

AsgiScope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Asgi = Callable[[AsgiScope, Receive, Send], Awaitable[None]]


class HttpMiddleware:
    def __init__(self, app: Asgi) -> None:
        self.app = app

    async def __call__(self, scope: AsgiScope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.http(scope, receive, send)

    async def http(self, scope: AsgiScope, receive: Receive, send: Send) -> None:
        """One HTTP request, on its way to ``self.app``."""
        raise NotImplementedError
