"""Group commit: who waits for whom, and whose error reaches whom (no database needed)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.runtime.group_commit import GroupCommit


class Recorder:
    """A write that doubles numbers, records its batches, and refuses negative numbers."""

    def __init__(self, delay: float = 0.0) -> None:
        self.batches: list[list[int]] = []
        self.delay = delay

    async def __call__(self, items: Sequence[int]) -> list[int]:
        self.batches.append(list(items))
        await asyncio.sleep(self.delay)
        if any(item < 0 for item in items):
            raise ValueError(f"negative in {list(items)}")
        return [item * 2 for item in items]


async def test_a_lone_write_goes_at_once_by_itself() -> None:
    write = Recorder()
    group = GroupCommit(write)
    assert await group.submit(1) == 2
    assert await group.submit(2) == 4
    assert write.batches == [[1], [2]]


async def test_writes_that_arrive_while_a_batch_is_written_go_together_in_the_next() -> None:
    write = Recorder(delay=0.05)
    group = GroupCommit(write)
    first = asyncio.create_task(group.submit(1))
    await asyncio.sleep(0.01)  # the first batch is being written
    rest = [asyncio.create_task(group.submit(n)) for n in (2, 3, 4)]
    assert await first == 2
    assert await asyncio.gather(*rest) == [4, 6, 8]
    assert write.batches == [[1], [2, 3, 4]]


async def test_a_failing_batch_is_written_again_item_by_item_so_only_the_bad_one_fails() -> None:
    write = Recorder(delay=0.2)  # long enough that the three arrive while [0] is written
    group = GroupCommit(write)
    first = asyncio.create_task(group.submit(0))
    await asyncio.sleep(0.005)
    results = await asyncio.gather(*(group.submit(n) for n in (1, -2, 3)), return_exceptions=True)
    assert await first == 0
    assert results[0] == 2 and results[2] == 6
    assert isinstance(results[1], ValueError)
    assert write.batches == [[0], [1, -2, 3], [1], [-2], [3]]


async def test_a_cancelled_caller_leaves_the_others_their_results() -> None:
    write = Recorder(delay=0.05)
    group = GroupCommit(write)
    first = asyncio.create_task(group.submit(0))
    await asyncio.sleep(0.01)
    tasks = [asyncio.create_task(group.submit(n)) for n in (1, 2, 3)]
    await asyncio.sleep(0.06)  # their batch is being written
    tasks[1].cancel()
    assert await first == 0
    assert await tasks[0] == 2 and await tasks[2] == 6
    with pytest.raises(asyncio.CancelledError):
        await tasks[1]


async def test_a_caller_cancelled_in_its_own_write_does_not_strand_those_queued_behind() -> None:
    write = Recorder(delay=0.2)
    group = GroupCommit(write)
    writing = asyncio.create_task(group.submit(1))  # writes its batch itself
    await asyncio.sleep(0.01)
    queued = asyncio.create_task(group.submit(2))
    await asyncio.sleep(0.01)
    writing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await writing
    assert await queued == 4  # written by a writer task, started when the first write ended
    write.delay = 0
    assert await group.submit(5) == 10
    assert write.batches == [[1], [2], [5]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 50), st.integers(0, 3)), min_size=1, max_size=30))
def test_every_caller_gets_the_result_of_its_own_item(arrivals: list[tuple[int, int]]) -> None:
    """Items arrive in bursts (the second number: event-loop turns to wait before the next)."""

    async def scenario() -> None:
        write = Recorder(delay=0.001)
        group = GroupCommit(write)
        tasks = []
        for item, pause in arrivals:
            tasks.append(asyncio.create_task(group.submit(item)))
            for _ in range(pause):
                await asyncio.sleep(0)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for (item, _), result in zip(arrivals, results, strict=True):
            if item < 0:
                assert isinstance(result, ValueError)
            else:
                assert result == item * 2
        # every item was written, and each good one in exactly one batch that succeeded
        succeeded = [b for b in write.batches if all(i >= 0 for i in b)]
        assert sorted(i for b in succeeded for i in b) == sorted(i for i, _ in arrivals if i >= 0)

    asyncio.run(scenario())
