"""A job's live output (docs/output.md), on real PostgreSQL: chunks at their offsets, marked with
their attempt and step, written in batches under the attempt's lease; the superseded marker a
failed attempt's outcome writes, and the final read; a committed step's output kept, never
repeated; the size cap."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from uuid import UUID

import psycopg
import pytest

from orchestrator import JobContext, Orchestrator, RetryLater, StaleLease, Status
from orchestrator.domain.models import Fence
from orchestrator.domain.output import OutputChunk
from tests.support.harness import WorkerRun, config_with

CAPPED = "\n[job_types.capped]\noutput_max_bytes = 100\n"
DELTAS = 200


def app(make_orc: Callable[..., Orchestrator]) -> tuple[Orchestrator, dict[str, Any]]:
    """An application whose job types stream; what their attempts leave behind in ``kept``."""
    orc = make_orc(retry_config=config_with(CAPPED))
    kept: dict[str, Any] = {}

    @orc.job_type("tokens")
    async def tokens(ctx: JobContext, payload: dict[str, Any]) -> str:
        for n in range(DELTAS):
            ctx.output.text(f"t{n} ")
        ctx.output.progress({"tool": "search", "n": 1})
        ctx.output.text("done")
        return "ok"

    @orc.job_type("flaky")
    async def flaky(ctx: JobContext, payload: dict[str, Any]) -> str:
        ctx.output.text(f"attempt {ctx.attempt} says hello")
        if ctx.attempt == 1:
            kept["fence"] = Fence(ctx.job_id, ctx.lease_token, ctx.attempt)
            kept["output"] = ctx.output
            raise RetryLater(0, "once more")
        return "ok"

    @orc.job_type("stepped")
    async def stepped(ctx: JobContext, payload: dict[str, Any]) -> int:
        steps = ctx.steps(int, initial=0, max_steps=3)
        async for step in steps:
            ctx.output.text(f"step {step.number} of attempt {ctx.attempt}")
            if step.number == 2 and ctx.attempt == 1:
                raise RetryLater(0, "step 2 fails once")
            await step.checkpoint(step.state + 1, final=step.number == 3)
        return steps.state

    @orc.job_type("capped")
    async def capped(ctx: JobContext, payload: dict[str, Any]) -> str:
        for n in range(20):
            ctx.output.text("x" * 9)  # 9 bytes a delta, a batch of each by the flush below
            await ctx.output.flush()
            kept["flushed"] = n + 1
        return "ok"

    return orc, kept


async def run(orc: Orchestrator, job_type: str) -> UUID:
    async with WorkerRun(orc) as worker:
        job_id = await orc.submit(job_type, {})
        await worker.until_finished(job_id)
    job = await orc.get_job(job_id)
    assert job.status is Status.COMPLETED, job.last_error
    return job_id


def texts(chunks: list[OutputChunk]) -> str:
    return "".join(c.body for c in chunks if c.kind == "text")


async def test_chunks_are_read_in_order_at_their_offsets_marked_and_batched(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc, _ = app(make_orc)
    async with orc:
        job_id = await run(orc, "tokens")
        chunks = await orc.stores.output.read(job_id)
        later = await orc.stores.output.read(job_id, offset=1)
    assert [c.offset for c in chunks] == list(range(len(chunks)))
    assert texts(chunks) == "".join(f"t{n} " for n in range(DELTAS)) + "done"
    assert [c.body for c in chunks if c.kind == "progress"] == [{"tool": "search", "n": 1}]
    assert {(c.attempt, c.step) for c in chunks} == {(1, None)}
    # Written in batches: the 201 deltas and the record held between two flushes, not a row each.
    assert len(chunks) <= 3
    assert later == chunks[1:]


async def test_a_failed_attempt_is_superseded_then_the_next_attempt_streams(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc, _ = app(make_orc)
    async with orc:
        job_id = await run(orc, "flaky")
        chunks = await orc.stores.output.read(job_id)
        final = await orc.stores.output.read(job_id, final=True)
    assert [(c.offset, c.kind, c.attempt) for c in chunks] == [
        (0, "text", 1), (1, "superseded", 1), (2, "text", 2),
    ]  # fmt: skip
    assert chunks[1].body == {"attempt": 1, "step": 1}
    assert texts(chunks) == "attempt 1 says helloattempt 2 says hello"
    assert [(c.offset, c.body) for c in final] == [(2, "attempt 2 says hello")]


async def test_a_stale_attempts_late_write_is_refused(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc, kept = app(make_orc)
    async with orc:
        job_id = await run(orc, "flaky")
        fence: Fence = kept["fence"]
        with pytest.raises(StaleLease):
            await orc.stores.output.write(fence, 99, [{"kind": "text", "step": None,
                                                       "body": "late"}], max_bytes=10_000)  # fmt: skip
        kept["output"].text("late too")
        with pytest.raises(StaleLease):
            await kept["output"].flush()
        chunks = await orc.stores.output.read(job_id)
    assert "late" not in texts(chunks)
    assert [c.attempt for c in chunks if c.kind == "text"] == [1, 2]


async def test_a_committed_steps_output_is_kept_and_never_repeated(
    make_orc: Callable[..., Orchestrator],
) -> None:
    orc, _ = app(make_orc)
    async with orc:
        job_id = await run(orc, "stepped")
        chunks = await orc.stores.output.read(job_id)
        final = await orc.stores.output.read(job_id, final=True)
    assert [(c.kind, c.attempt, c.step, c.body) for c in chunks] == [
        ("text", 1, 1, "step 1 of attempt 1"),
        ("text", 1, 2, "step 2 of attempt 1"),
        ("superseded", 1, 2, {"attempt": 1, "step": 2}),
        ("text", 2, 2, "step 2 of attempt 2"),
        ("text", 2, 3, "step 3 of attempt 2"),
    ]
    assert texts(final) == "step 1 of attempt 1step 2 of attempt 2step 3 of attempt 2"


async def test_the_size_cap_holds_and_says_it_cut(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    orc, kept = app(make_orc)
    async with orc:
        job_id = await run(orc, "capped")
        chunks = await orc.stores.output.read(job_id)
    assert kept["flushed"] == 20  # the task went on writing; what passed the cap was dropped
    kinds = [c.kind for c in chunks]
    assert kinds == ["text"] * 9 + ["cut"]  # 9 bodies of 11 bytes ("xxxxxxxxx" as JSON) fit
    assert chunks[-1].body == {"max_bytes": 100}
    head = await (
        await db.execute("SELECT bytes, cut FROM orc_job_output_heads WHERE job_id = %s", (job_id,))
    ).fetchone()
    assert head == (99, True)
