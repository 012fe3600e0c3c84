"""The external system of the side-effect tests: the demo's message service on 127.0.0.1
(demo/peers.py), one per test."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from demo.peers import MessageService, find, send, serve

__all__ = ["MessageService", "find", "message_service", "send"]


@contextmanager
def message_service() -> Iterator[MessageService]:
    with serve() as peers:
        yield peers.messages
