"""The retry config in effect in one process: one reference that a reload replaces whole.

Every reader reads ``current`` once per decision (an attempt when it starts, a submit when it
shapes its row, a sweep per zombie) and keeps what it read, so no decision sees half of one
version and half of another.
"""

from __future__ import annotations

from datetime import UTC, datetime

from retry_config.loader import RetryConfig


class LiveConfig:
    def __init__(self, config: RetryConfig) -> None:
        self.current = config
        self.applied_at = datetime.now(UTC)

    def apply(self, config: RetryConfig) -> None:
        """From now on, ``config`` is in effect."""
        self.current = config
        self.applied_at = datetime.now(UTC)
