"""Start-up during a database outage: wait for the database, unless waiting cannot help.

A worker or ``orchestrator serve`` started while the database is away (a restart of both, a
failover) waits for it rather than exit: on Kubernetes an exit is a crash loop whose back-off
grows to minutes, so pods would come back long after the database. Meanwhile its probe answers
(``/healthz`` 200, ``/readyz`` 503 ``waiting for the database``) and each attempt is one log
line. A connection the server refuses for good (bad credentials, unknown database, a host name
that does not exist: orchestrator.domain.connect_failures) fails at once with the server's
reason. Attempts are ``FIRST_DELAY`` apart, doubling up to ``MAX_DELAY``: a process starts at
most ``MAX_DELAY`` (plus the connect timeout) after its database is back.

This comes first; the schema check (``Orchestrator.open``) follows once the database answers.
"""

from __future__ import annotations

import asyncio
import logging
import time

import psycopg

from orchestrator.domain.backoff import doubling_delay
from orchestrator.domain.connect_failures import connect_failure
from orchestrator.domain.errors import DatabaseUnavailable
from orchestrator.runtime.health import HealthServer
from orchestrator.storage.database import describe_database

logger = logging.getLogger("orchestrator.startup")

FIRST_DELAY = 0.5
MAX_DELAY = 10.0
WAITING = "waiting for the database"


async def wait_for_database(
    dsn: str,
    *,
    probe_port: int = 0,
    probe_host: str = "0.0.0.0",
    probe_setting: str = "ORCHESTRATOR_HEALTH_PORT",
) -> None:
    """Return once a connection to ``dsn`` succeeds; raise DatabaseUnavailable at once for a
    failure no wait fixes. While it waits, ``/healthz`` and ``/readyz`` answer on
    ``probe_port`` (0: no probe)."""
    probe = None
    started = time.monotonic()
    attempt = 0
    try:
        while True:
            attempt += 1
            try:
                conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
            except psycopg.OperationalError as exc:
                reason = " ".join(str(exc).split())
                kind = connect_failure(str(exc), exc.sqlstate)
                if not kind.transient:
                    raise DatabaseUnavailable(f"{kind.description}: {reason}") from None
                delay = doubling_delay(attempt, first=FIRST_DELAY, cap=MAX_DELAY)
                logger.warning(
                    "%s (%s), attempt %d: %s (%s); next attempt in %.1f s", WAITING,
                    describe_database(dsn), attempt, kind.description, reason, delay,
                )  # fmt: skip
                if probe is None and probe_port:
                    probe = HealthServer(
                        port=probe_port, host=probe_host, ready=lambda: False,
                        database_ok=_never, not_ready=WAITING, setting=probe_setting,
                    )  # fmt: skip
                    await probe.start()
                await asyncio.sleep(delay)
                continue
            await conn.close()
            if attempt > 1:
                logger.warning(
                    "the database answers after %d attempts (%.1f s); starting",
                    attempt, time.monotonic() - started,
                )  # fmt: skip
            return
    finally:
        if probe is not None:
            await probe.close()


async def _never() -> bool:
    return False
