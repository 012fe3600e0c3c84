"""``ctx.output``: an attempt's live output (docs/output.md), text deltas and progress records,
held in the worker and written in batches: a few a second per job (every ``FLUSH_SECONDS``), or
sooner once ``FLUSH_BYTES`` are held, never a row per delta. Each batch is one statement fenced
by the attempt's lease (orchestrator.storage.output), marked with its attempt and, chunk by chunk,
the step it was written in. What is still held is written before each checkpoint commits and
before the attempt's outcome (the ledger's commit hook), so a committed step's output is stored
with it, and a failed attempt's output before the marker that supersedes it."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Mapping
from typing import Any

from orchestrator.domain.errors import StaleLease
from orchestrator.domain.models import Fence
from orchestrator.runtime.group_commit import GroupCommit
from orchestrator.runtime.loops import RETRYABLE
from orchestrator.storage.output import Batch, OutputStore, Written

#: How long a delta waits in the worker, at most, before its batch is written.
FLUSH_SECONDS = 0.1
#: Held bytes that have their batch written at once.
FLUSH_BYTES = 16_384


class OutputWrites:
    """A worker process's writes of its attempts' output batches: batches that arrive while one
    is being written go together in the next statement (orchestrator.runtime.group_commit), so
    that many jobs streaming at once pay one statement, one commit and one notification of the
    streams for many batches, not one each (bench/output_streams.py)."""

    def __init__(self, store: OutputStore) -> None:
        self._batches: GroupCommit[Batch, Written | None] = GroupCommit(store.write_many)

    async def write(self, batch: Batch) -> Written:
        """Write ``batch`` with whatever others are waiting; StaleLease when its attempt's
        lease is gone (nothing of it was written)."""
        written = await self._batches.submit(batch)
        if written is None:
            raise StaleLease(batch.fence.job_id, batch.fence.lease_token)
        return written


class Output:
    """What a task writes as it goes: ``ctx.output.text(delta)``, ``ctx.output.progress({...})``.
    Neither waits for the database: the worker writes them in batches (above)."""

    def __init__(
        self, writes: OutputWrites, fence: Fence, *, max_bytes: int,
        step: Callable[[], int | None],
    ) -> None:  # fmt: skip
        self._writes = writes
        self._fence = fence
        self._max_bytes = max_bytes
        self._step = step  # the checkpointed step running now (None: outside any)
        self._held: list[dict[str, Any]] = []
        self._held_bytes = 0
        self._sent: tuple[int, list[dict[str, Any]]] | None = None  # a batch not acknowledged
        self._batches = 0
        self._cut = False  # the job's output reached its cap: nothing more is sent
        self._lock = asyncio.Lock()  # one batch in flight, in order
        self._due = asyncio.Event()  # something is held
        self._full = asyncio.Event()  # FLUSH_BYTES are held
        self._flusher: asyncio.Task[None] | None = None

    def text(self, delta: str) -> None:
        """Append ``delta`` to the job's text output (consecutive deltas of a step are one
        chunk of their batch)."""
        if not isinstance(delta, str):
            raise TypeError(f"ctx.output.text() takes a str, not {type(delta).__name__}")
        if not delta or self._cut:
            return
        step = self._step()
        last = self._held[-1] if self._held else None
        if last is not None and last["kind"] == "text" and last["step"] == step:
            last["body"] += delta
        else:
            self._held.append({"kind": "text", "step": step, "body": delta})
        self._added(len(delta.encode()))

    def progress(self, record: Mapping[str, Any]) -> None:
        """Append a progress record (a JSON object: a tool started, a step's summary) to the
        job's output, as a chunk of its own."""
        try:
            encoded = json.dumps(record, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"ctx.output.progress(): the record is not JSON: {exc}") from None
        body = json.loads(encoded)
        if not isinstance(body, dict):
            what = type(record).__name__
            raise TypeError(f"ctx.output.progress() takes a mapping (a JSON object), not {what}")
        if self._cut:
            return
        self._held.append({"kind": "progress", "step": self._step(), "body": body})
        self._added(len(encoded.encode()))

    def _added(self, size: int) -> None:
        self._held_bytes += size
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(
                self._flush_loop(), name=f"output of job {self._fence.job_id}"
            )
        if self._held_bytes >= FLUSH_BYTES:
            self._full.set()
        self._due.set()

    async def flush(self, *, drain: bool = True) -> None:
        """Write everything held, in order, batch by batch; StaleLease once the attempt's lease
        is gone (nothing of it is written). A batch whose write failed is sent again, under its
        number, by the next flush: it is never written twice. ``drain=False`` (the loop's
        flush): one batch, what was held when it began; what comes meanwhile waits for the
        next (under load, batches grow rather than multiply)."""
        async with self._lock:
            while True:
                if self._sent is None and self._held and not self._cut:
                    self._batches += 1
                    self._sent = (self._batches, self._held)
                    self._held, self._held_bytes = [], 0
                if self._sent is None:
                    return
                number, chunks = self._sent
                written = await self._writes.write(
                    Batch(self._fence, number, chunks, self._max_bytes)
                )
                self._sent = None
                if written.cut:
                    self._cut = True
                    self._held, self._held_bytes = [], 0
                if not drain:
                    return

    async def _flush_loop(self) -> None:
        while True:
            await self._due.wait()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FLUSH_SECONDS):  # no task per turn, as wait_for makes
                    await self._full.wait()
            self._due.clear()
            self._full.clear()
            try:
                await self.flush(drain=False)
            except StaleLease:
                return  # its job is another attempt's: the attempt's end finds out
            except RETRYABLE:
                self._due.set()  # kept, and sent again after a pause
                await asyncio.sleep(FLUSH_SECONDS)
            else:
                if self._held:  # a batch sent again went alone: what it held back goes next
                    self._due.set()

    def close(self) -> None:
        """The attempt is over: its batches stop (what it held was written by its end, or is
        not to be)."""
        if self._flusher is not None:
            self._flusher.cancel()
