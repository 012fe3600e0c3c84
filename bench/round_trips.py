"""Round trips to PostgreSQL counted from outside the code that makes them: a TCP proxy between
a client process and the server that reads the client's side of the frontend protocol.

A round trip is a message that makes the server answer and the client wait for it: a simple
Query ('Q'), or a Sync ('S') closing an extended-protocol exchange (Parse, Bind, Execute ...).
Every message but the connection's first ones is a type byte and an int32 length (which counts
itself); the first ones (SSLRequest, GSSENCRequest, the startup message) have no type byte. The
client is given ``sslmode=disable`` so that the stream stays readable. The proxy runs on a
thread of its own, with its own event loop, so a process measured through it pays only the hop.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import threading
from collections import Counter
from collections.abc import Iterator

from psycopg import conninfo

#: Request codes of the messages without a type byte that another untyped one follows.
NEGOTIATIONS = {80877103, 80877104}  # SSLRequest, GSSENCRequest
ROUND_TRIPS = ("Q", "S")


class Proxy:
    """Listens on 127.0.0.1 (``port``) and forwards each connection to ``dsn``'s server,
    counting the client's messages by type (``counts``) over all connections."""

    def __init__(self, dsn: str) -> None:
        self.upstream = conninfo.conninfo_to_dict(dsn)
        self.counts: Counter[str] = Counter()
        self.port = 0
        self._lock = threading.Lock()

    def client_dsn(self, dsn: str) -> str:
        """``dsn`` through the proxy, in clear."""
        return conninfo.make_conninfo(
            dsn, host="127.0.0.1", hostaddr="", port=str(self.port), sslmode="disable",
            gssencmode="disable",
        )  # fmt: skip

    def round_trips(self) -> int:
        with self._lock:
            return sum(self.counts[kind] for kind in ROUND_TRIPS)

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host = str(self.upstream.get("host") or "/var/run/postgresql").split(",")[0]
        port = int(str(self.upstream.get("port") or 5432).split(",")[0])
        if host.startswith("/"):
            return await asyncio.open_unix_connection(f"{host}/.s.PGSQL.{port}")
        return await asyncio.open_connection(host, port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await self._connect()
        except OSError:
            writer.close()
            return
        pumps = [
            asyncio.ensure_future(self._client_to_server(reader, up_writer)),
            asyncio.ensure_future(_copy(up_reader, writer)),
        ]
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for pump in pumps:
            pump.cancel()
        for w in (writer, up_writer):
            w.close()

    async def _client_to_server(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:  # untyped: negotiations, then the startup message (or a cancel)
                header = await reader.readexactly(8)
                length, code = struct.unpack("!ii", header)
                writer.write(header + await reader.readexactly(length - 8))
                if code not in NEGOTIATIONS:
                    break
            while True:
                header = await reader.readexactly(5)
                kind, length = header[:1].decode(), struct.unpack("!i", header[1:])[0]
                writer.write(header + await reader.readexactly(length - 4))
                with self._lock:
                    self.counts[kind] += 1
                await writer.drain()

    @contextlib.contextmanager
    def running(self) -> Iterator[Proxy]:
        """The proxy, listening on its thread until the block ends."""
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        stop: asyncio.Future[None] | None = None

        async def serve() -> None:
            nonlocal stop
            server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            stop = loop.create_future()
            ready.set()
            async with server:
                await stop

        thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
        thread.start()
        if not ready.wait(10):
            raise RuntimeError("the round-trip proxy did not start listening")
        try:
            yield self
        finally:
            assert stop is not None
            loop.call_soon_threadsafe(stop.set_result, None)
            thread.join(10)


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
