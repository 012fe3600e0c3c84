"""The archive of what retention deletes: one gzip JSON Lines file per run, a line per job.

Each batch is appended as a gzip member of its own (a file of several members is one valid gzip
stream, RFC 1952: ``gzip -dc`` and Python's ``gzip`` read them all) and fsynced before the
transaction that deletes the batch commits. So every deleted job is on disk, whole, before it
leaves the database. A crash between the fsync and the commit leaves jobs archived and not
deleted: the next run deletes them and archives them again, in its own file (a reader keeps one
line per ``job.id``). A crash during the write leaves a truncated last member whose jobs were
not deleted.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

SUFFIX = ".jsonl.gz"


class RunArchive:
    """The file of one run, created at its first batch (a run that deletes nothing leaves none)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
        self.path = directory / f"prune-{stamp}-{os.getpid()}{SUFFIX}"
        self.file: BinaryIO | None = None

    async def append(self, documents: Iterable[dict[str, Any]]) -> None:
        """Write ``documents`` (one line each) as a gzip member, on disk when this returns."""
        lines = b"".join(json.dumps(d, separators=(",", ":")).encode() + b"\n" for d in documents)
        await asyncio.to_thread(self._write, gzip.compress(lines))

    def _write(self, member: bytes) -> None:
        if self.file is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "xb")  # noqa: SIM115 - held across batches, closed by close()
            _fsync_directory(self.directory)  # the new file's name survives a crash too
        self.file.write(member)
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read(path: Path) -> list[dict[str, Any]]:
    """The jobs an archive file holds, in the order they were deleted."""
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines]
