"""Readers that wait for a job's events (the API's long-poll for its outcome, a stream of its
events, the dashboard's live job page) or its output (the API's and the dashboard's streams of
it, ``orchestrator tail``) are woken by the database, not by polling.

A process with such readers (an API server, a ``tail``) lists itself in ``orc_event_listeners``
while they exist; every statement that appends events or output then sends one NOTIFY on
``orc_job_events`` (migration 0019, functions/output.sql). On each, one query reads how far every
job waited for has got (its newest event id, its next output offset), and the readers whose job
has news they wait for (events; or, for its output, events or output) are woken; they read what
is new themselves. With nobody waiting, the process is unlisted and workers send nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Mapping,
)
from uuid import UUID

import psycopg
from psycopg import sql

from orchestrator.app import Orchestrator
from orchestrator.domain.backoff import doubling_delay
from orchestrator.domain.errors import DatabaseUnavailable
from orchestrator.domain.models import Job
from orchestrator.domain.output import OutputChunk
from orchestrator.storage.listeners import ListenerStore, Mark
from orchestrator.storage.queries import QUERIES

logger = logging.getLogger("orchestrator.watch")

CHANNEL = "orc_job_events"
#: The listing lapses this long after its last renewal (a server that died is forgotten).
LISTED_SECONDS = 60.0
RENEW_SECONDS = 20.0
#: A quiet connection is checked this often; each (re)connection wakes every waiter once.
LISTEN_CHECK_SECONDS = 30.0
RECONNECT_SECONDS = 1.0
#: A lost LISTEN connection is tried again after 1 s, doubling up to 10 s: not every second
#: through an outage, yet soon after it (a wait meanwhile answers 503 DATABASE_UNAVAILABLE).
RELISTEN_FIRST_SECONDS = 1.0
RELISTEN_MAX_SECONDS = 10.0
READY_SECONDS = 5.0


NOTHING = Mark(0, 0)


class Waiter:
    """One waiting request: its jobs (a job, and on a job's page its relatives), and how far it
    has seen each get; ``output``: woken by their output too, not only by their events."""

    def __init__(self, seen: dict[UUID, Mark], *, output: bool = False) -> None:
        self.seen = seen
        self.output = output
        self.news: set[UUID] = set()  # the jobs with news since the last take_news()
        self._woken = asyncio.Event()

    @property
    def job_ids(self) -> Collection[UUID]:
        return self.seen.keys()

    def take_news(self) -> set[UUID]:
        news, self.news = self.news, set()
        return news

    def poke(self) -> None:
        """Wake its wait now (its owner has something else to look at)."""
        self._woken.set()

    async def wait(self, seconds: float) -> bool:
        """Until the job has events newer than ``seen``, or ``seconds``: whether it has."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):  # no task per wait, as wait_for makes
                await self._woken.wait()
        woken = self._woken.is_set()
        self._woken.clear()
        return woken

    async def wait_checked(self, seconds: float, *, recheck: Recheck) -> bool:
        """As :meth:`wait`, with ``recheck`` run meanwhile (:func:`checked`)."""
        return await checked(self.wait, seconds, recheck=recheck)

    def wake(self, newest: Mapping[UUID, Mark]) -> None:
        for job_id in self.job_ids:
            mark, seen = newest.get(job_id, NOTHING), self.seen[job_id]
            if mark.events > seen.events or (self.output and mark.output > seen.output):
                self.seen[job_id] = mark
                self.news.add(job_id)
                self._woken.set()


class Recheck:
    """A long-lived answer's check of its caller's credentials (``check()`` raises once they
    have ended), run at most once every ``every`` seconds, however often the answer wakes (a
    stream of output wakes for each chunk): made when the answer starts, right after the
    caller was authenticated."""

    def __init__(self, check: Callable[[], Awaitable[object]], every: float) -> None:
        self.check = check
        self.every = every
        self.due = asyncio.get_running_loop().time() + every

    async def __call__(self) -> None:
        now = asyncio.get_running_loop().time()
        if now >= self.due:
            await self.check()
            self.due = now + self.every


async def checked(
    wait: Callable[[float], Awaitable[bool]], seconds: float, *, recheck: Recheck
) -> bool:
    """``wait(seconds)`` (whether what it waits for came), in turns that end when ``recheck``
    is due, running it after each: it raises to end the wait (the caller's credentials
    ended)."""
    loop = asyncio.get_running_loop()
    until = loop.time() + seconds
    while True:
        woken = await wait(max(0.0, min(recheck.due, until) - loop.time()))
        await recheck()
        if woken or loop.time() >= until:
            return woken


class EventWatch:
    def __init__(self, *, dsn: str, listeners: ListenerStore, role: str) -> None:
        """``role``: what the process is, the first part of its listing's name (``api``,
        ``tail``)."""
        self.dsn = dsn
        self.listeners = listeners
        self.name = f"{role}-{uuid.uuid4().hex[:12]}"
        self._waiters: set[Waiter] = set()
        self._listening = asyncio.Event()  # the LISTEN connection is up
        self._listed = False  # orc_event_listeners holds this server
        self._changed = asyncio.Event()  # a notification came: look at the waited jobs
        self._someone = asyncio.Event()  # somebody waits
        self._listing_lock = asyncio.Lock()  # listing and unlisting take turns

    @contextlib.asynccontextmanager
    async def watching(
        self, job_id: UUID, *others: UUID, output: bool = False
    ) -> AsyncIterator[Waiter]:
        """A waiter for ``job_id`` (and ``others``: woken by an event of any; ``output``: by
        their output too), live (listed and listening) before the block starts: read the jobs
        in the block, then wait; nothing written after the read is missed."""
        waiter = Waiter({}, output=output)
        async with self.registered(waiter):
            await self.follow(waiter, job_id, *others)
            yield waiter

    @contextlib.asynccontextmanager
    async def registered(self, waiter: Waiter) -> AsyncIterator[None]:
        """``waiter`` woken by the news of the jobs it follows (:meth:`follow`) while the block
        runs, this server listed and listening before it starts."""
        try:
            await asyncio.wait_for(self._listening.wait(), READY_SECONDS)
        except TimeoutError:
            raise DatabaseUnavailable("cannot listen for job events") from None
        async with self._listing_lock:
            # Listed anew by every watch (one upsert): a listing that vanished meanwhile (the
            # table restored, emptied by hand) is back before this waiter reads the job.
            await self.listeners.listen(self.name, seconds=LISTED_SECONDS)
            self._listed = True
            self._waiters.add(waiter)
            self._someone.set()
        try:
            yield
        finally:
            self._waiters.discard(waiter)

    async def follow(self, waiter: Waiter, *job_ids: UUID) -> None:
        """``waiter`` follows these jobs too, from how far they have got now: read them after
        this, then wait; nothing written after the read is missed."""
        latest = await self.listeners.latest(sorted(set(job_ids)))
        for job_id in job_ids:
            waiter.seen[job_id] = latest.get(job_id, NOTHING)

    async def run(self) -> None:
        """Listen, wake, and keep the listing, until cancelled."""
        try:
            await asyncio.gather(self._listen(), self._wake_loop(), self._listing())
        finally:
            if self._listed:
                with contextlib.suppress(Exception):
                    await self.listeners.stop(self.name)

    async def _listen(self) -> None:
        failures = 0
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
                    await conn.execute(
                        sql.SQL(QUERIES["listen_channel"]).format(sql.Identifier(CHANNEL))
                    )
                    if failures:
                        logger.warning("event listener: listening again")
                    failures = 0
                    self._listening.set()
                    self._changed.set()  # anything written while not listening
                    while True:
                        async for _ in conn.notifies(timeout=LISTEN_CHECK_SECONDS):
                            self._changed.set()
                        await conn.execute(QUERIES["ping"])
            except (psycopg.OperationalError, OSError) as exc:
                self._listening.clear()
                failures += 1
                delay = doubling_delay(
                    failures, first=RELISTEN_FIRST_SECONDS, cap=RELISTEN_MAX_SECONDS
                )
                logger.warning(
                    "event listener %s (%s); reconnecting in %.0f s",
                    "lost its connection" if failures == 1 else "still cannot connect",
                    " ".join(str(exc).split()), delay,
                )  # fmt: skip
                await asyncio.sleep(delay)

    async def _wake_loop(self) -> None:
        while True:
            await self._changed.wait()
            self._changed.clear()
            waiters = list(self._waiters)
            if not waiters:
                continue
            try:
                newest = await self.listeners.latest(set().union(*(w.job_ids for w in waiters)))
            except (DatabaseUnavailable, psycopg.Error) as exc:
                logger.warning("reading the waited jobs' events failed (%s)", exc)
                await asyncio.sleep(RECONNECT_SECONDS)
                self._changed.set()
                continue
            for waiter in waiters:
                waiter.wake(newest)

    async def _listing(self) -> None:
        """Renew the listing while somebody waits; drop it once nobody has for a while."""
        while True:
            await self._someone.wait()
            await asyncio.sleep(RENEW_SECONDS)
            try:
                async with self._listing_lock:
                    if self._waiters:
                        await self.listeners.listen(self.name, seconds=LISTED_SECONDS)
                        self._listed = True
                    else:
                        self._someone.clear()
                        await self.listeners.stop(self.name)
                        self._listed = False
            except (DatabaseUnavailable, psycopg.Error) as exc:
                logger.warning("renewing the event listing failed (%s)", exc)


#: The page of chunks read at a time.
OUTPUT_PAGE = 500


async def output_as_written(
    orc: Orchestrator, watch: EventWatch, job_id: UUID, offset: int, *, ping: float
) -> AsyncGenerator[OutputChunk | Job | None, None]:
    """The job's output (docs/output.md) from ``offset`` on, each chunk as it is written
    (woken by the database), for one reader in its own process (``orchestrator tail``; a
    server's streams share their reads: api/feeds.py); None whenever none came for ``ping``
    seconds; and once the job has finished and its last chunk was given, the job, last. Close
    it (``contextlib.aclosing``) to stop watching at once."""
    async with watch.watching(job_id, output=True) as waiter:
        while True:
            job = await orc.get_job(job_id)
            while chunks := await orc.stores.output.read(job_id, offset=offset, limit=OUTPUT_PAGE):
                for chunk in chunks:
                    yield chunk
                offset = chunks[-1].offset + 1
            if job.finished_at is not None:
                yield job
                return
            if not await waiter.wait(ping):
                yield None
