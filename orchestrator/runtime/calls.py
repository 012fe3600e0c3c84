"""Call-level timeouts, the innermost of the timeout hierarchy (call < step < job;
docs/contracts.md, "Timeouts").

- :func:`http_client`: the HTTP client a job type's tasks get as ``ctx.http``. Its connect
  timeout is the type's ``connect_timeout_ms``; its total timeout (``call_timeout_ms``) bounds a
  whole call, response body included. httpx's own timeouts are per phase (a server trickling one
  byte a minute never trips its read timeout), so the total is enforced around the transport.
  Overruns raise httpx's own exceptions, so they classify as the timeout tree says: a connect
  timeout is TRANSIENT_INFRA, a response timeout TRANSIENT_APP. httpx's retries stay off: the
  orchestrator's two layers are the only retries.
- :func:`within_gaps`: a stream's chunks, cut when it goes silent for the inter-chunk timeout
  (raising :class:`StreamStalled`, TRANSIENT_APP).
- :func:`call_limit`: any other awaited call (a tool, a subprocess) under a per-tool limit,
  raising :class:`CallTimedOut` (TRANSIENT_APP).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, TypeVar

import httpx

from orchestrator.domain.errors import CallTimedOut, StreamStalled
from retry_config import JobRetryConfig

if TYPE_CHECKING:
    from orchestrator.runtime.tracing import Tracing

T = TypeVar("T")


def http_client(config: JobRetryConfig, tracing: Tracing | None = None) -> httpx.AsyncClient:
    """With ``tracing``, each request has a span (orchestrator.runtime.tracing)."""
    total = config.call_timeout()
    # No connection cap: the worker's concurrency bounds the calls (httpx's default of 100
    # would make the 101st concurrent call wait, then fail with a PoolTimeout).
    transport: httpx.AsyncBaseTransport = TotalTimeout(
        httpx.AsyncHTTPTransport(retries=0, limits=httpx.Limits(max_connections=None)), total
    )
    return httpx.AsyncClient(
        timeout=httpx.Timeout(total, connect=config.connect_timeout_ms / 1_000),
        transport=transport if tracing is None else tracing.transport(transport),
    )


class TotalTimeout(httpx.AsyncBaseTransport):
    """Bounds each request, from sending it to the last byte of its body, by ``seconds``."""

    def __init__(self, inner: httpx.AsyncBaseTransport, seconds: float) -> None:
        self.inner = inner
        self.seconds = seconds

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        deadline = asyncio.get_running_loop().time() + self.seconds
        limit = asyncio.timeout_at(deadline)
        try:
            async with limit:
                response = await self.inner.handle_async_request(request)
        except TimeoutError:
            if not limit.expired():
                raise
            raise self._overran(request) from None
        assert isinstance(response.stream, httpx.AsyncByteStream)
        response.stream = _BoundedStream(response.stream, deadline, lambda: self._overran(request))
        return response

    def _overran(self, request: httpx.Request) -> httpx.ReadTimeout:
        return httpx.ReadTimeout(
            f"call exceeded its total timeout of {self.seconds:g} s", request=request
        )

    async def aclose(self) -> None:
        await self.inner.aclose()


class _BoundedStream(httpx.AsyncByteStream):
    def __init__(
        self, inner: httpx.AsyncByteStream, deadline: float, overran: Callable[[], Exception]
    ) -> None:
        self.inner = inner
        self.deadline = deadline
        self.overran = overran

    async def __aiter__(self) -> AsyncIterator[bytes]:
        chunks = self.inner.__aiter__()
        while True:
            limit = asyncio.timeout_at(self.deadline)
            try:
                async with limit:
                    chunk = await chunks.__anext__()
            except StopAsyncIteration:
                return
            except TimeoutError:
                if not limit.expired():
                    raise
                raise self.overran() from None
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


async def within_gaps(
    chunks: AsyncIterable[T], seconds: float | None, what: str
) -> AsyncIterator[T]:
    """``chunks``, as they come; a silence longer than ``seconds`` between two of them (or
    before the first) raises :class:`StreamStalled` (TRANSIENT_APP). A slow but steady stream
    is never cut here, only by the call's total limit."""
    iterator = aiter(chunks)
    while True:
        limit = asyncio.timeout(seconds)
        try:
            async with limit:
                chunk = await anext(iterator)
        except StopAsyncIteration:
            return
        except TimeoutError:
            if not limit.expired():
                raise
            raise StreamStalled(what, seconds or 0) from None
        yield chunk


@asynccontextmanager
async def call_limit(seconds: float, what: str) -> AsyncIterator[None]:
    """Run the block under ``seconds``; overrunning raises :class:`CallTimedOut`."""
    limit = asyncio.timeout(seconds)
    try:
        async with limit:
            yield
    except TimeoutError:
        if not limit.expired():
            raise  # raised inside the block (an inner limit): not ours
        raise CallTimedOut(what, seconds) from None
