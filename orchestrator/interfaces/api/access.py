"""``orchestrator serve``'s access log: one line per request, once its answer is sent (a stream's
when it ends), on the logger ``orchestrator.api.access`` at INFO (docs/operations.md, "Logs").

Text: ``<client> "<METHOD> <path>[?<query>]" <status> <bytes> B <ms> ms[ by <token name>]``; the
JSON format carries the same as fields (client, method, path, query, status, bytes, duration_ms,
principal). Never a secret: no header is logged (so no Authorization, no cookie), no body (so no
sign-in token, no CSRF field), and a query parameter whose name says it holds a secret, or whose
value is an API token, is logged as ``[redacted]``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import MutableMapping
from typing import Any
from urllib.parse import parse_qsl, urlencode

from orchestrator.interfaces.api.middleware import AsgiScope, HttpMiddleware, Receive, Send

logger = logging.getLogger("orchestrator.api.access")


REDACTED = "[redacted]"
#: A query parameter whose name holds one of these is logged without its value.
SECRET_NAMES = ("token", "secret", "password", "passwd", "csrf", "session", "auth", "signature",
                "api_key", "apikey", "credential")  # fmt: skip
TOKEN_PREFIX = "orc_"  # an API token's (storage.tokens): redacted under any name


def shown_query(raw: bytes) -> str:
    """The query string as the log shows it: secrets' values redacted."""
    if not raw:
        return ""
    pairs = parse_qsl(raw.decode("latin-1"), keep_blank_values=True)
    return urlencode(
        [(name, REDACTED if _secret(name, value) else value) for name, value in pairs], safe="/:,"
    )


def _secret(name: str, value: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in SECRET_NAMES) or value.startswith(TOKEN_PREFIX)


class AccessLog(HttpMiddleware):
    async def http(self, scope: AsgiScope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        status, sent = 500, 0  # an answer never started is uvicorn's 500

        async def counted(message: MutableMapping[str, Any]) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            self._log(scope, status, sent, (time.perf_counter() - started) * 1000)

    @staticmethod
    def _log(scope: AsgiScope, status: int, sent: int, ms: float) -> None:
        client = scope.get("client")
        where = f"{client[0]}:{client[1]}" if client else "-"
        query = shown_query(scope.get("query_string", b""))
        target = f"{scope['path']}?{query}" if query else scope["path"]
        principal = scope.get("state", {}).get("principal")
        name = getattr(principal, "name", None)
        logger.info(
            '%s "%s %s" %d %d B %.1f ms%s', where, scope["method"], target, status, sent, ms,
            f" by {name}" if name else "",
            extra={"client": where, "method": scope["method"], "path": scope["path"],
                   "query": query, "status": status, "bytes": sent,
                   "duration_ms": round(ms, 1), "principal": name},
        )  # fmt: skip
