"""Every hot statement's cost is independent of the job table's size (docs/operations.md,
"Hot paths").

A database is planted with finished jobs and 3,000 unfinished ones, with their events,
dispatches, dead letters and LLM usage (bench/history.py): 20,000 finished, where a plan that
reads a table whole still looks cheap to the planner (the claim's hash join over orc_jobs of
migration 0033 was chosen at that size, not at 200,000), and 200,000. The hot paths then run
through the stores, as the worker, the API, the dashboard and the maintenance services call
them: submit, the fetch with its claim and the flow gate, the claim left for later, heartbeat,
completion, retry, hand-back, cancel, the flow pump and resume, every maintenance service's
batch (zombie sweep, safety net, approval expiry, checkpoint prune, retention, rollups), and the
listings. Their connections have ``auto_explain`` send the plan of every statement they run
to the client, nested ones included: the statements inside the orc_* functions and their
triggers. A sequential scan of a table holding 10,000 rows or more fails the test, naming the
statement.

Each path runs twice: with the plans PostgreSQL chooses, and forced to generic plans (those a
prepared statement, or a plpgsql function's statement, may settle on after five calls, planned
without the parameters' values: a parameter cannot match a partial index's predicate, nor say
that a batch is small). The listings run only with the plans PostgreSQL chooses: their filters
are optional, so no one plan serves them all, and PostgreSQL keeps planning them with their
values, since their generic plan costs more than those.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from bench.history import fill_history
from checkpoints import CheckpointStore
from orchestrator import JobContext, Orchestrator, Status
from orchestrator.domain.dead_letters import BULK_MAX, OPEN
from orchestrator.domain.policy import Layer
from orchestrator.domain.rollups import Window
from orchestrator.services.approvals import ApprovalDecisions
from orchestrator.services.maintenance import NAMES, Maintenance
from orchestrator.storage.database import scratch_database
from orchestrator.storage.dispatches import Completion, Dispatch
from orchestrator.storage.jobs import JobFilters
from orchestrator.storage.migrate import migrate
from orchestrator.storage.queries import QUERIES
from orchestrator.storage.stores import Stores
from orchestrator.storage.usage import UsageFilters
from tests.support import log_guard
from tests.support.harness import config_with, settings_for_tests

UNFINISHED = 3_000
#: A table this large is job-sized: reading it whole is a cost that grows with the history.
JOB_SIZED = 10_000
LIMITS = """
[limits.plan_rate]
key = "{job_type}"
requests = 1000
interval_seconds = 60

[limits.plan_slots]
key = "slots:{payload.pool}"
concurrency = 1

[job_types.plan_rated]
limit = "plan_rate"

[job_types.plan_slotted]
limit = "plan_slots"
"""
BUSY = {"ts": "2026-01-01T00:00:00Z", "message": "busy", "code": "HTTP_429",
        "classification": "TRANSIENT_APP", "attempt": 1, "terminal": False}  # fmt: skip
AUTO_EXPLAIN = {
    # NOTICE, not LOG: the plans go to this client only, not into the server's log as well
    # (which they grew by a gigabyte a run).
    "auto_explain.log_level": "notice",
    "auto_explain.log_min_duration": "0",
    "auto_explain.log_nested_statements": "on",
    "auto_explain.log_format": "json",
    "auto_explain.log_analyze": "on",
    "auto_explain.log_timing": "off",
    "auto_explain.log_settings": "on",  # the planner's settings a statement ran with
    "client_min_messages": "log",
}


@dataclass(frozen=True)
class Heard:
    """One statement's plan: what ran it, its text, its plan, and the planner settings it ran
    with where they differ from the server's defaults (a function's own ``SET`` included)."""

    path: str
    text: str
    plan: dict[str, Any]
    settings: dict[str, str]


@dataclass
class Plans:
    """The plans the server sent; ``mode``: the plan cache mode they were made in; ``path``:
    what ran them."""

    mode: str
    path: str = ""
    seen: list[Heard] = field(default_factory=list)

    def hear(self, diag: psycopg.errors.Diagnostic) -> None:
        message = diag.message_primary or ""
        if "plan:" in message:
            explained = json.loads(message.split("plan:", 1)[1])
            self.seen.append(
                Heard(self.path, explained["Query Text"], explained["Plan"],
                      explained.get("Settings", {}))
            )  # fmt: skip


def scans(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", ()):
        yield from scans(child)


def outline(node: dict[str, Any], depth: int = 0) -> str:
    """The plan's nodes, one a line, for the failure's message."""
    where = " ".join(node.get(k, "") for k in ("Relation Name", "Index Name", "Subplan Name"))
    lines = [f"{'  ' * depth}{node['Node Type']} {where}".rstrip()]
    lines += [outline(child, depth + 1) for child in node.get("Plans", ())]
    return "\n".join(lines)


def sequential_scans(plans: Plans, sized: set[str]) -> list[str]:
    found = []
    for heard in plans.seen:
        for node in scans(heard.plan):
            ran = node.get("Actual Loops", 1) > 0
            if ran and node["Node Type"] == "Seq Scan" and node.get("Relation Name") in sized:
                found.append(
                    f"{heard.path}: Seq Scan on {node['Relation Name']} in\n"
                    f"{heard.text.strip()}\nplan:\n{outline(heard.plan)}"
                )
    return found


#: 200,000 jobs take 15 s or more of both cores to plant: in the slow run, whose tests take
#: turns, so that the burst delays no timing-bound test of another process.
SIZES = [20_000, pytest.param(200_000, marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=SIZES, ids=["20k", "200k"])
def planted(request: pytest.FixtureRequest) -> Iterator[str]:
    """A database of its own, migrated and planted with a fleet's history of this size."""

    async def plant(dsn: str) -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await migrate(conn)
            await fill_history(conn, request.param, live=UNFINISHED, spacing=1e6 / request.param)

    with scratch_database(settings_for_tests(), "orc_plans") as dsn:
        asyncio.run(plant(dsn))
        yield dsn


async def require_auto_explain(dsn: str) -> None:
    """Skip (fail under CI=true) where the test's user may not load auto_explain: asked once
    here, since a pool's configure callback cannot skip the test."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        try:
            await conn.execute("LOAD 'auto_explain'")
        except psycopg.errors.InsufficientPrivilege:
            why = "loading auto_explain needs a superuser on DATABASE_URL's server"
            if os.environ.get("CI") == "true":
                pytest.fail(f"{why}; CI=true requires it")
            pytest.skip(why)


async def job_sized(dsn: str) -> set[str]:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute(
            "SELECT relname FROM pg_class WHERE relkind = 'r' AND reltuples >= %s", (JOB_SIZED,)
        )
        return {row[0] for row in await cur.fetchall()}


@pytest.fixture
async def explained(
    planted: str, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[Stores, Plans]]:
    """Stores on connections whose every plan is heard, in the plan cache mode of the test's
    parameter."""
    await require_auto_explain(planted)
    plans = Plans(request.param)
    async with heard(planted, plans, max_size=4) as pool:
        yield Stores.on(pool), plans


@contextlib.asynccontextmanager
async def heard(
    dsn: str, plans: Plans, *, max_size: int
) -> AsyncIterator[AsyncConnectionPool[Any]]:
    """A pool whose connections send every plan they run to ``plans``, made in its mode."""

    async def configure(conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.set_autocommit(True)
        await conn.execute("LOAD 'auto_explain'")
        for name, value in {**AUTO_EXPLAIN, "plan_cache_mode": plans.mode}.items():
            await conn.execute(f"SET {name} = {value}")
        conn.add_notice_handler(plans.hear)

    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn, min_size=1, max_size=max_size, open=False, configure=configure,
        kwargs={"row_factory": dict_row},
    )  # fmt: skip
    await pool.open(wait=True)
    try:
        yield pool
    finally:
        await pool.close()


def planner(planted: str) -> Orchestrator:
    orc = Orchestrator(settings=settings_for_tests(retry_config=config_with(LIMITS)), dsn=planted)

    for name in ("noop", "plan_rated", "plan_slotted"):

        @orc.job_type(name)
        async def run(ctx: JobContext, payload: dict[str, Any]) -> None:
            return None

    return orc


async def submit(orc: Orchestrator, stores: Stores, plans: Plans) -> list[uuid.UUID]:
    plans.path = "submit"
    specs = [
        *({"job_type": "noop", "payload": {"i": i}} for i in range(6)),
        {"job_type": "noop", "payload": {}, "job_key": f"plans-{uuid.uuid4()}"},
        {"job_type": "noop", "payload": {}, "tenant_id": "tenant-1"},
        *({"job_type": "plan_rated", "payload": {}} for _ in range(2)),
        *({"job_type": "plan_slotted", "payload": {"pool": "p"}} for _ in range(3)),
    ]
    async with stores.queries.connection() as conn:
        return await orc.submit_many(specs, connection=conn)


async def fetch(stores: Stores, plans: Plans, worker_id: int) -> list[Dispatch]:
    plans.path = "fetch and claim (with the flow gate)"
    async with stores.queries.connection() as conn:
        return await stores.dispatches.fetch(
            limit=20, queues=None, worker_id=worker_id, worker="plans", conn=conn
        )


async def run_attempts(stores: Stores, plans: Plans, dispatches: list[Dispatch]) -> list[uuid.UUID]:
    """Each way an attempt ends; returns the two left RUNNING, to become zombies."""
    claimed = [(d, d.claim) for d in dispatches if d.claim is not None]
    assert len(claimed) >= 6, "the planted history hid the submitted jobs from the fetch"
    plans.path = "heartbeat"
    await stores.liveness.heartbeat(
        {c.lease_token: c.id for _, c in claimed}, zombie_threshold=300, expiry_grace=60
    )
    (retried, retry_claim), (handed, hand_claim), (_, lost), (_, spent), *done = claimed
    plans.path = "retry"
    await stores.dispatches.retry(
        retry_claim, retried.id, layer=Layer.APP,
        delay_ms=3_600_000,
        error=BUSY, failed_event={"error": BUSY}, retry_event={},
    )  # fmt: skip
    plans.path = "hand-back"
    await stores.dispatches.hand_back(hand_claim, handed.id, {"reason": "drain"})
    plans.path = "completion"
    async with stores.queries.transaction() as conn:
        await stores.dispatches.complete(
            [Completion(c, {"ok": True}, 0.0, d.id) for d, c in done], conn
        )
    return [lost.id, spent.id]


async def make_zombies(dsn: str, lost: uuid.UUID, spent: uuid.UUID) -> None:
    """Both stop heartbeating; ``spent`` has no budget left, so the sweep fails it for good
    (a dead letter: the terminal failure's statements)."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            "UPDATE orc_jobs SET heartbeat_at = now() - interval '1 hour' WHERE id = ANY(%s)",
            ([lost, spent],),
        )
        await conn.execute(
            "UPDATE orc_jobs SET max_attempts = attempt, max_retries = retry_count WHERE id = %s",
            (spent,),
        )


async def operate(stores: Stores, plans: Plans, job_ids: list[uuid.UUID]) -> None:
    plans.path = "cancel"
    await stores.jobs.cancel(job_ids[-1], reason="plans", by="test")
    plans.path = "flow backstop"
    await stores.flow.backstop()
    plans.path = "flow pause"
    await stores.flow.pause("slots:p", seconds=60, reason="plans", by="test")
    plans.path = "flow reschedule"
    await stores.flow.reschedule(["slots:p"])
    plans.path = "flow resume"
    await stores.flow.resume("slots:p")
    plans.path = "soonest due"
    await stores.liveness.soonest_due(lookback=5)


async def maintain(orc: Orchestrator, stores: Stores, plans: Plans) -> None:
    decisions = ApprovalDecisions(stores=stores, failures=orc.failures)
    maintenance = Maintenance.build(
        stores=stores, checkpoints=CheckpointStore(stores.queries), failures=orc.failures,
        decisions=decisions, config=orc.live_config, settings=orc.settings,
        on_run=lambda name, did: None,
    )  # fmt: skip
    for name in NAMES:
        plans.path = f"maintenance: {name}"
        await maintenance.run(name)


async def read(stores: Stores, plans: Plans, job_id: uuid.UUID) -> None:
    now = datetime.now(UTC)
    tenants = frozenset({"tenant-1", "tenant-2"})
    reads: dict[str, Callable[[], Awaitable[Any]]] = {
        "job": lambda: stores.jobs.get(job_id),
        "job history": lambda: stores.jobs.history(job_id),
        "job page of a type": lambda: stores.jobs.page(
            JobFilters(job_type="llm_generate"), before=None, limit=50
        ),
        "job page": lambda: stores.jobs.page(JobFilters(), before=None, limit=50),
        "job page, next": lambda: stores.jobs.page(JobFilters(), before=job_id, limit=50),
        "job page of tenants": lambda: stores.jobs.page(
            JobFilters(tenants=tenants), before=None, limit=50
        ),
        "dead letters": lambda: stores.dead_letters.list_letters(limit=50),
        "dead letters of tenants": lambda: stores.dead_letters.list_letters(tenants=tenants),
        "open dead letters, filtered": lambda: stores.dead_letters.list_letters(
            states=OPEN, job_type="llm_generate", error="timeout", limit=BULK_MAX + 1
        ),
        "open dead letters of tenants": lambda: stores.dead_letters.list_letters(
            states=OPEN, tenants=tenants, limit=BULK_MAX + 1
        ),
        "dead letters by id": lambda: stores.dead_letters.find([job_id], tenants=tenants),
        "fleet": lambda: stores.fleet.read(zombie_threshold=300),
        "overview counts": lambda: stores.fleet.unfinished(zombie_threshold=300),
        "overview counts of tenants": lambda: stores.fleet.unfinished(
            zombie_threshold=300, tenants=tenants
        ),
        "queues": lambda: stores.fleet.queue_stats(),
        "queues of tenants": lambda: stores.fleet.queue_stats(tenants=tenants),
        "usage": lambda: stores.usage.totals(
            ("model",), UsageFilters(since=now - timedelta(hours=1)), limit=50
        ),
        "usage of a job": lambda: stores.usage.of_job(job_id),
        "stats": lambda: stores.rollups.job_stats(
            Window(since=now - timedelta(hours=1), until=now, step=60, period=60, by=()),
            tenants=None,
        ),
        "holders": lambda: stores.dashboard.holders(tenants=None),
        "summary: processes": lambda: stores.dashboard.processes(seconds=30),
        "summary: unserved": lambda: stores.applications.unserved(seconds=30, tenants=tenants),
        "summary: held keys": lambda: stores.dashboard.held_keys(tenants=None),
        "summary: held keys of tenants": lambda: stores.dashboard.held_keys(tenants=tenants),
        "summary: letters": lambda: stores.dashboard.letters_to_review(tenants=tenants),
        "summary: approvals": lambda: stores.dashboard.approvals_waiting(tenants=tenants),
        "activity": lambda: stores.dashboard.activity(since=now - timedelta(hours=1), tenants=None),
        "activity of tenants": lambda: stores.dashboard.activity(
            since=now - timedelta(hours=1), tenants=tenants
        ),
    }
    for path, reading in reads.items():
        plans.path = path
        await reading()


@log_guard.fails_jobs("ZOMBIE")  # the zombie whose budget is spent
@pytest.mark.parametrize(
    "explained", ["auto", "force_generic_plan"], indirect=True, ids=["chosen", "generic"]
)
async def test_no_hot_statement_reads_a_job_sized_table_whole(
    planted: str, explained: tuple[Stores, Plans]
) -> None:
    stores, plans = explained
    sized = await job_sized(planted)
    assert {"orc_jobs", "orc_job_events", "procrastinate_jobs"} <= sized
    orc = planner(planted)
    async with orc:
        await stores.flow.apply(orc.live_config, orc.application)
        job_ids = await submit(orc, stores, plans)
        worker_id = await stores.dispatches.register_worker(prune_after=60)
        dispatches = await fetch(stores, plans, worker_id)
        lost, spent = await run_attempts(stores, plans, dispatches)
        await operate(stores, plans, job_ids)
        await make_zombies(planted, lost, spent)
        await maintain(orc, stores, plans)
        assert (await orc.get_job(lost)).status == "RETRY"
        assert (await orc.get_job(spent)).status == "FAILED"
        if plans.mode == "auto":
            await read(stores, plans, job_ids[0])
    paths = {heard.path for heard in plans.seen}
    assert {"submit", "fetch and claim (with the flow gate)", "completion"} <= paths
    found = sequential_scans(plans, sized)
    assert not found, "\n\n".join(found)
    per_job = {"submit", "fetch and claim (with the flow gate)", "heartbeat", "retry",
               "hand-back", "completion"}  # fmt: skip
    jitted = compiled(plans, await jit_threshold(planted), per_job)
    assert not jitted, "\n\n".join(jitted)


async def jit_threshold(dsn: str) -> float:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute("SELECT current_setting('jit_above_cost')::float8")
        row = await cur.fetchone()
        assert row is not None
        return float(row[0])


def compiled(plans: Plans, threshold: float, paths: set[str]) -> list[str]:
    """The statements of ``paths`` that a server built with LLVM would JIT-compile: costed at
    ``threshold`` or more, and not run with ``jit = off``. Compiling takes milliseconds, more
    than such a statement's work, on every call (checked whether or not this server has JIT)."""
    return [
        f"{heard.path}: costed {heard.plan['Total Cost']:,.0f} (jit_above_cost {threshold:,.0f})"
        f", run with {heard.settings or 'the defaults'}, in\n{heard.text.strip()}"
        for heard in plans.seen
        if heard.path in paths
        and heard.plan["Total Cost"] >= threshold
        and heard.settings.get("jit") != "off"
    ]


def test_every_status_written_out_in_a_query_is_one_of_the_state_machine() -> None:
    """The statuses a read writes out, to match a partial index, name states that exist."""
    text = "\n".join(QUERIES.values())
    named = set(re.findall(r"\bstatus (?:=|<>) '([A-Z_]+)'", text))
    for listed in re.findall(r"\bstatus (?:NOT )?IN \(([^)]*)\)", text):
        named |= set(re.findall(r"'([A-Z_]+)'", listed))
    assert {"RETRY", "PENDING", "RUNNING"} <= named
    assert named <= {s.value for s in Status}


#: A queue's statistics are always stale: analyzed while this many jobs waited, among this
#: many finished...
ANALYZED_AT = 5
FINISHED = 20_000
#: ... and read while this many wait (a backlog, as a soak's submitter keeps).
BACKLOG = 3_000


@pytest.mark.parametrize("mode", ["auto", "force_custom_plan"], ids=["chosen", "custom-asked-for"])
async def test_the_fetch_is_planned_once_and_walks_the_queue_whatever_its_statistics_say(
    mode: str,
) -> None:
    """Analyzed while nearly empty, then filled (autovacuum off, so the statistics stay as they
    were): the fetch's statement still walks the queue's index from its head and stops at the
    first dispatch it may take, and it is planned once per connection (a generic plan, its
    parameters unknown: `$1`), whatever plan cache mode the session asks for. Procrastinate's
    own fetch was planned again on every call, which cost more than running it, and, estimating
    a handful of waiting dispatches, read every one of them and sorted them (docs/operations.md,
    "Hot paths")."""
    with scratch_database(settings_for_tests(), "orc_plans_stale") as dsn:
        await require_auto_explain(dsn)
        orc = planner(dsn)
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await migrate(conn)
            for table in ("procrastinate_jobs", "orc_jobs"):
                await conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
            await fill_history(conn, FINISHED, live=ANALYZED_AT)  # and ANALYZE
        async with orc:
            for _ in range(BACKLOG // 1000):
                await orc.submit_many({"job_type": "noop", "payload": {}} for _ in range(1000))
        plans = Plans(mode, path="fetch")
        async with heard(dsn, plans, max_size=1) as pool:
            stores = Stores.on(pool)
            worker_id = await stores.dispatches.register_worker(prune_after=60)
            for _ in range(3):  # past the fifth call of each statement: a plan settled on
                async with stores.queries.connection() as conn:
                    fetched = await stores.dispatches.fetch(
                        limit=5, queues=None, worker_id=worker_id, worker="plans", conn=conn
                    )
                assert len(fetched) == 5
    read_whole = [
        f"{node['Node Type']} on procrastinate_jobs gave {node['Actual Rows']} rows in\n"
        f"{heard.text.strip()}\nplan:\n{outline(heard.plan)}"
        for heard in plans.seen
        for node in scans(heard.plan)
        if node.get("Relation Name") == "procrastinate_jobs" and node.get("Actual Rows", 0) > 100
    ]
    assert not read_whole, "\n\n".join(read_whole)
    takes = [heard.plan for heard in plans.seen if "WITH candidate AS" in heard.text]
    assert len(takes) == 15
    replanned = [outline(plan) for plan in takes[1:] if "$1" not in json.dumps(plan)]
    assert not replanned, (
        f"{len(replanned)} of 14 fetches planned with their values:\n" + (replanned[0])
    )


#: Waiting in a queue no worker of the test takes, behind the jobs it fetches: enough for the
#: fetch's generic plan, costed as a walk of every waiting dispatch, to cross jit_above_cost.
QUEUED = 30_000


async def test_the_fetch_is_never_jit_compiled_however_long_the_queue() -> None:
    """With 30,000 dispatches waiting, and the statistics saying so, the fetch's statement is
    costed above jit_above_cost (its generic plan cannot count on LIMIT 1 stopping at the
    queue's head), yet it runs with jit off: compiled, each fetch took 7-10 ms on PostgreSQL 15
    with LLVM, and a 20,000-job drain ran at 85 jobs/s (1,515 with 5,000 queued)."""
    with scratch_database(settings_for_tests(), "orc_plans_jit") as dsn:
        await require_auto_explain(dsn)
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await migrate(conn)
            await conn.execute(
                "INSERT INTO procrastinate_jobs (queue_name, task_name, priority, args, status)"
                " SELECT 'elsewhere', 'elsewhere', -1, '{}', 'todo'"
                "   FROM generate_series(1, %s)",
                (QUEUED,),
            )
            await conn.execute("ANALYZE procrastinate_jobs")
        orc = planner(dsn)
        async with orc:
            await orc.submit_many({"job_type": "noop", "payload": {}} for _ in range(12))
        plans = Plans("auto", path="fetch")
        async with heard(dsn, plans, max_size=1) as pool:
            stores = Stores.on(pool)
            worker_id = await stores.dispatches.register_worker(prune_after=60)
            for _ in range(2):  # the fifth call of the statement and after: its generic plan
                async with stores.queries.connection() as conn:
                    fetched = await stores.dispatches.fetch(
                        limit=6, queues=None, worker_id=worker_id, worker="plans", conn=conn
                    )
                assert [d.claim is not None for d in fetched] == [True] * 6
        threshold = await jit_threshold(dsn)
    takes = [heard for heard in plans.seen if "WITH candidate AS" in heard.text]
    assert len(takes) == 12
    assert max(heard.plan["Total Cost"] for heard in takes) >= threshold, "the premise"
    jitted = compiled(plans, threshold, {"fetch"})
    assert not jitted, "\n\n".join(jitted)
