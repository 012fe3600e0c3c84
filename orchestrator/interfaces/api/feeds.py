"""Live output streams that share their reads (docs/output.md, "Reading").

However many clients stream one job's output from this server, its new chunks are read from the
database once, each chunk's Server-Sent Event is shaped once, and the same text goes to every
client: a :class:`Feed` per job. One task reads for every feed of the server: woken by the
jobs' output and events (EventWatch), it reads, in one statement, each job with news from its
feed's next offset, and whether it has ended. Each client still checks its own token while it
waits (a revoked one ends its stream within RECHECK_SECONDS), sends its own keep-alive
comments, and starts at its own offset: what lies before its feed's first offset it reads
itself, then it follows the feed. A feed keeps what it read while it has clients (at most the
job's output, which its size cap bounds), and ends with its last client.
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
from orchestrator.domain.states import Status
from orchestrator.interfaces.api.auth import RECHECK_SECONDS
from orchestrator.interfaces.watch import EventWatch, Recheck, Waiter, checked

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
        self.ending = ""  # once finished: its ``end`` event (the job's status)
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

    def grew(self, chunks: list[OutputChunk], *, ended: Status | None = None) -> None:
        """Its job's new chunks; ``ended``: the status it had ended in when they were read
        (all of its output is then read)."""
        self.events.extend(sent(chunk) for chunk in chunks)
        if ended is not None:
            self.finished = True
            self.ending = f'event: end\ndata: {{"status":"{ended.value}"}}\n\n'
        self._tell()

    def fail(self) -> None:
        self.failed = True
        self._tell()

    def _tell(self) -> None:
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()


class OutputFeeds:
    """This server's feeds, one per job being streamed, and the one task that reads for all."""

    def __init__(self, orc: Orchestrator, watch: EventWatch) -> None:
        self.orc = orc
        self.watch = watch
        self._feeds: dict[UUID, Feed] = {}
        self._joining: set[Feed] = set()  # new feeds, to follow and read
        self._waiter = Waiter({}, output=True)
        self._reader: asyncio.Task[None] | None = None

    async def stream(
        self,
        job_id: UUID,
        offset: int,
        check: Callable[[], Awaitable[object]],
        *,
        every: float = RECHECK_SECONDS,
        ends: tuple[type[Exception], ...] = (Unauthorized,),
    ) -> AsyncIterator[str]:
        """The job's output from ``offset`` on, as Server-Sent Events, live, until the job has
        finished and its last chunk was sent (then an ``end`` event, ``data`` the job's
        ``{"status"}``); ended without it (a cut: resume it) once ``check()`` raises one of
        ``ends`` (run every ``every`` seconds while it waits: the caller's credentials ended,
        and a reconnection is refused) or the database is lost; a keep-alive comment whenever
        nothing came for the ping interval. The API's stream and the dashboard's."""
        ping = self.orc.settings.api_stream_ping_seconds
        recheck = Recheck(check, every)
        cut: tuple[type[Exception], ...] = (DatabaseUnavailable, *ends)  # the check not made
        with self._joined(job_id, offset) as feed:
            try:
                while offset < feed.start:  # before the feed's first chunk: read it alone
                    chunks = await self.orc.stores.output.read(
                        job_id, offset=offset, limit=min(PAGE, feed.start - offset)
                    )
                    if chunks:
                        yield "".join(sent(chunk) for chunk in chunks)
                    offset = chunks[-1].offset + 1 if chunks else feed.start
            except DatabaseUnavailable:
                return
            while True:
                changed = feed.changed
                if pending := feed.since(offset):  # one write for all that came meanwhile
                    yield "".join(pending)
                    offset += len(pending)
                if feed.failed:
                    return
                if feed.finished and offset >= feed.next:
                    yield feed.ending
                    return
                try:
                    news = await checked(_waiting(changed), ping, recheck=recheck)
                except cut:
                    return
                if not news:
                    yield ": ping\n\n"

    @contextlib.contextmanager
    def _joined(self, job_id: UUID, offset: int) -> Iterator[Feed]:
        feed = self._feeds.get(job_id)
        if feed is None or feed.failed:
            feed = self._feeds[job_id] = Feed(job_id, offset)
            self._joining.add(feed)
            if self._reader is None or self._reader.done():
                self._reader = asyncio.create_task(self._read(), name="output feeds")
            self._waiter.poke()
        feed.clients += 1
        try:
            yield feed
        finally:
            feed.clients -= 1
            if feed.clients == 0 and self._feeds.get(job_id) is feed:
                del self._feeds[job_id]  # the reader stops following it

    async def _read(self) -> None:
        """Read for every feed, as long as there are feeds: a new one at once, the others when
        their job has news (output, or an event: its end)."""
        waiter = self._waiter
        try:
            async with self.watch.registered(waiter):
                while self._feeds:
                    for gone in set(waiter.seen) - set(self._feeds):
                        del waiter.seen[gone]
                    joining, self._joining = self._joining, set()
                    joining = {f for f in joining if self._feeds.get(f.job_id) is f}
                    if joining:
                        await self.watch.follow(waiter, *(f.job_id for f in joining))
                    due = joining | {self._feeds[j] for j in waiter.take_news() if j in self._feeds}
                    while due:
                        due = await self._read_once(due)
                    await waiter.wait(self.orc.settings.api_stream_ping_seconds)
        except DatabaseUnavailable:
            self._fail_all()
        except Exception:
            logger.exception("the output feeds' reader failed")
            self._fail_all()

    async def _read_once(self, due: set[Feed]) -> set[Feed]:
        """One read of the ``due`` feeds' jobs; those with more to read than a page."""
        followed = await self.orc.stores.output.follow({f.job_id: f.next for f in due}, limit=PAGE)
        more = set()
        for feed in due:
            job = followed.get(feed.job_id)
            if job is None:  # it no longer exists (retention): nothing more comes
                feed.fail()
            elif len(job.chunks) == PAGE:
                feed.grew(job.chunks)
                more.add(feed)
            else:
                feed.grew(job.chunks, ended=job.ended)
        return more

    def _fail_all(self) -> None:
        for feed in self._feeds.values():
            feed.fail()
        self._feeds.clear()
        self._joining.clear()
        self._waiter.seen.clear()


def _waiting(changed: asyncio.Event) -> Callable[[float], Awaitable[bool]]:
    async def wait(seconds: float) -> bool:
        # asyncio.timeout, not wait_for: no task per wait (each client waits once per chunk)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await changed.wait()
        return changed.is_set()

    return wait
