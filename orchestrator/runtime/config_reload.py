"""Reloading the retry config without a restart: a worker and ``serve`` poll their file.

The file is read every ``interval`` seconds and named by its content hash. Polling the content
rather than watching the file with inotify: a Kubernetes ConfigMap mount is replaced in place by
an atomic swap of its ``..data`` symlink. A watch on the file holds the old file's inode, which
only says it went away (parca #3230 reloads on that deletion); a watch on the directory must
single out the ``..data`` event, which some systems report as a write rather than a create
(configmap-reload #190); and the kubelet keeps the files' mtime (kubernetes #24215), so an mtime
poll misses it. Reading a few kilobytes every few seconds costs nothing (25 us to read and hash
the default file), and an editor's rename, a ``cp`` and a symlink swap all look alike.

A new version is validated as at start-up (the file's own rules, then the application's: names
of known job types, no queue shared with an external type); refused, the old version stays in
effect, the refusal is logged once (an ERROR) and counted, and the file's version is marked
refused until it changes again. Applied, it replaces the config in effect whole (LiveConfig),
with the fields fixed at start-up held at their old values (named in a warning), and one log
line per changed scope says what changed (warnings: seen at every log level's default). Then
``applied`` runs: the process writes what the fleet shares of it at once (the flow limits, so
that a limit removed, raised or lowered holds every worker within the poll interval); while the
database cannot be reached, the worker's registry heartbeat writes it later. A version whose
limits another application defines otherwise (docs/applications.md) is refused there: the old
version is put back in effect, and the refusal logged and counted as any other.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from orchestrator.domain.errors import ApplicationConflict
from orchestrator.runtime.loops import RETRYABLE
from orchestrator.runtime.metrics import Metrics
from retry_config import (
    ConfigError,
    LiveConfig,
    RetryConfig,
    describe,
    diff,
    parse_bytes,
    read,
    version_of,
)

logger = logging.getLogger("orchestrator.config")


class ConfigReload:
    def __init__(
        self,
        live: LiveConfig,
        *,
        check: Callable[[RetryConfig], None],
        hold: Callable[[RetryConfig, RetryConfig], tuple[RetryConfig, dict[str, list[str]]]],
        metrics: Metrics,
        interval: float,
        applied: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        """``check``: the application's validation (raises ConfigError); ``hold(new,
        running)``: ``new`` with the fields fixed at start-up kept, and those it changes;
        ``applied``: what to write once a new version is in effect."""
        self.live = live
        self.path: Path = live.current.path
        self.check = check
        self.hold = hold
        self.metrics = metrics
        self.interval = interval
        self.applied = applied
        self._seen = live.current.version  # the file's content last looked at

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.poll()

    async def poll(self) -> None:
        """Read the file; apply a new version, or refuse it."""
        try:
            content = await asyncio.to_thread(read, self.path)
        except ConfigError as exc:
            self._refuse(f"unreadable: {exc}", "its content (unreadable)", exc)
            return
        version = version_of(content)
        if version == self._seen:
            return
        running = self.live.current
        if version == running.version:  # back to the version in effect after a refusal
            self._seen = version
            logger.warning("retry config %s: back to version %s, the one in effect",
                           self.path, version)  # fmt: skip
            self.metrics.config_applied(version)
            return
        try:
            new = parse_bytes(content, self.path)
            self.check(new)
        except ConfigError as exc:
            self._refuse(version, f"version {version}", exc)
            return
        self._seen = version
        held, fixed = self.hold(new, running)
        changes = diff(running, held)
        self.live.apply(held)
        self.metrics.config_reloaded()
        self.metrics.config_applied(version)
        # Warnings: an edit of what every retry does is worth a line at the default level.
        logger.warning(
            "retry config %s: version %s applied (was %s): %s", self.path, version,
            running.version, f"{len(changes)} scope(s) changed" if changes else "no field changed",
        )  # fmt: skip
        for line in describe(changes):
            logger.warning("retry config change: %s", line)
        for scope, names in fixed.items():
            logger.warning(
                "retry config %s: %s: %s changed in the file; fixed at start-up, it takes effect "
                "at the next restart", self.path, scope, ", ".join(names),
            )  # fmt: skip
        if self.applied is not None:
            try:
                await self.applied()
            except ApplicationConflict as exc:  # another application defines it otherwise
                self.live.apply(running)
                logger.error(
                    "retry config %s: version %s refused, version %s stays in effect: %s",
                    self.path, version, running.version, exc,
                )  # fmt: skip
                self.metrics.config_refused()
                self.metrics.config_applied(running.version)
            except RETRYABLE as exc:
                logger.warning(
                    "retry config %s: version %s not yet written to the database (%s); the "
                    "registry heartbeat writes it", self.path, version, exc,
                )  # fmt: skip

    def _refuse(self, seen: str, what: str, exc: ConfigError) -> None:
        """``seen``: what was read (a version, or why nothing could be), refused once."""
        if seen == self._seen:
            return  # refused already: logged and counted once per version
        self._seen = seen
        logger.error(
            "retry config %s: %s refused, version %s stays in effect: %s", self.path, what,
            self.live.current.version, "; ".join(str(exc).splitlines()),
        )  # fmt: skip
        self.metrics.config_refused()
