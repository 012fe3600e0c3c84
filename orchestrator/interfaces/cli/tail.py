"""``tail``: a job's live output in the terminal (docs/output.md), each chunk as it is written,
until the job has finished; woken by the database as the API's stream is (a watch of the
command's own: interfaces/watch.py). It reads with the database's own rights, as every command
does (the API is where tenants are enforced)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from typing import TextIO

from orchestrator.app import Orchestrator
from orchestrator.domain.models import Job
from orchestrator.domain.output import OutputChunk
from orchestrator.interfaces.cli.shared import Commands, on_app, whole
from orchestrator.interfaces.watch import OUTPUT_PAGE, EventWatch, output_as_written

MAX_OFFSET = 2**63 - 1
#: How long one wait lasts before the job is read again (a wake-up ends it sooner).
WAIT_SECONDS = 30.0


def add_parsers(commands: Commands) -> None:
    cmd = commands.add_parser(
        "tail",
        help="print a job's live output as it is written (text as it comes; a line for each"
        " progress record and marker, naming its attempt) until the job has finished",
    )  # fmt: skip
    cmd.add_argument("job_id")
    cmd.add_argument(
        "--offset", type=whole(0, MAX_OFFSET), default=0,
        help="from the chunk at this offset on (default 0: all of it)",
    )  # fmt: skip
    cmd.add_argument(
        "--final", action="store_true",
        help="once the job has finished, its final output only (no attempt's output that a"
        " later attempt made again)",
    )  # fmt: skip
    cmd.set_defaults(handler=cmd_tail)


@on_app
async def cmd_tail(args: argparse.Namespace, orc: Orchestrator) -> int:
    """The job's name goes to stderr at its end, with its status: stdout holds its output."""
    job = await orc.get_job(args.job_id)
    shown = Shown(sys.stdout)
    async with _watching(orc) as watch:
        if args.final:
            job = await _finished(orc, watch, job)
            offset = args.offset
            while chunks := await orc.stores.output.read(
                job.id, offset=offset, limit=OUTPUT_PAGE, final=True
            ):
                for chunk in chunks:
                    shown.chunk(chunk)
                offset = chunks[-1].offset + 1
        else:
            written = output_as_written(orc, watch, job.id, args.offset, ping=WAIT_SECONDS)
            async with contextlib.aclosing(written):
                async for item in written:
                    if isinstance(item, OutputChunk):
                        shown.chunk(item)
                    elif isinstance(item, Job):
                        job = item
    shown.end_line()
    print(f"job {job.id} {job.status.value}", file=sys.stderr)
    return 0


@contextlib.asynccontextmanager
async def _watching(orc: Orchestrator) -> AsyncIterator[EventWatch]:
    """A watch of this command's own, running while the block does."""
    watch = EventWatch(dsn=orc.dsn, listeners=orc.stores.listeners, role="tail")
    running = asyncio.create_task(watch.run(), name="event watch")
    try:
        yield watch
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running


async def _finished(orc: Orchestrator, watch: EventWatch, job: Job) -> Job:
    """The job, once it has finished (woken by its events)."""
    async with watch.watching(job.id) as waiter:
        while (job := await orc.get_job(job.id)).finished_at is None:
            await waiter.wait(WAIT_SECONDS)
    return job


class Shown:
    """Chunks as the terminal shows them: text written as it comes, after a line naming its
    attempt whenever the attempt changes; a progress record and a marker each a line of its
    own that names its attempt."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.attempt: int | None = None  # the attempt of the last chunk shown
        self.mid_line = False  # the last text written did not end its line

    def chunk(self, chunk: OutputChunk) -> None:
        if chunk.kind == "text":
            if chunk.attempt != self.attempt:
                self.line(f"[attempt {chunk.attempt}]")
            self.out.write(chunk.body)
            self.mid_line = not chunk.body.endswith("\n")
        else:
            self.line(marker_line(chunk))
        self.attempt = chunk.attempt
        self.out.flush()

    def line(self, text: str) -> None:
        self.end_line()
        self.out.write(text + "\n")

    def end_line(self) -> None:
        """Text written so far ends its line: what follows starts at the left."""
        if self.mid_line:
            self.out.write("\n")
            self.mid_line = False


def marker_line(chunk: OutputChunk) -> str:
    """A progress record or a marker, as a line naming its attempt (and its step)."""
    where = f"attempt {chunk.attempt}" + (f", step {chunk.step}" if chunk.step is not None else "")
    if chunk.kind == "progress":
        return f"[{where}] progress {json.dumps(chunk.body)}"
    if chunk.kind == "superseded":
        return (
            f"[attempt {chunk.attempt}] superseded: its output from step {chunk.body['step']}"
            " on is made again by the next attempt"
        )
    return (
        f"[{where}] cut: the job's output reached its cap of {chunk.body['max_bytes']} bytes;"
        " nothing more is kept"
    )
