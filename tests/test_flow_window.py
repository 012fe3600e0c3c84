"""The admission of each call in its flow key's window (orchestrator.domain.flow_window), as a
pure rule: whatever the sequence of claims, calls, costs, reconciliations and clock advances, the
spends it lets in (a call whose room comes soon placed at that instant, ahead of the others
decided after it) never hold more than ``requests`` requests or ``units`` units in any
interval; a call waits in place only for a room that comes within the bound, reserved, and one
told to park has none within it. A claim (in SQL) meets the same window."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from orchestrator.domain.flow_window import (
    WAIT_IN_PLACE_SECONDS,
    Admit,
    Allowance,
    CallBlocked,
    CallWindow,
    Room,
    Spend,
    admit_call,
    parked,
    room,
    waits_in_place,
)


@dataclass
class Key:
    """A key's window as the database keeps it: spends placed at their admission's instant."""

    allowance: Allowance
    now: float = 0.0
    spends: list[list[float]] = field(default_factory=list)  # [at, requests, units, job]
    reserved: dict[int, int] = field(default_factory=dict)  # job -> its claim's spend's index

    def window(self, job: int | None) -> CallWindow:
        mine = self.reserved.get(job) if job is not None else None
        return CallWindow(
            allowance=self.allowance,
            spends=tuple(
                Spend(at - self.now, int(r), int(u))
                for n, (at, r, u, _) in enumerate(self.spends)
                if n != mine
            ),
            held=0,
            held_cost=0,
            paused_for=None,
            reserved=None if mine is None else int(self.spends[mine][2]),
        )

    def claim(self, job: int, cost: int) -> None:
        """A job's claim, admitted by the same rule, reserves its first call's request."""
        cap = cost if self.allowance.units is None else min(cost, self.allowance.units)
        spends = self.window(None).spends
        if room(self.allowance, spends, 0.0, requests=1, units=cap) is None:
            self.reserved[job] = len(self.spends)
            self.spends.append([self.now, 1, cap, job])

    def call(self, job: int, cost: int) -> Admit | Room:
        """A running job's call, placed at its admission's instant: now, or when its room comes
        if it waits for it in place."""
        verdict = admit_call(self.window(job), cost, first=job in self.reserved)
        if isinstance(verdict, Admit):
            at = self.now + verdict.after
            if verdict.reuse:
                self.spends[self.reserved.pop(job)][:3] = [at, 1, verdict.units]
            else:
                self.spends.append([at, 1, verdict.units, job])
        return verdict

    def most_in_any_interval(self) -> tuple[int, int]:
        seconds = self.allowance.interval
        requests = units = 0
        for start, *_ in self.spends:
            inside = [s for s in self.spends if start <= s[0] < start + seconds]
            requests = max(requests, int(sum(s[1] for s in inside)))
            units = max(units, int(sum(s[2] for s in inside)))
        return requests, units


allowances = st.builds(
    Allowance,
    requests=st.one_of(st.none(), st.integers(1, 6)),
    units=st.one_of(st.none(), st.integers(1, 60)),
    interval=st.sampled_from([0.5, 1.0, 2.0, 10.0]),
).filter(lambda a: a.requests is not None or a.units is not None)

operations = st.lists(
    st.one_of(
        st.tuples(st.just("claim"), st.integers(0, 4), st.integers(0, 40)),
        st.tuples(st.just("call"), st.integers(0, 4), st.integers(0, 40)),
        st.tuples(st.just("reconcile"), st.integers(0, 50), st.floats(0, 1)),
        st.tuples(st.just("advance"), st.integers(0, 0), st.floats(0, 3)),
    ),
    max_size=60,
)


@given(allowances, operations)
@example(  # a claim's reservation topped up where it stood would make [0, 10) hold 13 units
    Allowance(requests=None, units=10, interval=10.0),
    [("call", 0, 5), ("advance", 0, 5.0), ("claim", 1, 5), ("advance", 0, 6.0), ("call", 1, 8)],
)
@example(  # a call waiting in place for its room, placed now, would make [0, 1) hold two calls
    Allowance(requests=1, units=None, interval=1.0),
    [("call", 0, 1), ("advance", 0, 0.9), ("call", 1, 1), ("call", 2, 1)],
)
def test_no_interval_ever_holds_more_than_the_allowance(
    allowance: Allowance, ops: list[tuple[str, int, float]]
) -> None:
    key = Key(allowance)
    for op, n, amount in ops:
        if op == "claim":
            key.claim(n, int(amount))
        elif op == "call":
            key.call(n, int(amount))
        elif op == "reconcile" and key.spends:  # the reply's usage, never above the estimate
            spend = key.spends[n % len(key.spends)]
            spend[2] = int(spend[2] * amount)
        elif op == "advance":
            key.now += amount
        requests, units = key.most_in_any_interval()
        assert allowance.requests is None or requests <= allowance.requests
        assert allowance.units is None or units <= allowance.units


@given(allowances, operations, st.integers(0, 4), st.integers(0, 40))
def test_a_call_waits_in_place_only_for_a_room_that_comes_soon_and_takes_it(
    allowance: Allowance, ops: list[tuple[str, int, float]], job: int, cost: int
) -> None:
    """A call admitted ahead waits no longer than the bound, for the soonest instant it fits
    (a moment before, it would not); one told to park has no room within the bound. (That its
    room is taken from the calls decided after it is the property above: each is placed
    where it was admitted.)"""
    key = Key(allowance)
    for op, n, amount in ops:
        if op == "claim":
            key.claim(n, int(amount))
        elif op == "call":
            key.call(n, int(amount))
        elif op == "advance":
            key.now += amount
    verdict = key.call(job, cost)
    if isinstance(verdict, Room):
        assert verdict.at > WAIT_IN_PLACE_SECONDS
        return
    assert 0 <= verdict.after <= WAIT_IN_PLACE_SECONDS
    if verdict.after > 0 and not verdict.reuse:
        key.spends.pop()  # (the call just placed: asked again a moment before its instant)
        key.now += verdict.after - 1e-6
        early = admit_call(key.window(job), cost, first=False)
        assert isinstance(early, Admit) and early.after > 0


def test_a_paused_key_holds_a_call_until_its_pause_ends_or_its_room_comes() -> None:
    allowance = Allowance(requests=1, units=None, interval=10.0)
    full = (Spend(-4.0, 1, 1),)  # its room comes in 6 s
    paused = CallWindow(allowance, (), 0, 0, paused_for=3.0, reserved=None)
    assert admit_call(paused, 1, first=False) == Room("paused", 3.0)
    both = CallWindow(allowance, full, 0, 0, paused_for=3.0, reserved=None)
    assert admit_call(both, 1, first=False) == Room("paused", 6.0)


def test_the_first_call_takes_its_claim_s_reservation_and_a_waiter_s_room_is_kept() -> None:
    allowance = Allowance(requests=2, units=None, interval=10.0)
    other = (Spend(-1.0, 1, 5),)
    mine = CallWindow(allowance, other, 0, 0, paused_for=None, reserved=5)
    assert admit_call(mine, 7, first=True) == Admit(7, reuse=True)
    assert admit_call(mine, 7, first=False) == Admit(7, reuse=False)
    held = CallWindow(allowance, other, held=1, held_cost=5, paused_for=None, reserved=None)
    assert admit_call(held, 7, first=False) == Room("requests", 9.0)
    mine_held = CallWindow(allowance, other, held=1, held_cost=5, paused_for=None, reserved=5)
    assert admit_call(mine_held, 7, first=True) == Admit(7, reuse=True)  # its room, its claim's


def test_a_short_wait_is_waited_in_place_its_room_reserved_and_a_long_one_parks() -> None:
    assert waits_in_place(0.0) and waits_in_place(WAIT_IN_PLACE_SECONDS)
    assert not waits_in_place(WAIT_IN_PLACE_SECONDS + 0.01) and not waits_in_place(60.0)
    allowance = Allowance(requests=2, units=None, interval=10.0)
    full = (Spend(-9.9, 1, 1), Spend(-9.8, 1, 1))  # room in 0.1 s, then in 0.2 s
    soon = CallWindow(allowance, full, 0, 0, paused_for=None, reserved=None)
    assert admit_call(soon, 1, first=False) == Admit(1, reuse=False, after=pytest.approx(0.1))
    taken = CallWindow(allowance, (*full, Spend(0.1, 1, 1)), 0, 0, paused_for=None, reserved=None)
    assert admit_call(taken, 1, first=False) == Admit(1, reuse=False, after=pytest.approx(0.2))
    later = CallWindow(allowance, (Spend(-9.0, 1, 1), Spend(-8.0, 1, 1)), 0, 0, None, None)
    assert admit_call(later, 1, first=False) == Room("requests", pytest.approx(1.0))
    ending = CallWindow(allowance, (), 0, 0, paused_for=0.1, reserved=None)
    assert admit_call(ending, 1, first=False) == Admit(1, reuse=False, after=0.1)


@given(
    at=st.floats(0, 100) | st.just(math.inf),
    blocked=st.sampled_from(["requests", "units", "paused", "share"]),
    reserved=st.booleans(),
    elsewhere=st.booleans(),
)
def test_a_parked_call_waits_in_its_own_key_s_line(
    at: float, blocked: CallBlocked, reserved: bool, elsewhere: bool
) -> None:
    """One park for both callers of an admission (ctx.admit_call, and an external worker's
    call-admit): in its own key's line, for its call's estimate, its claim's reservation given
    back as asked, sent for its room's instant only when that room is on another key (a
    fallback model's, whose room its own key's pump does not see) and known."""
    call_key = "fallback" if elsewhere else "own"
    park = parked("own", call_key, blocked, 42, release=reserved, at=at)
    assert (park.key, park.blocked, park.cost, park.release) == ("own", blocked, 42, reserved)
    assert park.not_before == (at if elsewhere and math.isfinite(at) else None)


@pytest.mark.parametrize(
    ("requests", "units", "ages", "cost", "held"),
    [
        (3, None, [0.5, 0.2], 1, 0),  # room now
        (2, None, [0.9, 0.5, 0.1], 1, 0),  # full: the second oldest must slide out
        (None, 100, [0.8, 0.3], 50, 0),  # 80 of 100 units spent: the oldest must go
        (None, 100, [0.8, 0.3], 500, 0),  # dearer than the window: alone in one
        (3, 100, [0.7, 0.4], 30, 1),  # a waiter's room held: requests bind
        (5, 60, [0.6, 0.3], 10, 1),  # ... units bind
    ],
)
async def test_a_call_and_a_claim_meet_the_same_window(
    db: psycopg.AsyncConnection[Any],
    requests: int | None,
    units: int | None,
    ages: list[float],
    cost: int,
    held: int,
) -> None:
    """The window's rule lives twice: in Python for a running job's calls (room) and in SQL for
    claims (orc_flow_capacity_v1). On the same window, both see the same room (each spend 20
    units)."""
    interval = 1.0
    for age in ages:
        await db.execute(
            "INSERT INTO orc_flow_spends (key, requests, units, at)"
            " VALUES ('same', 1, 20, clock_timestamp() - make_interval(secs => %s))",
            (age,),
        )
    cur = await db.execute(
        "SELECT c.blocked, extract(epoch FROM c.wake - clock_timestamp())"
        "  FROM orc_flow_capacity_v1("
        "    jsonb_populate_record(NULL::orc_flow_keys, jsonb_build_object('key', 'same',"
        "      'rate_factor', 1, 'factor_at', now(), 'window_requests', %s::int,"
        "      'window_units', %s::int)),"
        "    jsonb_populate_record(NULL::orc_flow_limits, jsonb_build_object('requests', %s::int,"
        "      'units', %s::int, 'interval_seconds', %s::float8)),"
        "    %s, %s, %s) AS c",
        (len(ages), 20 * len(ages), requests, units, interval, cost, held, 20 * held),
    )
    [(blocked, wake)] = await cur.fetchall()
    python = room(
        Allowance(requests, units, interval), [Spend(-age, 1, 20) for age in ages], 0.0,
        requests=1, units=cost, held=held, held_cost=20 * held,
    )  # fmt: skip
    if python is None:
        assert blocked is None
    else:
        assert (blocked, float(wake)) == (python.blocked, pytest.approx(python.at, abs=0.05))


async def test_a_call_admitted_ahead_holds_its_room_and_goes_unless_its_key_was_paused(
    db: psycopg.AsyncConnection[Any],
) -> None:
    """A call whose room comes soon is recorded at that instant, ahead of now, in the window's
    sums (orc_flow_call_spend_v3): the claims and calls decided after it count it. At its
    instant it goes (orc_flow_call_go_v1 answers NULL, its spend stays); if the key was paused
    meanwhile its spend leaves the window and the answer is the pause's remaining seconds: its
    job parks, as a call that meets a pause does, and no call passes a pause."""
    await db.execute(
        "INSERT INTO orc_flow_limits (name, requests, interval_seconds) VALUES ('ahead', 2, 10)"
    )
    await db.execute(
        "INSERT INTO orc_flow_keys (key, limit_name, task_prefix) VALUES ('ahead', 'ahead', 'p')"
    )

    async def admitted_ahead(seconds: float) -> int:
        cur = await db.execute(
            "SELECT orc_flow_call_spend_v3('ahead', NULL, 5, false, %s)", (seconds,)
        )
        row = await cur.fetchone()
        assert row is not None
        return int(row[0])

    async def window() -> tuple[int, list[float]]:
        cur = await db.execute(
            "SELECT k.window_requests, array_agg(extract(epoch FROM s.at - clock_timestamp())"
            "                                    ORDER BY s.id) FILTER (WHERE s.id IS NOT NULL)"
            "  FROM orc_flow_keys AS k LEFT JOIN orc_flow_spends AS s ON s.key = k.key"
            " WHERE k.key = 'ahead' GROUP BY k.window_requests"
        )
        row = await cur.fetchone()
        assert row is not None
        return int(row[0]), [float(a) for a in row[1] or []]

    first = await admitted_ahead(0.2)
    requests, ahead = await window()
    assert requests == 1 and len(ahead) == 1 and 0.1 < ahead[0] <= 0.2  # its room's instant
    cur = await db.execute("SELECT orc_flow_call_go_v1('ahead', %s)", (first,))
    assert await cur.fetchone() == (None,)  # it goes
    assert (await window())[0] == 1
    second = await admitted_ahead(0.2)
    await db.execute(
        "UPDATE orc_flow_keys SET paused_until = clock_timestamp() + interval '5 seconds',"
        " pause_reason = 'a 429', paused_by = 'provider' WHERE key = 'ahead'"
    )
    cur = await db.execute("SELECT orc_flow_call_go_v1('ahead', %s)", (second,))
    row = await cur.fetchone()
    assert row is not None and 4 < row[0] <= 5  # paused: it parks until then
    requests, ahead = await window()
    assert requests == 1 and len(ahead) == 1  # its room given back; the first call's stays
