"""Dependencies (docs/workflows.md): jobs that wait for jobs, on a real database and real
workers. A graph runs in the transactions of its jobs' ends: a blocked job has no dispatch
until its last parent ends, each failure policy does what docs/workflows.md says, nothing of
it spends an attempt or a retry, and no tenant reaches another's jobs."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any
from uuid import UUID

import psycopg
import pytest

from orchestrator import Orchestrator, Status, SubmitError
from orchestrator.storage.usage import CallUsage
from tests.support import graph_app, log_guard
from tests.support.harness import ROOT, WorkerRun, finished, wait_for
from tests.support.workers import WorkerProcess


@pytest.fixture
async def orc(make_orc: Callable[..., Orchestrator]) -> AsyncIterator[Orchestrator]:
    orc = make_orc(retry_config=graph_app.CONFIG)
    graph_app.register(orc)
    graph_app.FAILING.clear()
    await orc.open()
    yield orc


def node(name: str, *parents: Any, **spec: Any) -> dict[str, Any]:
    return {"job_type": "node", "payload": {"name": name}, "depends_on": list(parents), **spec}


async def kinds(orc: Orchestrator, job_id: UUID) -> list[str]:
    return [e.kind for e in await orc.job_events(job_id)]


async def dispatches(db: psycopg.AsyncConnection[Any], job_id: UUID) -> int:
    cur = await db.execute(
        "SELECT count(*) FROM procrastinate_jobs WHERE lock = %s", (str(job_id),)
    )
    (n,) = await cur.fetchone() or (0,)
    return int(n)


async def test_a_graph_in_one_batch_runs_in_dependency_order_on_a_worker_process(
    orc: Orchestrator, empty_dsn: str
) -> None:
    # a → b → d, a → c → d, and e after d: one transaction; a worker process of 4 slots.
    ids = await orc.submit_many([
        node("a"), node("b", 0), node("c", 0), node("d", 1, 2), node("e", 3),
    ])  # fmt: skip
    assert [(await orc.get_job(i)).status for i in ids] == [Status.PENDING] + [Status.BLOCKED] * 4
    env = {"ORCHESTRATOR_RETRY_CONFIG": graph_app.CONFIG, "ORCHESTRATOR_WORKER_CONCURRENCY": 4}
    with WorkerProcess(empty_dsn, app="tests.support.graph_app:orc", **env):
        jobs = [await finished(orc, i) for i in ids]
    assert all(j.status is Status.COMPLETED for j in jobs), [j.status for j in jobs]
    by_name = dict(zip("abcde", jobs, strict=True))
    for child, parents in {"b": "a", "c": "a", "d": "bc", "e": "d"}.items():
        for parent in parents:
            assert by_name[child].started_at >= by_name[parent].finished_at  # type: ignore[operator]
    # Waiting spent nothing: one attempt each, no retry.
    assert all((j.attempt, j.retry_count) == (1, 0) for j in jobs)
    assert jobs[3].result == {"name": "d", "parents": [
        {"ended": "COMPLETED", "name": "b", "error": None},
        {"ended": "COMPLETED", "name": "c", "error": None},
    ]}  # fmt: skip
    assert (await kinds(orc, ids[3]))[:4] == [
        "job.created", "job.blocked", "job.unblocked", "job.running",
    ]  # fmt: skip


async def xmins(db: psycopg.AsyncConnection[Any], job_id: UUID, kind: str) -> list[str]:
    """The transactions that wrote ``job_id``'s events of ``kind``."""
    cur = await db.execute(
        "SELECT xmin::text FROM orc_job_events WHERE job_id = %s AND kind = %s ORDER BY id",
        (job_id, kind),
    )
    return [row[0] for row in await cur.fetchall()]


async def test_a_chain_s_next_link_is_claimed_in_the_transaction_that_released_it(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any]
) -> None:
    # A worker of one slot: each link's completion fetches for the slot it frees, in the same
    # statement, and claims the job that end released (bench/workflows.py: a chain's rate).
    # The slot takes the first due dispatch of its queues, so it listens on the chain's alone:
    # on every queue, a maintenance tick that its periodic deferrer queued meanwhile would go
    # first (as it did in CI).
    ids = await orc.submit_many([node("a"), node("b", 0), node("c", 1), node("d", 2)])
    async with WorkerRun(orc, concurrency=1, queues=["node"]) as worker:
        await worker.until_finished(*ids)
    jobs = [await orc.get_job(i) for i in ids]
    assert all(j.status is Status.COMPLETED for j in jobs), [j.status for j in jobs]
    for parent, child in itertools.pairwise(ids):
        assert await xmins(db, child, "job.running") == await xmins(db, parent, "job.completed")
    assert all(j.attempt == 1 for j in jobs)


async def test_a_parent_claimed_after_its_fetch_still_hands_its_slot_to_its_child(
    orc: Orchestrator, dsn: str, db: psycopg.AsyncConnection[Any]
) -> None:
    # Another transaction holds the parent's row when the worker fetches it: the fetch leaves
    # its claim for later (orc_claim_v2, in a statement of its own), and that claim too says
    # that jobs wait for it, so its completion still claims the child it releases.
    parent, child = await orc.submit_many([node("a"), node("b", 0)])
    async with await psycopg.AsyncConnection.connect(dsn) as holder:
        await holder.execute("SELECT FROM orc_jobs WHERE id = %s FOR SHARE", (parent,))
        async with WorkerRun(orc, concurrency=1, queues=["node"]) as worker:  # as above
            await wait_for(lambda: _dispatch_doing(db, parent), timeout=15)
            await holder.commit()
            await worker.until_finished(parent, child)
    assert [(await orc.get_job(i)).status for i in (parent, child)] == [Status.COMPLETED] * 2
    assert await xmins(db, child, "job.running") == await xmins(db, parent, "job.completed")


async def _dispatch_doing(db: psycopg.AsyncConnection[Any], job_id: UUID) -> bool:
    cur = await db.execute(
        "SELECT FROM procrastinate_jobs WHERE lock = %s AND status = 'doing'", (str(job_id),)
    )
    return await cur.fetchone() is not None


async def test_a_completion_whose_fetch_fails_is_written_alone(
    make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    # The worker's registry entry is gone (silent too long) while a parent runs: the fetch in
    # its completion's statement fails, the completion is written without it, and the
    # worker's own fetch loop registers again and runs the child.
    orc = make_orc(retry_config=graph_app.CONFIG, stalled_worker_seconds=600)  # no beat meanwhile
    graph_app.register(orc)
    await orc.open()
    parent, child = await orc.submit_many([
        {**node("a"), "payload": {"name": "a", "sleep": 1.0}}, node("b", 0),
    ])  # fmt: skip
    async with WorkerRun(orc, concurrency=1) as worker:
        await wait_for(lambda: _status_is(orc, parent, Status.RUNNING), timeout=15)
        await db.execute("DELETE FROM procrastinate_workers")
        await worker.until_finished(parent, child)
    assert [(await orc.get_job(i)).status for i in (parent, child)] == [Status.COMPLETED] * 2
    assert await xmins(db, child, "job.running") != await xmins(db, parent, "job.completed")


async def _status_is(orc: Orchestrator, job_id: UUID, status: Status) -> bool:
    return (await orc.get_job(job_id)).status is status


async def test_the_last_two_parents_ending_at_once_release_the_child_exactly_once(
    orc: Orchestrator, dsn: str, db: psycopg.AsyncConnection[Any]
) -> None:
    p1, p2, child = await orc.submit_many([node("p1"), node("p2"), node("child", 0, 1)])
    await db.execute(
        "UPDATE orc_jobs SET status = 'RUNNING', lease_token = gen_random_uuid() "
        "WHERE id = ANY(%s)", ([p1, p2],),
    )  # fmt: skip
    assert await dispatches(db, child) == 0
    end = "UPDATE orc_jobs SET status = 'COMPLETED', lease_token = NULL WHERE id = %s"
    async with (
        await psycopg.AsyncConnection.connect(dsn) as first,
        await psycopg.AsyncConnection.connect(dsn) as second,
    ):
        await first.execute(end, (p1,))  # its trigger counts the child down, and holds it
        racing = asyncio.create_task(second.execute(end, (p2,)))
        await wait_for(lambda: _waiting_on_a_lock(db, second), timeout=30)
        await first.commit()
        await racing
        await second.commit()
    job = await orc.get_job(child)
    assert job.status is Status.PENDING
    assert (await kinds(orc, child)).count("job.unblocked") == 1
    assert await dispatches(db, child) == 1


@log_guard.fails_jobs("PERMANENT_ERROR")
async def test_cancel_goes_down_the_graph_and_a_run_dependant_runs(orc: Orchestrator) -> None:
    # a fails: b (cancel, the default) is cancelled, so is c below it; d runs anyway (run), and
    # e, below the cancelled c by a `run` edge, runs and reads the cancellation.
    graph_app.FAILING.add("a")
    ids = await orc.submit_many([
        node("a"), node("b", 0), node("c", 1),
        node("d", {"job": 0, "on_failure": "run"}),
        {**node("e", 2), "job_type": "node_runs_anyway"},
    ])  # fmt: skip
    async with WorkerRun(orc) as worker:
        await worker.until_finished(*ids)
    a, b, c, d, e = [await orc.get_job(i) for i in ids]
    assert [j.status for j in (a, b, c, d, e)] == [
        Status.FAILED, Status.CANCELLED, Status.CANCELLED, Status.COMPLETED, Status.COMPLETED,
    ]  # fmt: skip
    cancelled = [ev for ev in await orc.job_events(ids[2]) if ev.kind == "job.cancelled"]
    assert cancelled[0].payload["by"] == "dependencies"
    assert d.result == {"name": "d", "parents": [
        {"ended": "FAILED", "name": None, "error": "PERMANENT_ERROR"},
    ]}  # fmt: skip
    assert e.result == {
        "name": "e",
        "parents": [{"ended": "CANCELLED", "name": None, "error": None}],
    }
    assert (b.attempt, c.attempt) == (0, 0)


@log_guard.fails_jobs("PERMANENT_ERROR")
async def test_wait_holds_the_child_until_the_requeued_parent_completes(orc: Orchestrator) -> None:
    graph_app.FAILING.add("a")
    a, child = await orc.submit_many([node("a"), node("child", {"job": 0, "on_failure": "wait"})])
    async with WorkerRun(orc) as worker:
        await worker.until_finished(a)
        letter = await orc.dead_letter_of_job(a)
        assert letter is not None
        await asyncio.sleep(0.5)
        assert (await orc.get_job(child)).status is Status.BLOCKED  # while the letter is open
        graph_app.FAILING.clear()
        replay = await orc.requeue_dead_letter(letter.id)
        await worker.until_finished(replay, child)
    job = await orc.get_job(child)
    assert job.status is Status.COMPLETED
    assert job.result == {
        "name": "child",
        "parents": [{"ended": "COMPLETED", "name": "a", "error": None}],
    }
    assert [p.job_id for p in await orc.parents(child)] == [replay]


@log_guard.fails_jobs("PERMANENT_ERROR")
async def test_wait_cancels_the_child_when_the_letter_is_discarded(orc: Orchestrator) -> None:
    graph_app.FAILING.add("a")
    a, child, grandchild = await orc.submit_many([
        node("a"), node("child", {"job": 0, "on_failure": "wait"}), node("grandchild", 1),
    ])  # fmt: skip
    async with WorkerRun(orc) as worker:
        await worker.until_finished(a)
    letter = await orc.dead_letter_of_job(a)
    assert letter is not None
    await orc.request_discard(letter.id, by="alice", reason="not needed")
    assert (await orc.get_job(child)).status is Status.BLOCKED  # a request is not a discard
    await orc.confirm_discard(letter.id, by="bob")
    assert [(await orc.get_job(j)).status for j in (child, grandchild)] == [Status.CANCELLED] * 2


@log_guard.fails_jobs("PERMANENT_ERROR")
async def test_a_parent_already_finished_settles_at_submit(orc: Orchestrator) -> None:
    graph_app.FAILING.add("bad")
    good, bad = await orc.submit_many([node("good"), node("bad")])
    async with WorkerRun(orc) as worker:
        await worker.until_finished(good, bad)
        after_good, after_bad, anyway = await orc.submit_many([
            node("after good", good), node("after bad", bad),
            node("anyway", {"job": bad, "on_failure": "run"}),
        ])  # fmt: skip
        assert (await orc.get_job(after_bad)).status is Status.CANCELLED
        await worker.until_finished(after_good, anyway)
    assert (await orc.get_job(after_good)).status is Status.COMPLETED
    assert (await orc.get_job(anyway)).status is Status.COMPLETED


async def test_cancelling_a_blocked_job_cancels_what_depends_on_it(orc: Orchestrator) -> None:
    a, b, c = await orc.submit_many(
        [node("a", run_at="2099-01-01T00:00:00Z"), node("b", 0), node("c", 1)]
    )
    await orc.cancel(b, reason="changed my mind")
    assert [(await orc.get_job(j)).status for j in (a, b, c)] == [
        Status.PENDING, Status.CANCELLED, Status.CANCELLED,
    ]  # fmt: skip


async def test_a_parent_unknown_or_of_another_tenant_is_refused_and_nothing_stored(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any]
) -> None:
    theirs = await orc.submit("node", {"name": "theirs"}, tenant_id="globex")
    cur = await db.execute("SELECT count(*) FROM orc_jobs")
    (before,) = await cur.fetchone() or (0,)
    for parent in (theirs, UUID(int=7)):
        with pytest.raises(SubmitError, match=f"job 1 of the submit: depends_on: no job {parent}"):
            await orc.submit_many([
                node("first", tenant_id="acme"), node("mine", 0, parent, tenant_id="acme"),
            ])  # fmt: skip
    with pytest.raises(SubmitError, match="job 1 of the submit: depends_on: no job"):
        await orc.submit_many([  # a job of the same batch, but of another tenant
            node("theirs too", tenant_id="globex"), node("mine", 0, tenant_id="acme"),
        ])  # fmt: skip
    with pytest.raises(SubmitError, match="job 0 of the submit: depends_on names job 0"):
        await orc.submit_many([node("self", 0)])  # no cycle: a batch index points back
    with pytest.raises(SubmitError, match="job_key"):
        await orc.submit_many([node("keyed", job_key="k"), node("after", 0)])
    cur = await db.execute("SELECT count(*) FROM orc_jobs")
    assert (await cur.fetchone() or (0,))[0] == before
    assert (await orc.get_job(theirs)).status is Status.PENDING


async def test_a_parent_ending_while_its_child_is_submitted_is_not_missed(
    orc: Orchestrator, dsn: str, db: psycopg.AsyncConnection[Any]
) -> None:
    # The parent's end is written, not yet committed, when the child's submit reads it: the
    # submit waits for it (the parent is locked), then settles the edge itself.
    parent = await orc.submit("node", {"name": "parent"})
    first = await orc.submit("node", {"name": "first child"}, depends_on=[parent])
    await db.execute(
        "UPDATE orc_jobs SET status = 'RUNNING', lease_token = gen_random_uuid() WHERE id = %s",
        (parent,),
    )
    async with await psycopg.AsyncConnection.connect(dsn) as ending:
        await ending.execute(
            "UPDATE orc_jobs SET status = 'COMPLETED', lease_token = NULL WHERE id = %s", (parent,)
        )
        submitting = asyncio.create_task(orc.submit("node", {"name": "child"}, depends_on=[parent]))
        await wait_for(lambda: _a_lock_waited_for(db), timeout=30)  # the submit waits for it
        await ending.commit()
        child = await submitting
    assert [(await orc.get_job(j)).status for j in (first, child)] == [Status.PENDING] * 2
    assert await dispatches(db, child) == 1


# -- children spawned from a running job -------------------------------------------------------


async def test_a_waiting_parent_holds_no_slot_its_children_run_on_the_only_one(
    orc: Orchestrator, empty_dsn: str, db: psycopg.AsyncConnection[Any]
) -> None:
    graph_app.FAILING.clear()
    planner = await orc.submit("planner", {"topics": ["x", "y", "z"]})
    env = {"ORCHESTRATOR_RETRY_CONFIG": graph_app.CONFIG, "ORCHESTRATOR_WORKER_CONCURRENCY": 1}
    with WorkerProcess(empty_dsn, app="tests.support.graph_app:orc", **env):
        job = await finished(orc, planner, timeout=60)
    assert job.status is Status.COMPLETED, job.last_error
    assert job.result["report"] == ["x", "y", "z"]
    assert (job.retry_count, job.attempt) == (0, 2)  # one attempt spawned, one resumed
    assert await kinds(orc, planner) == [
        "job.created", "job.running", "job.children_spawned", "job.waiting_for_children",
        "job.unblocked", "job.running", "job.checkpointed", "job.checkpointed", "job.completed",
    ]  # fmt: skip
    cur = await db.execute("SELECT count(*) FROM orc_jobs WHERE job_type = 'node'")
    assert await cur.fetchone() == (3,)
    # `orchestrator status JOB` lists them; a child's page names its parent's
    shown = await status_of(empty_dsn, planner)
    children = [c.job_id for c in await orc.children(planner)]
    assert "  children:" in shown and all(f"    {c}  node" in shown for c in children), shown


async def status_of(dsn: str, job_id: UUID) -> str:
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "orchestrator", "--app", "tests.support.graph_app:orc",
         "status", str(job_id)],
        capture_output=True, text=True, cwd=ROOT, timeout=60, check=False,
        env={**os.environ, "DATABASE_URL": dsn, "ORCHESTRATOR_RETRY_CONFIG": str(graph_app.CONFIG)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


async def test_a_blocked_job_says_what_it_waits_for(orc: Orchestrator, dsn: str) -> None:
    a, b, c = await orc.submit_many([node("a", run_at=FAR), node("b", run_at=FAR), node("c", 0, 1)])
    job = await orc.get_job(c)
    assert job.waiting_for == "waiting for 2 jobs to end"
    shown = await status_of(dsn, c)
    assert "waiting for 2 jobs to end" in shown, shown
    assert f"    {a}  node" in shown and f"    {b}  node" in shown, shown
    assert "(on failure: cancel)" in shown


async def spawned(db: psycopg.AsyncConnection[Any], parent: UUID) -> list[UUID]:
    cur = await db.execute(
        "SELECT child_id FROM orc_job_children WHERE parent_id = %s ORDER BY n", (parent,)
    )
    return [row[0] for row in await cur.fetchall()]


async def node_jobs(db: psycopg.AsyncConnection[Any]) -> int:
    cur = await db.execute("SELECT count(*) FROM orc_jobs WHERE job_type = 'node'")
    (n,) = await cur.fetchone() or (0,)
    return int(n)


FAR = "2099-01-01T00:00:00Z"
GRAPH_WORKER = {"app": "tests.support.graph_app:orc", "ORCHESTRATOR_RETRY_CONFIG": graph_app.CONFIG}


async def test_a_worker_killed_after_its_spawn_committed_leaves_one_set_of_children(
    orc: Orchestrator, empty_dsn: str, db: psycopg.AsyncConnection[Any]
) -> None:
    planner = await orc.submit("planner", {"topics": ["x", "y"], "hold_after_spawn": 60})
    with WorkerProcess(empty_dsn, **GRAPH_WORKER) as first:
        await wait_for(lambda: _some(spawned(db, planner)), timeout=30)
        first.signal(signal.SIGKILL)
        assert await asyncio.to_thread(first.wait) == -signal.SIGKILL
    children = await spawned(db, planner)
    with WorkerProcess(empty_dsn, **GRAPH_WORKER):  # sweeps the zombie, runs it again
        job = await finished(orc, planner, timeout=60)
    assert job.status is Status.COMPLETED, job.last_error
    assert await spawned(db, planner) == children and await node_jobs(db) == 2
    assert job.result["children"] == [str(c) for c in children]


async def test_a_worker_killed_inside_its_spawn_before_the_commit_leaves_one_set_of_children(
    orc: Orchestrator, empty_dsn: str, dsn: str, db: psycopg.AsyncConnection[Any]
) -> None:
    # The spawn's transaction has submitted the children and waits to record them (the test
    # holds orc_job_children); the worker is killed there, so that transaction never commits.
    planner = await orc.submit("planner", {"topics": ["x", "y"]})
    async with await psycopg.AsyncConnection.connect(dsn) as holder:
        await holder.execute("LOCK TABLE orc_job_children IN EXCLUSIVE MODE")
        with WorkerProcess(empty_dsn, **GRAPH_WORKER) as first:

            async def recording() -> bool:
                cur = await db.execute(
                    "SELECT count(*) FROM pg_locks AS l JOIN pg_class AS c ON c.oid = l.relation"
                    " WHERE c.relname = 'orc_job_children' AND NOT l.granted"
                )
                return (await cur.fetchone() or (0,))[0] > 0

            await wait_for(recording, timeout=30)
            first.signal(signal.SIGKILL)
            assert await asyncio.to_thread(first.wait) == -signal.SIGKILL
        await holder.rollback()
    await wait_for(lambda: _none(node_jobs(db)), timeout=30)  # the killed spawn rolled back
    with WorkerProcess(empty_dsn, **GRAPH_WORKER):
        job = await finished(orc, planner, timeout=60)
    assert job.status is Status.COMPLETED, job.last_error
    assert len(await spawned(db, planner)) == 2 and await node_jobs(db) == 2


async def _some(values: Any) -> bool:
    return bool(await values)


async def _none(count: Any) -> bool:
    return await count == 0


@log_guard.fails_jobs("SUBMIT_REJECTED")
async def test_a_job_can_neither_spawn_into_another_tenant_nor_wait_for_a_stranger(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any]
) -> None:
    theirs = await orc.submit("node", {"name": "theirs"}, tenant_id="globex", run_at=FAR)
    planting = await orc.submit("intruder", {"spawn_into": "globex"}, tenant_id="acme")
    waiting = await orc.submit("intruder", {"wait_on": str(theirs)}, tenant_id="acme")
    async with WorkerRun(orc) as worker:
        await worker.until_finished(planting, waiting)
    for job_id, said in ((planting, "is not its parent's"), (waiting, "is not a child")):
        job = await orc.get_job(job_id)
        assert job.status is Status.FAILED and job.last_error is not None
        assert job.last_error.classification == "PERMANENT" and said in job.last_error.message
    assert await node_jobs(db) == 1  # nothing planted
    cur = await db.execute("SELECT status, has_dependants FROM orc_jobs WHERE id = %s", (theirs,))
    assert await cur.fetchone() == ("PENDING", False)


@log_guard.fails_jobs("PERMANENT_ERROR")
async def test_a_child_s_failure_reaches_its_parent_and_a_cancel_reaches_the_children(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any]
) -> None:
    graph_app.FAILING.add("bad")
    async with WorkerRun(orc) as worker:
        planner = await orc.submit("planner", {"topics": ["good", "bad"], "child_budget": 500})
        await worker.until_finished(planner)
        job = await orc.get_job(planner)
        assert job.status is Status.COMPLETED and job.result["report"] == ["good", "FAILED"]
        # Its usage adds up its children's, the failed one's too.
        for n, child in enumerate(await spawned(db, planner), 1):
            await orc.stores.usage.record(CallUsage(
                job_id=child, call_id="c1", attempt=1, tenant_id=None, agent_id=None,
                job_type="node", model="m", input_tokens=10 * n, output_tokens=n,
                cache_read_tokens=0, cache_creation_tokens=0,
            ))  # fmt: skip
        usage = await orc.job_usage(planner)
        assert (usage.descendants, usage.descendant_calls) == (2, 2)
        children = await spawned(db, planner)
        assert [(await orc.job_usage(c)).token_budget for c in children] == [500, 500]
        assert usage.descendants_total.total_tokens == 11 + 22
        # A planner waiting for slow children is cancelled: its children are cancelled too.
        waiting = await orc.submit("planner", {"topics": ["s1", "s2"], "child_sleep": 60})

        async def blocked() -> bool:
            return (await orc.get_job(waiting)).status is Status.BLOCKED

        await wait_for(blocked, timeout=15)
        await orc.cancel(waiting, reason="not needed")
        children = await spawned(db, waiting)
        statuses = [(await orc.get_job(c)).status for c in children]
    assert statuses == [Status.CANCELLED] * 2
    cancelled = [e for e in await orc.job_events(children[0]) if e.kind == "job.cancelled"]
    assert cancelled[0].payload == {
        "reason": f"its parent was cancelled: {waiting}", "by": "dependencies",
    }  # fmt: skip


async def _waiting_on_a_lock(db: psycopg.AsyncConnection[Any], conn: Any) -> bool:
    """Whether ``conn``'s server process waits for a lock (the race is on, not just begun)."""
    return await _a_lock_waited_for(db, conn.info.backend_pid)


async def _a_lock_waited_for(db: psycopg.AsyncConnection[Any], pid: int | None = None) -> bool:
    cur = await db.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock' AND (%s::int IS NULL OR pid = %s::int)",
        (pid, pid),
    )
    return bool((await cur.fetchone() or (0,))[0])
