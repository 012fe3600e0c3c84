"""How dispatches are fetched and finished: Procrastinate's JobManager, with our writes folded in.

- fetch: Procrastinate's fetch and the claim of the application job it dispatches run as one
  statement (``orc_fetch_dispatches_v1``), for as many dispatches as the worker has free slots;
  the worker's loop takes the extra ones from here, and each claim is handed to its attempt.
- finish: a successful attempt does not write COMPLETED itself; it leaves its completion here,
  and when Procrastinate finishes the dispatch, one statement writes both (together with the
  other completions waiting then: JobStore.complete).

So a job is RUNNING exactly while one of its dispatches is doing, and COMPLETED exactly when that
dispatch succeeded; and the hot path costs at most what raw Procrastinate's costs, two
statements per job, and fewer on a busy worker. Every other outcome (retry, failure, hand-back)
is written by the attempt itself.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from procrastinate import exceptions, jobs, manager

from orchestrator import states
from orchestrator.queries import QUERIES
from orchestrator.states import Status

logger = logging.getLogger(__name__)

#: Writes a completion, given whether Procrastinate deletes finished jobs.
Completion = Callable[[bool], Awaitable[Any]]


class DispatchManager(manager.JobManager):
    def __init__(self, connector: Any, *, task_prefix: str, worker_label: str) -> None:
        super().__init__(connector)
        self.task_prefix = task_prefix
        self.worker_label = worker_label
        self.completions: dict[int, Completion] = {}
        #: The claim made with each fetch, until its attempt takes it (``take_claim``). It is
        #: kept out of the task's arguments, which Procrastinate logs: it holds the payload.
        self.claims: dict[int, dict[str, Any] | None] = {}
        self.wakes = 0  # wake-ups of the worker so far (see fetch_job)
        #: How many dispatches the worker could start now (set by the worker; see fetch_job).
        self.free_slots: Callable[[], int] = lambda: 1
        #: Dispatches fetched for free slots that the worker's loop has not taken yet.
        self.fetched: collections.deque[jobs.Job] = collections.deque()
        self.fetching = False
        #: Called when a fetch has ended and every dispatch it fetched has been taken.
        self.on_all_taken: Callable[[], None] = lambda: None

    @property
    def holding(self) -> bool:
        """Whether dispatches are being fetched, or were fetched and not taken yet."""
        return self.fetching or bool(self.fetched)

    def starting(self) -> int:
        """Jobs claimed by a fetch whose dispatches the worker has not taken yet."""
        return sum(1 for job in self.fetched if job.id is not None and self.claims.get(job.id))

    async def fetch_job(self, queues: Iterable[str] | None, worker_id: int) -> jobs.Job | None:
        """The next dispatch to run: one fetched earlier for a free slot, else a new fetch.

        A fetch takes as many dispatches as the worker has free slots (the caller holds one),
        so a busy worker fills them in one round trip; it never takes more than it can run,
        and the worker's loop takes the others at once, their slots being free.
        """
        try:
            if not self.fetched:
                self.fetching = True
                try:
                    self.fetched.extend(await self._fetch(queues, worker_id))
                finally:
                    self.fetching = False
            return self.fetched.popleft() if self.fetched else None
        finally:
            if not self.fetched:  # also when the fetch failed: a stop waiting for it goes ahead
                self.on_all_taken()

    async def _fetch(self, queues: Iterable[str] | None, worker_id: int) -> list[jobs.Job]:
        """Fetch and claim; fetch again at once if the worker was woken during an empty fetch.

        Procrastinate's loop clears its wake-up event after each fetch, so a wake-up that lands
        while a fetch is under way (one that began before a lock was released or a job was
        committed) would otherwise wait for the next poll.
        """
        while True:
            wakes = self.wakes
            rows = await self.connector.execute_query_all_async(
                query=QUERIES["fetch_dispatches"],
                limit=max(1, self.free_slots()),
                queues=list(queues) if queues is not None else None,
                worker_id=worker_id,
                task_prefix=self.task_prefix,
                worker=self.worker_label,
                claimable=states.sources_of(Status.RUNNING),
                running=Status.RUNNING.value,
            )
            if rows or self.wakes == wakes:
                return [self._dispatch(row) for row in rows]

    def _dispatch(self, row: dict[str, Any]) -> jobs.Job:
        args = dict(row["args"])
        self.claims[row["id"]] = args.pop("claim", None)
        return jobs.Job.from_row({**row, "args": args})

    def take_claim(self, procrastinate_job_id: int) -> dict[str, Any] | None:
        return self.claims.pop(procrastinate_job_id, None)

    def leave_completion(self, procrastinate_job_id: int, completion: Completion) -> None:
        self.completions[procrastinate_job_id] = completion

    async def finish_job(self, job: jobs.Job, status: jobs.Status, delete_job: bool) -> None:
        assert job.id is not None
        self.claims.pop(job.id, None)  # a dispatch that ended before its attempt took it
        completion = self.completions.pop(job.id, None)
        if completion is None:
            try:
                await super().finish_job(job, status, delete_job)
            except exceptions.ConnectorException:
                if await self._still_doing(job.id):
                    raise
                logger.warning("dispatch %s was already settled (by a sweep); not finished", job.id)
            return
        if status is not jobs.Status.SUCCEEDED:  # not reachable from our tasks; be safe
            logger.error("dispatch %s ended %s after its attempt succeeded", job.id, status)
            await super().finish_job(job, status, delete_job)
            return
        await completion(delete_job)

    async def _still_doing(self, procrastinate_job_id: int) -> bool:
        row = await self.connector.execute_query_one_async(
            query=QUERIES["procrastinate_job_status"], job_id=procrastinate_job_id
        )
        return bool(row["status"] == "doing")
