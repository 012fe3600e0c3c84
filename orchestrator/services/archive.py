"""The archive of what retention deletes: one gzip JSON Lines file per run, a line per job.

Each batch is appended as a gzip member of its own (a file of several members is one valid gzip
stream, RFC 1952: ``gzip -dc`` and Python's ``gzip`` read them all) and fsynced before the
transaction that deletes the batch commits. So every deleted job is on disk, whole, before it
leaves the database. A crash between the fsync and the commit leaves jobs archived and not
deleted: the next run deletes them and archives them again, in its own file (a reader keeps one
line per ``job.id``). A crash during the write leaves a truncated last member whose jobs were
not deleted.

The files hold every tenant's payloads and results: each is its owner's alone (0600), and so is
every directory made for them (0700), whatever the process's umask.
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
FILE_MODE = 0o600
DIRECTORY_MODE = 0o700


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
            _make_directories(self.directory)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
            os.fchmod(fd, FILE_MODE)  # the umask may have taken bits from FILE_MODE
            self.file = open(fd, "wb")  # noqa: SIM115 - held across batches, closed by close()
            _fsync_directory(self.directory)  # the new file's name survives a crash too
        self.file.write(member)
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _make_directories(directory: Path) -> None:
    """``directory`` and its missing parents, each made DIRECTORY_MODE; one that exists is left
    as it is (the operator's)."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for made in reversed(missing):
        try:
            os.mkdir(made, DIRECTORY_MODE)
        except FileExistsError:  # made meanwhile, by another run
            continue
        os.chmod(made, DIRECTORY_MODE)


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
