"""A job's live output (docs/output.md), on real PostgreSQL: chunks at their offsets, marked with
their attempt and step, written in batches under the attempt's lease; the superseded marker a
failed attempt's outcome writes, and the final read; a committed step's output kept, never
repeated; the size cap. Then with real processes: ``orchestrator serve`` and worker processes
(readers before, during and after a job, reconnections, another tenant, a revoked token), and
``llm_generate`` against the local LLM server, its worker SIGKILLed mid-stream, and ``run_agent``,
its worker SIGKILLed after a step's reply was committed and before the step's checkpoint."""

from __future__ import annotations

import asyncio
import functools
import json
import signal
from collections.abc import Callable, Iterator
from typing import Any
from uuid import UUID, uuid4

import httpx
import psycopg
import pytest

from demo import llm_server as llm
from orchestrator import JobContext, Orchestrator, RetryLater, StaleLease, Status
from orchestrator.domain.models import Fence
from orchestrator.domain.output import OutputChunk
from orchestrator.domain.principals import Scope
from orchestrator.runtime.output import OutputWrites
from orchestrator.storage.output import Batch
from tests.support import job_types_app, output_app
from tests.support.api_server import ApiServer, token
from tests.support.external import message_service
from tests.support.harness import ROOT, WorkerRun, config_with, finished, wait_for
from tests.support.workers import WorkerProcess

APP = "tests.support.output_app:orc"
KEY = "sk-test-0123456789abcdef"

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
            late = [{"kind": "text", "step": None, "body": "late"}]
            await orc.stores.output.write(Batch(fence, 99, late, 10_000))
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


async def test_batches_of_several_jobs_are_written_together_each_under_its_lease(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    # A worker's batches that arrive while one is being written go in one statement
    # (OutputWrites): one transaction for them all, each still fenced by its own lease.
    orc, _ = app(make_orc)
    async with orc:
        ids = [await orc.submit("tokens", {}) for _ in range(4)]
        fences = []
        for job_id in ids:
            cur = await db.execute(
                "UPDATE orc_jobs SET status = 'RUNNING', attempt = 1,"
                " lease_token = gen_random_uuid() WHERE id = %s RETURNING lease_token",
                (job_id,),
            )
            (lease,) = await cur.fetchone() or (None,)
            fences.append(Fence(job_id, lease, 1))
        fences[3] = Fence(ids[3], uuid4(), 1)  # a stale attempt's
        writes = OutputWrites(orc.stores.output)
        done = await asyncio.gather(*(
            writes.write(Batch(f, 1, [{"kind": "text", "step": None, "body": f"job {n}"}], 1000))
            for n, f in enumerate(fences)
        ), return_exceptions=True)  # fmt: skip
    assert [type(d).__name__ for d in done] == ["Written", "Written", "Written", "StaleLease"]
    cur = await db.execute(
        "SELECT job_id, xmin::text, body FROM orc_job_output WHERE job_id = ANY (%s)", (ids,)
    )
    rows = {row[0]: row[1:] for row in await cur.fetchall()}
    assert [rows[i][1] for i in ids[:3]] == ["job 0", "job 1", "job 2"] and ids[3] not in rows
    # The first went alone, at once; the two that came meanwhile, together.
    assert rows[ids[1]][0] == rows[ids[2]][0] != rows[ids[0]][0]


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


# -- with real processes: the API server, worker processes, the local LLM server ---------------


async def sse(
    client: httpx.AsyncClient, path: str, secret: str, *, last_event_id: int | None = None,
    stop_after: int | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """The chunks a stream of ``path`` sends (until it ends, or ``stop_after`` of them)."""
    headers = {"Authorization": f"Bearer {secret}", "Accept": "text/event-stream"}
    if last_event_id is not None:
        headers["Last-Event-ID"] = str(last_event_id)
    got: list[dict[str, Any]] = []
    async with client.stream("GET", path, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        event = ""
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: ") and event != "end":  # the job's end: no chunk
                got.append(json.loads(line.removeprefix("data: ")))
                if stop_after is not None and len(got) == stop_after:
                    break
    return got


async def plain(client: httpx.AsyncClient, path: str, secret: str, **params: Any) -> list[Any]:
    """Every chunk a plain read returns, a page of 7 at a time (following next_offset)."""
    chunks: list[Any] = []
    offset = 0
    while True:
        answer = await client.get(
            path, params={**params, "offset": offset, "limit": 7},
            headers={"Authorization": f"Bearer {secret}"},
        )  # fmt: skip
        assert answer.status_code == 200, answer.text
        page = answer.json()
        if not page["chunks"]:
            return chunks
        chunks += page["chunks"]
        offset = page["next_offset"]


@pytest.fixture
async def served(make_orc: Callable[..., Orchestrator], empty_dsn: str) -> Any:
    """The output app's API server and a worker process, and this process's orchestrator."""
    orc = make_orc(retry_config=output_app.CONFIG)
    output_app.register(orc)
    env = {"ORCHESTRATOR_RETRY_CONFIG": output_app.CONFIG}
    async with orc:
        with ApiServer(empty_dsn, app=APP, **env) as server, WorkerProcess(empty_dsn, APP, **env):
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                yield orc, client


async def test_readers_before_during_and_after_a_job_read_the_same_chunks_and_resume_exactly(
    served: Any,
) -> None:
    orc, client = served
    scopes = (Scope.READ, Scope.SUBMIT)
    mine = await token(orc.stores.tokens, "reader-a", *scopes, tenants=["tenant-a"])
    other = await token(orc.stores.tokens, "reader-b", *scopes, tenants=["tenant-b"])
    submitted = await client.post(
        "/api/v1/jobs", headers={"Authorization": f"Bearer {mine}"},
        json={"job_type": "streamer", "payload": {"deltas": 30, "every": 0.03, "fail_first": True}},
    )  # fmt: skip
    assert submitted.status_code == 201, submitted.text
    job_id = submitted.json()["job_id"]
    path = f"/api/v1/jobs/{job_id}/output"
    async with asyncio.timeout(60):
        before = asyncio.create_task(sse(client, path, mine))

        async def streaming() -> bool:
            return len(await orc.stores.output.read(UUID(job_id))) >= 2

        await wait_for(streaming, timeout=30)
        during = asyncio.create_task(sse(client, path, mine))
        first = await sse(client, path, mine, stop_after=2)  # a reader that goes away...
        rest = await sse(client, path, mine, last_event_id=first[-1]["offset"])  # ...and is back
        head = await sse(client, path, mine, stop_after=1)
        tail = await sse(client, f"{path}?offset={head[-1]['offset'] + 1}", mine)
        job = await finished(orc, UUID(job_id))
        after = await plain(client, path, mine)
        everything = [await before, await during, first + rest, head + tail, after]
        final = await plain(client, path, mine, final="true")
    assert job.status is Status.COMPLETED
    assert all(reader == after for reader in everything)
    assert [c["offset"] for c in after] == list(range(len(after)))
    marks = [(c["kind"], c["attempt"]) for c in after]
    superseded = marks.index(("superseded", 1))
    assert {m for m in marks[:superseded]} == {("progress", 1), ("text", 1)}
    assert {m for m in marks[superseded + 1 :]} == {("progress", 2), ("text", 2)}
    assert "".join(c["body"] for c in final if c["kind"] == "text") == "".join(
        f"a2d{n} " for n in range(30)
    )
    assert [c["body"] for c in final if c["kind"] == "progress"] == [{"attempt": 2, "deltas": 30}]
    # Another tenant's token: as if the job did not exist, read or streamed.
    headers = {"Authorization": f"Bearer {other}"}
    assert (await client.get(path, headers=headers)).status_code == 404
    streamed = await client.get(path, headers={**headers, "Accept": "text/event-stream"})
    assert streamed.status_code == 404


async def test_a_reader_behind_the_shared_feed_reads_up_to_it_then_follows_it(
    served: Any,
) -> None:
    # The server reads a job's output once for all its readers (api/feeds.py), from where its
    # first reader started: here offset 5. A reader that starts at 0 meanwhile reads 0-4
    # itself, then follows the same feed; both read to the end, nothing missed or repeated.
    orc, client = served
    reader = await token(orc.stores.tokens, "reader")
    job_id = await orc.submit("streamer", {"deltas": 60, "every": 0.05})
    path = f"/api/v1/jobs/{job_id}/output"

    async def stored(n: int) -> bool:
        return len(await orc.stores.output.read(job_id)) >= n

    await wait_for(functools.partial(stored, 6), timeout=30)
    headers = {"Authorization": f"Bearer {reader}", "Accept": "text/event-stream"}
    ahead: list[dict[str, Any]] = []
    async with asyncio.timeout(60), client.stream("GET", f"{path}?offset=5", headers=headers) as r:
        lines = r.aiter_lines()
        while not ahead:  # the feed runs, from offset 5
            if (line := await anext(lines)).startswith("data: "):
                ahead.append(json.loads(line.removeprefix("data: ")))
        behind = await sse(client, path, reader)
        async for line in lines:
            if line.startswith("data: "):
                ahead.append(json.loads(line.removeprefix("data: ")))
    everything = await plain(client, path, reader)
    assert (await orc.get_job(job_id)).status is Status.COMPLETED
    assert behind == everything and ahead == [*everything[5:], {"status": "COMPLETED"}]


async def test_a_revoked_tokens_output_stream_ends_within_5_s(served: Any) -> None:
    orc, client = served
    reader = await token(orc.stores.tokens, "reader")
    job_id = await orc.submit("streamer", {"deltas": 3000, "every": 0.02})
    path = f"/api/v1/jobs/{job_id}/output"
    headers = {"Authorization": f"Bearer {reader}", "Accept": "text/event-stream"}
    async with client.stream("GET", path, headers=headers) as response:
        lines = response.aiter_lines()
        async with asyncio.timeout(30):
            while not (await anext(lines)).startswith("data: "):
                pass
        await orc.stores.tokens.revoke("reader")
        async with asyncio.timeout(5):  # the stream ends: its lines run out
            async for _ in lines:
                pass
    assert (await orc.get_job(job_id)).finished_at is None  # it ended for the token, not the job
    await orc.cancel(job_id, reason="the test is over", by="tests")


@pytest.fixture
def model_server() -> Iterator[llm.LocalLLM]:
    with llm.serve(api_key=KEY) as server:
        yield server


async def test_llm_generate_killed_mid_stream_is_superseded_then_streamed_whole(
    make_orc: Callable[..., Orchestrator], model_server: llm.LocalLLM, empty_dsn: str
) -> None:
    words = " ".join(f"w{n}" for n in range(16))
    model_server.script("slow", [llm.Text(words, chunks=16, every=0.08)])
    config = ROOT / "tests" / "support" / "job_types.toml"
    env = {"ORCHESTRATOR_RETRY_CONFIG": config, "ANTHROPIC_BASE_URL": model_server.url,
           "ANTHROPIC_API_KEY": KEY}  # fmt: skip
    app = "tests.support.job_types_app:orc"
    orc = make_orc(retry_config=config)
    job_types_app.register(orc)
    async with orc:
        with WorkerProcess(empty_dsn, app, **env) as first:
            job_id = await orc.submit("llm_generate", {
                "model": "slow", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]
            })  # fmt: skip

            async def streaming() -> bool:
                return bool(await orc.stores.output.read(job_id))

            await wait_for(streaming, timeout=30)
            first.signal(signal.SIGKILL)  # mid-stream: its last deltas never reach the database
            assert first.wait() == -signal.SIGKILL
        with WorkerProcess(empty_dsn, app, **env) as second:  # sweeps the zombie, runs it again
            job = await finished(orc, job_id, timeout=60)
            assert job.status is Status.COMPLETED, second.output()[-3000:]
        chunks = await orc.stores.output.read(job_id)
        final = await orc.stores.output.read(job_id, final=True)
    assert job.result["text"] == words
    # The attempt killed mid-stream (the first that streamed: one before it may have been swept
    # before its call, on a loaded machine), superseded, then the next one's every delta.
    [marker] = [c for c in chunks if c.kind == "superseded"]
    killed = marker.attempt
    before, after = chunks[: marker.offset], chunks[marker.offset + 1 :]
    assert marker.body == {"attempt": killed, "step": 1}
    assert {(c.kind, c.attempt) for c in before} == {("text", killed)}
    assert {(c.kind, c.attempt) for c in after} == {("text", job.attempt)}
    assert texts(after) == words
    assert words.startswith(texts(before)) and texts(before) != words  # cut short
    assert texts(final) == words


async def test_run_agent_resumed_from_a_committed_reply_writes_its_text_once_more(
    make_orc: Callable[..., Orchestrator], model_server: llm.LocalLLM, empty_dsn: str
) -> None:
    config = ROOT / "tests" / "support" / "job_types.toml"
    app = "tests.support.job_types_app:orc"
    orc = make_orc(retry_config=config)
    job_types_app.register(orc)
    step2 = "Step 2: calling send_message."  # the local server's reply to the agent's step 2
    with message_service() as service:
        env = {"ORCHESTRATOR_RETRY_CONFIG": config, "ANTHROPIC_BASE_URL": model_server.url,
               "ANTHROPIC_API_KEY": KEY, "TEST_MESSAGE_SERVICE_URL": service.url}  # fmt: skip
        async with orc:
            with WorkerProcess(empty_dsn, app, **env) as first:
                service.hold("text-2")  # step 2's tool call is held open...
                job_id = await orc.submit("run_agent", {
                    "prompt": "tell the team", "model": "agent", "tools": ["send_message"]
                })  # fmt: skip
                await asyncio.to_thread(service.held.wait, 30)

                async def streamed() -> bool:
                    chunks = await orc.stores.output.read(job_id)
                    return any(c.step == 2 and c.kind == "text" for c in chunks)

                await wait_for(streamed, timeout=30)
                # ...so the step's reply is committed in the ledger, its text in the output, and
                # the step not checkpointed when the worker dies.
                first.signal(signal.SIGKILL)
                assert first.wait() == -signal.SIGKILL
                service.release()
            with WorkerProcess(empty_dsn, app, **env) as second:
                job = await finished(orc, job_id, timeout=60)
                assert job.status is Status.COMPLETED, second.output()[-3000:]
            chunks = await orc.stores.output.read(job_id)
            final = await orc.stores.output.read(job_id, final=True)
    assert model_server.requests["agent"] == 4  # the resumed step 2 did not ask the model again
    replies = [
        "".join(b["text"] for b in m["content"] if b["type"] == "text")
        for m in job.result["messages"] if m["role"] == "assistant"
    ]  # fmt: skip
    assert replies[1] == step2
    [marker] = [c for c in chunks if c.kind == "superseded"]
    assert marker.body == {"attempt": marker.attempt, "step": 2}
    killed = marker.attempt
    assert [(c.attempt, c.step, c.body) for c in chunks[: marker.offset] if c.step == 2] == [
        (killed, 2, step2)
    ]
    # The resumed attempt wrote step 2's text from the ledger's reply, once, then streamed on.
    after = chunks[marker.offset + 1 :]
    assert {(c.kind, c.attempt) for c in after} == {("text", job.attempt)}
    assert [(c.step, c.body) for c in after if c.step == 2] == [(2, step2)]
    assert texts(after) == "".join(replies[1:])
    assert texts(final) == "".join(replies)
