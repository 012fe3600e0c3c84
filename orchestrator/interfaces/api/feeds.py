"""Live output streams that share their reads (docs/output.md, "Reading").

However many clients stream one job's output from this server, its new chunks are read from the
database once, each chunk's Server-Sent Event is shaped once, and the same text goes to every
client: a :class:`Feed` per job, with one task that waits for the job's output (EventWatch) and
reads what is new. Each client still checks its own token while it waits (a revoked one ends
its stream within RECHECK_SECONDS), sends its own keep-alive comments, and starts at its own
offset: what lies before the feed's first offset it reads itself, then it follows the feed.
A feed keeps what it read while it has clients (at most the job's output, which its size cap
bounds), and ends with its last client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from uuid import UUID

from orchestrator.app import Orchestrator
from orchestrator.domain.errors import DatabaseUnavailable
from orchestrator.domain.output import OutputChunk
from orchestrator.domain.principals import Unauthorized
from orchestrator.interfaces.api.auth import RECHECK_SECONDS
from orchestrator.interfaces.api.watch import EventWatch, checked

logger = logging.getLogger("orchestrator.api.feeds")

#: Chunks read in one statement.
PAGE = 500


def sent(chunk: OutputChunk) -> str:
    """A chunk as one Server-Sent Event: ``id`` its offset, ``event`` its kind, ``data`` the
    chunk as JSON."""
    data = json.dumps(chunk.model_dump(mode="json"), separators=(",", ":"))
    return f"id: {chunk.offset}\nevent: {chunk.kind}\ndata: {data}\n\n"


class Feed:
    """One job's output as this server has read it: the events of its chunks from ``start`` on,
    in order, and whether the job has finished (nothing comes after ``next``) or the reading
    failed (the database is away)."""

    def __init__(self, job_id: UUID, start: int) -> None:
        self.job_id = job_id
        self.start = start
        self.events: list[str] = []
        self.finished = False
        self.failed = False
        self.clients = 0
        self.changed = asyncio.Event()  # set, and replaced, whenever any of the above changes
        self.task: asyncio.Task[None] | None = None

    @property
    def next(self) -> int:
        """The offset of the next chunk it will read."""
        return self.start + len(self.events)

    def since(self, offset: int) -> list[str]:
        """Its events from ``offset`` on (``offset`` >= ``start``)."""
        return self.events[offset - self.start :]

    def grew(self, chunks: list[OutputChunk], *, finished: bool = False) -> None:
        self.events.extend(sent(chunk) for chunk in chunks)
        self.finished = finished
        self._tell()

    def fail(self) -> None:
        self.failed = True
        self._tell()

    def _tell(self) -> None:
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()


class OutputFeeds:
    """This server's feeds, one per job being streamed."""

    def __init__(self, orc: Orchestrator, watch: EventWatch) -> None:
        self.orc = orc
        self.watch = watch
        self._feeds: dict[UUID, Feed] = {}

    async def stream(
        self, job_id: UUID, offset: int, check: Callable[[], Awaitable[None]]
    ) -> AsyncIterator[str]:
        """The job's output from ``offset`` on, as Server-Sent Events, live, until the job has
        finished and its last chunk was sent; ended, sending nothing more, once ``check()``
        raises Unauthorized (run every RECHECK_SECONDS while it waits) or the database is
        lost; a keep-alive comment whenever nothing came for the ping interval."""
        ping = self.orc.settings.api_stream_ping_seconds
        with self._joined(job_id, offset) as feed:
            try:
                while offset < feed.start:  # before the feed's first chunk: read it alone
                    chunks = await self.orc.stores.output.read(
                        job_id, offset=offset, limit=min(PAGE, feed.start - offset)
                    )
                    for chunk in chunks:
                        yield sent(chunk)
                    offset = chunks[-1].offset + 1 if chunks else feed.start
            except DatabaseUnavailable:
                return
            while True:
                changed = feed.changed
                for event in feed.since(offset):
                    yield event
                    offset += 1
                if feed.failed or (feed.finished and offset >= feed.next):
                    return
                try:
                    news = await checked(
                        _waiting(changed), ping, every=RECHECK_SECONDS, check=check
                    )
                except Unauthorized:
                    return
                if not news:
                    yield ": ping\n\n"

    @contextlib.contextmanager
    def _joined(self, job_id: UUID, offset: int) -> Iterator[Feed]:
        feed = self._feeds.get(job_id)
        if feed is None or feed.failed:
            feed = self._feeds[job_id] = Feed(job_id, offset)
            feed.task = asyncio.create_task(self._read(feed), name=f"output feed of {job_id}")
        feed.clients += 1
        try:
            yield feed
        finally:
            feed.clients -= 1
            if feed.clients == 0:
                if feed.task is not None:
                    feed.task.cancel()
                if self._feeds.get(job_id) is feed:
                    del self._feeds[job_id]

    async def _read(self, feed: Feed) -> None:
        """Read the job's new chunks whenever it has output or events (its end), until it has
        finished and everything is read."""
        try:
            async with self.watch.watching(feed.job_id, output=True) as waiter:
                while True:
                    # The job first: if it had finished, the reads below find all of its output.
                    job = await self.orc.get_job(feed.job_id)
                    while chunks := await self.orc.stores.output.read(
                        feed.job_id, offset=feed.next, limit=PAGE
                    ):
                        feed.grew(chunks)
                    if job.finished_at is not None:
                        feed.grew([], finished=True)
                        return
                    await waiter.wait(self.orc.settings.api_stream_ping_seconds)
        except DatabaseUnavailable:
            feed.fail()
        except Exception:
            logger.exception("the output feed of job %s failed", feed.job_id)
            feed.fail()


def _waiting(changed: asyncio.Event) -> Callable[[float], Awaitable[bool]]:
    async def wait(seconds: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), seconds)
        return changed.is_set()

    return wait
