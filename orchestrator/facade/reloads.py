"""What a reload of the retry config may change (the rest is fixed at start-up), and the one
watch of its file that a process's workers and API server share."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import retry_config
from orchestrator.runtime.config_reload import ConfigReload
from orchestrator.runtime.metrics import Metrics
from orchestrator.services import maintenance
from orchestrator.settings import Settings
from retry_config import LiveConfig, RetryConfig


def fixed_at_start(scope: str) -> frozenset[str]:
    fixed = {"queue", "external", "schedule"}
    if scope in maintenance.NAMES:
        fixed.add("worker_max_attempts")
    return frozenset(fixed)


def hold_fixed(new: RetryConfig, running: RetryConfig) -> tuple[RetryConfig, dict[str, list[str]]]:
    return retry_config.hold_fixed(new, running, fixed_at_start, maintenance.NAMES)


class ConfigWatch:
    """One watch per Orchestrator, made on first use: its workers and API server share it, so
    the file is read once per poll however many of them run."""

    def __init__(
        self,
        config: LiveConfig,
        *,
        check: Callable[[RetryConfig], None],
        settings: Settings,
        metrics: Metrics,
        applied: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        """``applied``: what a process writes once a new version is in effect."""
        self._config = config
        self._applied = applied
        self._check = check
        self._settings = settings
        self._metrics = metrics
        self._reload: ConfigReload | None = None

    def reload(self) -> ConfigReload | None:
        if self._settings.retry_config_poll_seconds == 0:
            return None
        if self._reload is None:
            self._reload = ConfigReload(
                self._config, check=self._check, hold=hold_fixed, metrics=self._metrics,
                interval=self._settings.retry_config_poll_seconds, applied=self._applied,
            )  # fmt: skip
        return self._reload
