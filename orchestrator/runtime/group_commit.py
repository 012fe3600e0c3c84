"""Group commit: writes that arrive together go to the database in one statement.

The first write goes at once, alone, written by its own caller, so nothing waits for company or
for another task. Writes that arrive while a batch is being written queue up and go together in
the next one. An idle worker therefore
writes exactly as before, and a busy one pays a statement's fixed cost (the round trip, the
parse and execution set-up, the commit) once per batch instead of once per write. A batch is
never larger than the writes that were waiting, which a worker's concurrency bounds.

If a batch fails as a whole, its items are written again one by one, so one bad item fails
only its own caller.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

Write = Callable[[Sequence[T]], Awaitable[Sequence[R]]]


class GroupCommit(Generic[T, R]):
    def __init__(self, write: Write[T, R]) -> None:
        """``write(items)`` writes items in one statement and returns one result per item, in
        their order."""
        self._write = write
        self._waiting: list[tuple[T, asyncio.Future[R]]] = []
        self._writer: asyncio.Task[None] | None = None
        self._writing_inline = False

    async def submit(self, item: T) -> R:
        """Write ``item`` with whatever else is waiting; its result, or its write's error."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        if self._writer is None and not self._writing_inline:
            # Nothing is being written: write now, in this task, with no hop through another.
            self._writing_inline = True
            batch, self._waiting = self._waiting, []
            try:
                await self._write_batch(batch)
            finally:
                self._writing_inline = False
                self._start_writer()  # for those that arrived meanwhile
        return await future

    def _start_writer(self) -> None:
        if self._waiting and self._writer is None:
            self._writer = asyncio.create_task(self._write_all(), name="group commit")

    async def _write_all(self) -> None:
        try:
            while self._waiting:
                batch, self._waiting = self._waiting, []
                await self._write_batch(batch)
        except BaseException as exc:  # cancelled with the event loop: fail the waiting writes
            for _, future in self._waiting:
                _settle(future, exc)
            self._waiting = []
            raise
        finally:
            self._writer = None

    async def _write_batch(self, batch: list[tuple[T, asyncio.Future[R]]]) -> None:
        try:
            results = await self._write([item for item, _ in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"{len(results)} results for {len(batch)} writes")
        except Exception as exc:
            if len(batch) == 1:
                _settle(batch[0][1], exc)
                return
            for one in batch:  # find the item at fault: each alone
                await self._write_batch([one])
            return
        except BaseException as exc:
            for _, future in batch:
                _settle(future, exc)
            raise
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():  # its caller may have been cancelled meanwhile
                future.set_result(result)


def _settle(future: asyncio.Future[R], exc: BaseException) -> None:
    if future.done():
        return
    if isinstance(exc, asyncio.CancelledError):
        future.cancel()
    else:
        future.set_exception(exc)
