"""Built-in job types, as decorated tasks. ``register_all(orc)`` adds them to an Orchestrator;
``tasks.app:orc`` is an Orchestrator with all of them, the CLI's default ``--app``."""

from __future__ import annotations

from orchestrator import Orchestrator
from tasks import http


def register_all(orc: Orchestrator) -> None:
    http.register(orc)


__all__ = ["register_all"]
