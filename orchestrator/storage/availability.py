"""Whether the database answers, as the API server's requests see it: while it is away they
answer 503 at once, instead of each waiting the pool's timeout.

A worker's statements wait through an outage (``pool_timeout``, 30 s): they have nothing better
to do, and the pool connects again within a second of the database's return. A request has a
caller waiting for an answer (a probe that gives up after 2 s, a person at the dashboard). So,
inside a request (:meth:`Availability.bounding`), a statement waits ``wait`` seconds for a pooled
connection, then one direct connection is tried (:meth:`Availability.reachable`, one at a time,
and while the database is away one per ``probe_every``): if the database answers, the pool is
only busy and the statement waits on as any does; if not, it fails (DATABASE_UNAVAILABLE), and
the database is *away*: later requests answer 503 before touching the pool, until a probe
connects again.

The log says so once when the database goes away, then every ``log_every`` seconds while it
stays away (with how many requests were answered 503), and once when it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Iterator

import psycopg

logger = logging.getLogger("orchestrator.database")

#: The availability that bounds the current request's waits for a connection (None: a worker's,
#: or a background task's, which wait the pool's timeout).
BOUND: contextvars.ContextVar[Availability | None] = contextvars.ContextVar(
    "database_availability", default=None
)


class Availability:
    def __init__(
        self,
        dsn: str,
        *,
        wait: float,
        probe_timeout: float = 1.0,
        probe_every: float = 1.0,
        log_every: float = 60.0,
    ) -> None:
        self.dsn = dsn
        self.wait = wait
        self.probe_timeout = probe_timeout
        self.probe_every = probe_every
        self.log_every = log_every
        self._away_since: float | None = None
        self._logged_at = 0.0
        self._refused = 0  # requests answered 503 since the last line about it
        self._probed_at = -probe_every
        self._probe: asyncio.Task[bool] | None = None
        self.reason = ""  # why the last probe that failed did

    @property
    def away(self) -> bool:
        """Whether the last probe failed (and none connected since)."""
        return self._away_since is not None

    @contextlib.contextmanager
    def bounding(self) -> Iterator[None]:
        """Inside the block, a statement's wait for a pooled connection is bounded (see the
        module's docstring)."""
        token = BOUND.set(self)
        try:
            yield
        finally:
            BOUND.reset(token)

    async def reachable(self) -> bool:
        """Whether the database takes a connection now: one direct connection, shared by the
        callers meanwhile. While it is away, a failed one's answer stands for ``probe_every``
        seconds (an outage costs the database one attempt a second, whatever the requests)."""
        if self._probe is None:
            if self.away and time.monotonic() - self._probed_at < self.probe_every:
                return False
            self._probe = asyncio.create_task(self._connect(), name="database probe")
        return await asyncio.shield(self._probe)

    def refused(self) -> None:
        """A request was answered 503 without asking the database (it is away)."""
        self._refused += 1
        self._log_still_away()

    async def _connect(self) -> bool:
        try:
            async with asyncio.timeout(self.probe_timeout):
                conn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
            await conn.close()
        except (TimeoutError, psycopg.Error, OSError) as exc:
            self._went_away(exc)
            return False
        else:
            self._came_back()
            return True
        finally:
            self._probed_at = time.monotonic()
            self._probe = None

    def _went_away(self, exc: BaseException) -> None:
        if self._away_since is not None:
            self._log_still_away()
            return
        self._away_since = self._logged_at = time.monotonic()
        reason = self.reason = " ".join(str(exc).split()) or "no answer within the probe's time"
        logger.warning(
            "database unreachable (%s): requests answer 503 at once until it answers again "
            "(tried about every %.0f s; this is said again every %.0f s while it lasts)",
            reason, self.probe_every, self.log_every,
        )  # fmt: skip

    def _log_still_away(self) -> None:
        now = time.monotonic()
        if self._away_since is None or now - self._logged_at < self.log_every:
            return
        self._logged_at = now
        logger.warning(
            "database still unreachable, for %.0f s (%d requests answered 503 meanwhile)",
            now - self._away_since, self._take_refused(),
        )  # fmt: skip

    def _came_back(self) -> None:
        if self._away_since is None:
            return
        away = time.monotonic() - self._away_since
        self._away_since = None
        logger.warning(
            "database reachable again, after %.0f s away (%d requests answered 503 meanwhile)",
            away, self._take_refused(),
        )  # fmt: skip

    def _take_refused(self) -> int:
        refused, self._refused = self._refused, 0
        return refused
