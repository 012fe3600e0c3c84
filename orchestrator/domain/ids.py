"""Time-ordered identifiers (UUIDv7, RFC 9562): new rows land at the end of the primary key
index, and ordering jobs by id orders them by creation."""

from __future__ import annotations

import os
import time
import uuid


def uuid7() -> uuid.UUID:
    millis = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (millis & ((1 << 48) - 1)) << 80  # 48-bit timestamp
    value |= 0x7 << 76  # version
    value |= ((rand >> 62) & 0xFFF) << 64  # 12 random bits
    value |= 0b10 << 62  # variant
    value |= rand & ((1 << 62) - 1)  # 62 random bits
    return uuid.UUID(int=value)
