"""The fetch that leaves external job types' queues alone (orc_take_dispatch_v1, the fetch half
of orc_fetch_dispatch_v3: sql/functions/claim.sql) picks dispatches exactly as Procrastinate's
own fetch does (procrastinate_fetch_job_v2: its lock, priority, schedule and queue rules), but
the excluded queues: both are run over the same dispatches, on a real database, and must take
the same ones in the same order."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

#: (queue, priority, lock, scheduled in seconds from now or None): locks shared and free,
#: priorities apart and equal, due and not due, over three queues.
DISPATCHES = [
    ("q1", 0, "a", None),
    ("q2", 5, "a", None),
    ("q1", 5, None, None),
    ("q3", 0, "b", -10),
    ("q2", 0, None, 3600),
    ("q3", 9, "c", None),
    ("q1", 9, "c", None),
    ("q2", 1, None, -1),
    ("q1", 1, "d", None),
    ("q3", 1, "d", None),
    ("q2", 9, None, None),
]


Dispatches = list[tuple[str, int, str | None, int | None]]


async def defer(db: psycopg.AsyncConnection[Any], dispatches: Dispatches = DISPATCHES) -> None:
    for queue, priority, lock, scheduled in dispatches:
        await db.execute(
            "SELECT procrastinate_defer_jobs_v1(ARRAY[ROW(%s, 'plain', %s, %s, NULL, '{}',"
            " CASE WHEN %s::float IS NULL THEN NULL"
            " ELSE now() + make_interval(secs => %s::float) END"
            ")::procrastinate_job_to_defer_v1])",
            (queue, priority, lock, scheduled, scheduled),
        )
    # one lock already held by a running dispatch
    await db.execute(
        "SELECT procrastinate_defer_jobs_v1(ARRAY[ROW('q9', 'plain', 0, 'held', NULL, '{}', NULL)"
        "::procrastinate_job_to_defer_v1])"
    )
    await db.execute("UPDATE procrastinate_jobs SET status = 'doing' WHERE lock = 'held'")
    await db.execute(
        "SELECT procrastinate_defer_jobs_v1(ARRAY[ROW('q1', 'plain', 99, 'held', NULL, '{}',"
        " NULL)::procrastinate_job_to_defer_v1])"
    )


async def fetch_all(db: psycopg.AsyncConnection[Any], call: str, *params: Any) -> list[int]:
    """Fetch until nothing is due, in a transaction rolled back afterwards."""
    taken: list[int] = []
    async with db.transaction(force_rollback=True):
        cur = await db.execute("SELECT worker_id FROM procrastinate_register_worker_v1()")
        row = await cur.fetchone()
        assert row is not None
        while True:
            cur = await db.execute(call, (*params, row[0]))
            fetched = await cur.fetchone()
            if fetched is None or fetched[0] is None:
                return taken
            taken.append(fetched[0])


UPSTREAM = "SELECT id FROM procrastinate_fetch_job_v2(%s, %s)"
OURS = "SELECT id FROM orc_take_dispatch_v1(%s, %s, %s)"


@pytest.mark.parametrize("queues", [None, ["q1", "q3"]], ids=["every-queue", "some-queues"])
async def test_with_a_queue_excluded_the_fetch_is_procrastinate_s_but_that_queue(
    db: psycopg.AsyncConnection[Any], queues: list[str] | None
) -> None:
    ours = OURS
    await defer(db)
    upstream = await fetch_all(db, UPSTREAM, queues)
    assert 3 < len(upstream) < len(DISPATCHES)  # the rules leave some out (locks, not due)
    nothing_excluded = await fetch_all(db, ours, queues, [])
    excluded_nowhere = await fetch_all(db, ours, queues, ["nowhere"])
    none_excluded = await fetch_all(db, ours, queues, None)
    assert nothing_excluded == excluded_nowhere == none_excluded == upstream
    cur = await db.execute("SELECT id, queue_name FROM procrastinate_jobs")
    queue_of = dict(await cur.fetchall())
    without_q2 = await fetch_all(db, ours, queues, ["q2"])
    assert "q2" not in {queue_of[i] for i in without_q2}
    if queues is None:  # q2 was taken before: its dispatches' locks no longer block others
        assert set(without_q2) >= {i for i in upstream if queue_of[i] != "q2"}


#: A dispatch drawn at random: its queue, priority, lock (few, so that they are shared) and
#: schedule (due, or an hour off).
DISPATCH = st.tuples(
    st.sampled_from(["q1", "q2", "q3"]),
    st.integers(-2, 2),
    st.one_of(st.none(), st.sampled_from(["a", "b", "c"])),
    st.sampled_from([None, -5, 3600]),
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    dispatches=st.lists(DISPATCH, min_size=1, max_size=12),
    queues=st.sampled_from([None, ["q1"], ["q1", "q3"]]),
)
async def test_any_queue_is_fetched_as_procrastinate_fetches_it(
    db: psycopg.AsyncConnection[Any], dispatches: Dispatches, queues: list[str] | None
) -> None:
    """Whatever the dispatches' queues, priorities, shared locks and schedules, and whichever
    queues are asked for, the fetch takes the dispatches Procrastinate's own would take, in
    its order (``defer`` adds a lock held by a running dispatch, and a dispatch waiting on it)."""
    async with db.transaction(force_rollback=True):
        await defer(db, dispatches)
        upstream = await fetch_all(db, UPSTREAM, queues)
        assert await fetch_all(db, OURS, queues, None) == upstream
