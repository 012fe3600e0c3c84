"""A call's admission has one production home, SQL (``orc_flow_admit_call_v1``); the Python rules
(orchestrator.domain.flow_window's ``admit_call``, flow_share's ``cap``, flow_learned's
``allowances``) are its model. Whatever the sequence of claims (a reservation), calls (a job's
first takes its claim's reservation), waiters handed room, pauses, learned limits and clock
advances, under a limit of requests and units with or without a share's cap, both give every
call the same answer: go (at once, or after the same wait in place, its reuse and units) or
park (the same blocked reason, the same instant, whether it held a reservation).

The database's clock is steered: before each step every stored time moves by what the model's
clock moved less what the real one did, and a spend the statement placed is set where the model
placed it; a step never lands near an instant where a spend slides out or a pause ends, which a
few milliseconds of real time would tip either way."""

from __future__ import annotations

import ast
import math
from collections.abc import Generator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, cast
from uuid import UUID, uuid4

import psycopg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from orchestrator.domain.flow_window import (
    WAIT_IN_PLACE_SECONDS,
    Admit,
    Allowance,
    CallWindow,
    Room,
    ShareWindow,
    Spend,
    admit_call,
)
from orchestrator.storage.applications import ApplicationStore
from orchestrator.storage.database import create_pool
from orchestrator.storage.flow import FlowStore, Leased
from orchestrator.storage.runner import Queries
from tests.support.flow_learned_model import Allowances, allowances

KEY = "model-key"
SHARES = ("a", "b", "a", "")  # each job's share (tenant)
#: How close (seconds) to an instant the window or a pause changes no step may land: real time
#: passes between the step's start and the statement's clock.
MARGIN = 0.08
#: How far apart the two answers' instants may be.
TOLERANCE = 0.05


@dataclass(frozen=True)
class Limit:
    requests: int | None
    units: int | None
    interval: float
    tenant_share: float | None
    learn: bool


@dataclass
class Model:
    """The key as the Python model keeps it, on a clock of its own (seconds)."""

    limit: Limit
    now: float = 0.0
    spends: list[dict[str, Any]] = field(default_factory=list)  # at, units, job, share
    waiters: list[tuple[str, int]] = field(default_factory=list)  # (share, cost), handed room
    learned: Allowances = field(default_factory=lambda: Allowances(None, None))
    paused_until: float | None = None

    def allowance(self) -> Allowance:
        configured = Allowances(self.limit.requests, self.limit.units)
        effect = allowances(configured, self.learned, learn=self.limit.learn)
        return Allowance(effect.requests, effect.units, self.limit.interval)

    def live(self) -> list[dict[str, Any]]:
        return [s for s in self.spends if s["at"] > self.now - self.limit.interval]

    def reservation(self, job: int) -> dict[str, Any] | None:
        """What a first call takes: the job's latest spend in the window (none of its calls'
        is reconciled here), its claim's unless that slid out."""
        mine = [s for s in self.live() if s["job"] == job]
        return mine[-1] if mine else None

    def call(self, job: int, units: int, *, first: bool) -> Admit | Room | None:
        """The model's verdict (None: nothing limits the call)."""
        allowance = self.allowance()
        if allowance.requests is None and allowance.units is None:
            return None
        unused = self.reservation(job) if first else None
        window = [s for s in self.live() if s is not unused]
        share = SHARES[job]

        def spends(of: list[dict[str, Any]]) -> tuple[Spend, ...]:
            return tuple(Spend(s["at"] - self.now, 1, s["units"]) for s in of)

        mine = [(s, c) for s, c in self.waiters if s == share]
        paused = None if self.paused_until is None else self.paused_until - self.now
        verdict = admit_call(
            CallWindow(
                allowance=allowance,
                spends=spends(window),
                held=len(self.waiters),
                held_cost=sum(c for _, c in self.waiters),
                paused_for=paused if paused is not None and paused > 0 else None,
                reserved=None if unused is None else unused["units"],
                share=None if self.limit.tenant_share is None else ShareWindow(
                    tenant_share=self.limit.tenant_share,
                    spends=spends([s for s in window if s["share"] == share]),
                    held=len(mine),
                    held_cost=sum(c for _, c in mine),
                ),
            ),
            units,
            first=first,
        )  # fmt: skip
        if isinstance(verdict, Admit):
            at = self.now + verdict.after
            if verdict.reuse and unused is not None:
                unused.update(at=at, units=verdict.units)
            else:
                self.spends.append({"at": at, "units": verdict.units, "job": job, "share": share})
        return verdict

    def instants(self) -> list[float]:
        """The instants at which the window or a pause changes a call's answer."""
        ends = [s["at"] + self.limit.interval for s in self.spends]
        if self.paused_until is not None:
            ends.append(self.paused_until)
        return [t - w for t in ends for w in (0.0, WAIT_IN_PLACE_SECONDS)]

    def advance(self, seconds: float) -> None:
        """The clock moved on by about ``seconds``: a little more, to land clear of every
        instant the answers change at."""
        now = self.now + seconds
        while any(now - MARGIN / 4 <= t <= now + MARGIN for t in self.instants()):
            now += MARGIN / 2
        self.now = now


class Database:
    """The key in the database, its clock steered to the model's."""

    def __init__(self, db: psycopg.AsyncConnection[Any], model: Model) -> None:
        self.db, self.model = db, model
        self.anchor: datetime | None = None  # the database's time of the model's `anchored`
        self.anchored = 0.0
        self.jobs: list[UUID] = []

    async def setup(self) -> None:
        limit = self.model.limit
        await self.db.execute(
            "INSERT INTO orc_flow_limits (name, requests, units, interval_seconds, tenant_share,"
            " learn, key_template) VALUES ('model', %s, %s, %s, %s, %s, 'model-key')",
            (limit.requests, limit.units, limit.interval, limit.tenant_share, limit.learn),
        )
        await self.db.execute(
            "INSERT INTO orc_flow_keys (key, limit_name, task_prefix) VALUES (%s, 'model', 'm')",
            (KEY,),
        )
        for share in SHARES:
            self.jobs.append(await self.job(share, running=True))
        await self.sync()

    async def job(self, share: str, *, running: bool) -> UUID:
        job_id = uuid4()
        await self.db.execute(
            "INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts,"
            " max_retries, trace_id, lease_token, flow_key, flow_share)"
            " VALUES (%s, 'model', %s, '{}', 'model', 3, 3, 't', %s, %s, %s)",
            (job_id, "RUNNING" if running else "PENDING", uuid4() if running else None, KEY,
             share or None),
        )  # fmt: skip
        return job_id

    async def sync(self) -> None:
        """Every stored time moved by what the model's clock moved since the last step less
        what the database's did: the database's now is the model's."""
        cur = await self.db.execute("SELECT clock_timestamp()")
        [(now,)] = await cur.fetchall()
        if self.anchor is not None:
            lag = (now - self.anchor).total_seconds() - (self.model.now - self.anchored)
            await self.db.execute(
                "UPDATE orc_flow_spends SET at = at + make_interval(secs => %s)", (lag,)
            )
            await self.db.execute(
                "UPDATE orc_flow_keys SET paused_until = paused_until + make_interval(secs => %s)",
                (lag,),
            )
        self.anchor, self.anchored = now, self.model.now

    async def claim(self, job: int, cost: int) -> None:
        units = cost if self.model.limit.units is None else min(cost, self.model.limit.units)
        await self.db.execute(
            "INSERT INTO orc_flow_spends (key, job_id, requests, units, share, at)"
            " VALUES (%s, %s, 1, %s, %s, %s)",
            (KEY, self.jobs[job], units, SHARES[job], self.anchor),
        )
        self.model.spends.append(
            {"at": self.model.now, "units": units, "job": job, "share": SHARES[job]}
        )

    async def call(self, job: int, units: int, *, first: bool) -> dict[str, Any]:
        cur = await self.db.execute(
            "SELECT key, go, units, reuse, after, blocked, at, reserved, spend"
            "  FROM orc_flow_admit_call_v1(%s, NULL, %s, %s, NULL, NULL, NULL)",
            (self.jobs[job], units, first),
        )
        [row] = await cur.fetchall()
        answer = dict(zip(("key", "go", "units", "reuse", "after", "blocked", "at",
                           "reserved", "spend"), row, strict=True))  # fmt: skip
        if answer["spend"] is not None:  # placed where the model placed it
            await self.db.execute(
                "UPDATE orc_flow_spends SET at = %s::timestamptz + make_interval(secs => %s)"
                " WHERE id = %s",
                (self.anchor, answer["after"], answer["spend"]),
            )
        return answer

    async def waiter(self, share: str, cost: int) -> None:
        job_id = await self.job(share, running=False)
        await self.db.execute(
            "INSERT INTO orc_flow_waiters (job_id, key, share, cost, blocked_on, dispatched_at)"
            " VALUES (%s, %s, %s, %s, 'requests', now() - interval '1 hour')",
            (job_id, KEY, share, cost),
        )
        self.model.waiters.append((share, cost))

    async def pause(self, seconds: float) -> None:
        await self.db.execute(
            "UPDATE orc_flow_keys SET paused_until = %s::timestamptz + make_interval(secs => %s),"
            " pause_reason = 'a 429', paused_by = 'provider' WHERE key = %s",
            (self.anchor, seconds, KEY),
        )
        self.model.paused_until = self.model.now + seconds

    async def learn(self, requests: int | None, units: int | None) -> None:
        await self.db.execute(
            "UPDATE orc_flow_keys SET learned_requests = %s, learned_units = %s WHERE key = %s",
            (requests, units, KEY),
        )
        self.model.learned = Allowances(requests, units)


def same(db: dict[str, Any], model: Admit | Room | None) -> None:
    """The database's answer is the model's."""
    if model is None:
        assert (db["key"], db["go"]) == (None, True), db
        return
    assert db["key"] == KEY, db
    if isinstance(model, Admit):
        assert db["go"], f"{db} {model}"
        assert (db["units"], db["reuse"]) == (model.units, model.reuse), (db, model)
        assert db["after"] == pytest.approx(model.after, abs=TOLERANCE), (db, model)
        return
    assert not db["go"], (db, model)
    assert (db["blocked"], db["reserved"]) == (model.blocked, model.reserved), (db, model)
    if math.isinf(model.at):
        assert math.isinf(db["at"]), (db, model)
    else:
        assert db["at"] == pytest.approx(model.at, abs=TOLERANCE), (db, model)


limits = st.builds(
    Limit,
    requests=st.one_of(st.none(), st.integers(1, 5)),
    units=st.one_of(st.none(), st.integers(1, 60)),
    interval=st.sampled_from([0.5, 1.0, 2.0]),
    tenant_share=st.sampled_from([None, 0.34, 0.5]),
    learn=st.booleans(),
).filter(lambda limit: limit.requests is not None or limit.units is not None)

JOB = st.integers(0, len(SHARES) - 1)
steps = st.lists(
    st.one_of(
        st.tuples(st.just("claim"), JOB, st.integers(0, 40)),
        st.tuples(st.just("call"), JOB, st.integers(0, 40)),
        st.tuples(st.just("call"), JOB, st.integers(0, 40)),
        st.tuples(st.just("advance"), st.integers(0, 25), st.just(0)),
        st.tuples(st.just("pause"), st.integers(5, 25), st.just(0)),
        st.tuples(st.just("learn"), st.one_of(st.none(), st.integers(1, 5)),
                  st.one_of(st.none(), st.integers(1, 60))),
        st.tuples(st.just("waiter"), JOB, st.integers(1, 30)),
    ),
    max_size=25,
)  # fmt: skip


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(limits, steps)
@example(  # a share's cap binds before the window's: parked on "share"
    Limit(requests=4, units=None, interval=2.0, tenant_share=0.5, learn=False),
    [("call", 0, 1), ("call", 2, 1), ("call", 0, 1), ("call", 1, 1)],
)
@example(  # the first call takes its claim's reservation, a learned limit lowers the window
    Limit(requests=3, units=50, interval=1.0, tenant_share=None, learn=True),
    [("claim", 0, 30), ("learn", 2, 40), ("call", 1, 5), ("call", 0, 10), ("call", 2, 5),
     ("advance", 8, 0), ("call", 2, 5)],
)  # fmt: skip
@example(  # a room a moment off is waited for in place; a pause parks past it
    Limit(requests=1, units=None, interval=0.5, tenant_share=None, learn=False),
    [("call", 0, 1), ("advance", 3, 0), ("call", 1, 1), ("pause", 10, 0), ("call", 2, 1)],
)
async def test_the_sql_admission_answers_every_call_as_its_model_does(
    db: psycopg.AsyncConnection[Any], limit: Limit, steps: list[tuple[str, Any, Any]]
) -> None:
    """Each step's answer from orc_flow_admit_call_v1 is the model's (go and its wait in place,
    its reuse and units; park and its reason, instant and reservation)."""
    async with db.transaction(force_rollback=True):
        model = Model(limit)
        key = Database(db, model)
        await key.setup()
        first: set[int] = set()
        for kind, a, b in steps:
            if kind == "advance":
                model.advance(a / 10)
            await key.sync()
            if kind == "claim" and a not in first:
                await key.claim(a, b)
                first.add(a)
            elif kind == "call":
                answer = await key.call(a, b, first=a in first)
                verdict = model.call(a, b, first=a in first)
                same(answer, verdict)
                if isinstance(verdict, Admit):
                    first.discard(a)
            elif kind == "pause":
                await key.pause(a / 10)
            elif kind == "learn":
                await key.learn(a, b)
            elif kind == "waiter":
                await key.waiter(SHARES[a], b)


async def test_the_wait_in_place_is_the_model_s(db: psycopg.AsyncConnection[Any]) -> None:
    """The longest wait a call waits in place is one number, the model's and the SQL's."""
    cur = await db.execute("SELECT orc_flow_wait_in_place_v1()")
    assert await cur.fetchone() == (WAIT_IN_PLACE_SECONDS,)


#: The model's rules, by module: no production module imports them (each decides in SQL).
MODEL = {
    "orchestrator.domain.flow_window": {"admit_call", "room", "waits_in_place"},
    "orchestrator.domain.flow_share": {"cap"},
    "orchestrator.domain.flow_learned": {"allowances", "in_effect"},
}


def test_no_production_module_decides_a_call_with_the_model() -> None:
    """The model's rules are imported by the tests and the model alone: production admits in
    SQL."""
    root = Path(__file__).parent.parent / "orchestrator"
    model = {root / "domain" / f"{name.rsplit('.', 1)[1]}.py" for name in MODEL}
    found = []
    for path in set(root.rglob("*.py")) - model:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in MODEL:
                names = {alias.name for alias in node.names} & MODEL[node.module]
                found += [f"{path.relative_to(root)}: {name}" for name in sorted(names)]
    assert found == []


async def test_a_call_is_admitted_in_one_round_trip(
    dsn: str, db: psycopg.AsyncConnection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A running job's call, in-process or an external worker's (its lease checked, its call
    id kept), is one exchange with the database: the key's lock is never held across a round
    trip (before: four, six for an external worker's, BEGIN and COMMIT included)."""
    await db.execute(
        "INSERT INTO orc_flow_limits (name, requests, interval_seconds) VALUES ('trips', 100, 60)"
    )
    await db.execute(
        "INSERT INTO orc_flow_keys (key, limit_name, task_prefix) VALUES ('trips', 'trips', 't')"
    )
    job_id, lease = uuid4(), uuid4()
    await db.execute(
        "INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts, max_retries,"
        " trace_id, lease_token, attempt, flow_key)"
        " VALUES (%s, 'trips', 'RUNNING', '{}', 'trips', 3, 3, 't', %s, 1, 'trips')",
        (job_id, lease),
    )
    pool = create_pool(dsn, min_size=1, max_size=1)
    await pool.open()
    try:
        flow = FlowStore(Queries(pool), cast(ApplicationStore, None))
        await flow.admit_call(job_id, None, units=1, first=False)  # (the connection checked)
        trips = 0
        wait = psycopg.AsyncConnection.wait

        def exchanged(gen: Generator[Any, Any, Any]) -> Generator[Any, Any, Any]:
            """``gen``, counted once if it waits on the network (a commit with nothing to
            commit returns without a word to the server)."""
            nonlocal trips
            try:
                ready = next(gen)
            except StopIteration as done:
                return done.value
            trips += 1
            while True:
                try:
                    ready = gen.send((yield ready))
                except StopIteration as done:
                    return done.value

        async def counted(self: Any, gen: Any, *args: Any, **kwargs: Any) -> Any:
            return await wait(self, exchanged(gen), *args, **kwargs)

        monkeypatch.setattr(psycopg.AsyncConnection, "wait", counted)
        admitted = await flow.admit_call(job_id, None, units=1, first=False)
        assert (admitted.key, isinstance(admitted.verdict, Admit), trips) == ("trips", True, 1)
        trips = 0
        external = await flow.admit_call(
            job_id, None, units=1, first=Leased(1, lease), call_id="call-1"
        )
        assert (isinstance(external.verdict, Admit), trips) == (True, 1)
    finally:
        await pool.close()
