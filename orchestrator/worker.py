"""The worker process: Procrastinate's worker, woken when scheduled work becomes due.

Procrastinate hears about new jobs through LISTEN/NOTIFY but finds *scheduled* ones (every
retry) only by polling, every ``fetch_polling_interval`` seconds. :class:`DueTimeWaker` keeps
one timer for the soonest due job, learnt from ``orc_wakeup`` notifications (sent by every
statement that schedules a dispatch) and from a periodic look at the table, and wakes the fetch
loop when it fires. A dispatch that may be due at once but waits for the current run of the same
job to finish (it shares its lock) wakes the loop when that run ends.

The waker's connection is the worker's only listener: it also hears Procrastinate's channels
(inserted jobs, abort requests) and hands those notifications to the worker, so each insert
wakes one server backend and one Python handler, not two.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any
from uuid import UUID

import psycopg
from procrastinate import job_context, jobs, manager, retry
from procrastinate import worker as procrastinate_worker
from psycopg import sql

from orchestrator.drain import Drain
from orchestrator.health import HealthServer
from orchestrator.heartbeat import Heartbeats
from orchestrator.queries import QUERIES

if TYPE_CHECKING:
    from orchestrator.app import Orchestrator
    from orchestrator.dispatching import DispatchManager
    from orchestrator.store import JobStore

logger = logging.getLogger(__name__)

WAKEUP_CHANNEL = "orc_wakeup"
LISTEN_CHECK_SECONDS = 30.0  # as Procrastinate's listener: a silent connection is checked
_wake_after_run: contextvars.ContextVar[list[UUID] | None] = contextvars.ContextVar(
    "wake_after_run", default=None
)


class Worker(procrastinate_worker.Worker):
    """Procrastinate's worker with a way to fetch now rather than at the next poll, and a fetch
    loop with fewer hops through the event loop (``_fetch_and_process_jobs``).

    Relies on internals of procrastinate 3.x (``_new_job_event``, ``_stop_event``,
    ``_job_semaphore``, ``_running_jobs``, ``_job_ids_to_abort``, ``_process_job``,
    ``_persist_job_status``, ``_handle_notification``, ``_log_extra``, and the fetch loop it
    replaces); the version is pinned below 4, and tests/test_worker_loop.py,
    tests/test_worker_wakeup.py and tests/test_batched_writes.py fail if they change.
    """

    def __init__(self, *, dispatches: DispatchManager, **options: Any) -> None:
        super().__init__(**options)
        self.dispatches = dispatches
        self.stop_requested = False
        dispatches.free_slots = self.free_slots
        dispatches.on_all_taken = self._stop_if_requested
        self._slot_freed = asyncio.Event()
        #: The Procrastinate jobs (dispatches) holding a slot: from their fetch until freed.
        self._slots_held: set[int] = set()
        # A stop also ends the loop's two waits, however it is made (from another thread too:
        # Procrastinate then sets the event from the loop's own thread).
        self._stop_event = _EventAlsoSetting(self._new_job_event, self._slot_freed)

    def free_slots(self) -> int:
        """Slots free for a fetch, counting the one the fetching loop holds."""
        return self.concurrency - len(self._slots_held)

    async def run(self) -> None:
        self.stop_requested = False  # as Procrastinate forgets a stop made before this run
        await super().run()  # type: ignore[no-untyped-call]

    def stop(self) -> None:
        """Stop fetching; dispatches already fetched (and so claimed) are started first.

        A fetch takes several dispatches at once and the loop starts them one by one, so a stop
        can arrive in between, or while a fetch is under way. Their jobs are RUNNING already:
        they are started, as Procrastinate starts a job whose fetch ends after a stop, and the
        drain treats them as the running jobs they are.
        """
        self.stop_requested = True
        if not self.dispatches.holding:
            super().stop()  # type: ignore[no-untyped-call]

    def _stop_if_requested(self) -> None:
        if self.stop_requested:
            super().stop()  # type: ignore[no-untyped-call]

    def wake(self) -> None:
        self.dispatches.wakes += 1
        self._new_job_event.set()

    async def notified(self, channel: str, payload: str) -> None:
        """A notification on one of Procrastinate's channels, heard by the waker's listener.
        Raises ValueError for a payload that is not a JSON object."""
        parsed = json.loads(payload)
        if not isinstance(parsed, dict):
            raise ValueError(f"not a JSON object: {payload!r}")
        notification: Any = parsed  # one of Procrastinate's notification shapes
        if notification.get("type") == "job_inserted":
            self.dispatches.wakes += 1
        await self._handle_notification(channel=channel, notification=notification)

    async def _fetch_and_process_jobs(self) -> None:
        """Procrastinate's loop: while a slot is free, fetch a job and start it in a task of its
        own; at an empty fetch, wait for a new job, the poll interval or a stop.

        Procrastinate waits for a slot, and for new work, through ``utils.wait_any``, which
        makes a task of each thing it waits for and gathers them with ``asyncio.wait``: about
        three turns of the event loop between a job's end and the next fetch, and twice that
        between a notification and the fetch it calls for (the run loop's wait, then the slot's).
        Both lie on the path from submit to start. Here each wait is one event. An empty fetch
        waits here rather than returning to Procrastinate's run loop, which would wait for the
        same things with tasks again; with ``wait=False`` it returns, and Procrastinate stops
        the worker.
        """
        while not self._stop_event.is_set():
            while self._job_semaphore.locked():
                self._slot_freed.clear()
                await self._slot_freed.wait()
                if self._stop_event.is_set():
                    return
            await self._job_semaphore.acquire()  # a slot is free: this does not wait
            job = None
            try:
                assert self.worker_id is not None
                job = await self.app.job_manager.fetch_job(
                    queues=self.queues, worker_id=self.worker_id
                )
            finally:
                if job is None:
                    self._job_semaphore.release()
                self._new_job_event.clear()  # what woke it has been seen by this fetch
            if job is None:
                if not self.wait or self._stop_event.is_set():
                    return
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.fetch_job_polling_interval):
                        await self._new_job_event.wait()
                continue
            # A job fetched as a stop came is started all the same: it is claimed already.
            self._start(job)

    def _start(self, job: jobs.Job) -> None:
        """Run ``job`` in a task of its own, holding the slot taken for its fetch until its
        dispatch is finished (``_persist_job_status``) or, failing that, its task ends."""
        job_id = job.id
        context = job_context.JobContext(
            app=self.app,
            worker_name=self.worker_name,
            worker_queues=self.queues,
            additional_context=self.additional_context.copy() if self.additional_context else {},
            job=job,
            abort_reason=lambda: self._job_ids_to_abort.get(job_id) if job_id else None,
            start_timestamp=time.time(),
        )
        task = asyncio.create_task(
            self._process_job(context), name=f"process job {job.task_name}[{job.id}]"
        )
        self._running_jobs[task] = context
        assert job_id is not None
        self._slots_held.add(job_id)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[Any]) -> None:
        context = self._running_jobs.pop(task)
        self._free_slot(context.job.id)

    def _free_slot(self, job_id: int | None) -> None:
        """Free the slot of dispatch ``job_id``, if it still holds one."""
        if job_id in self._slots_held:
            self._slots_held.remove(job_id)
            self._job_semaphore.release()
            self._slot_freed.set()

    async def _persist_job_status(
        self,
        job: jobs.Job,
        status: jobs.Status,
        retry_decision: retry.RetryDecision | None,
        context: job_context.JobContext,
        job_result: job_context.JobResult | None,
    ) -> None:
        """Procrastinate's; then the dispatch's slot is freed at once, its job's work being over
        and written. Procrastinate frees it when the job's task has ended: several turns of the
        event loop later (the task resuming from its shield, returning, its done callback), all
        on the path from one job's end to the next job's fetch. Measured paired in one process,
        60-90 µs from submit to start."""
        try:
            await super()._persist_job_status(
                job=job, status=status, retry_decision=retry_decision, context=context,
                job_result=job_result,
            )  # fmt: skip
        finally:
            self._free_slot(job.id)

    # Procrastinate declares a dict; it only ever passes the result on as a log call's extra,
    # which takes any mapping.
    def _log_extra(  # type: ignore[override]
        self, action: str, context: Any, job_result: Any, **kwargs: Any
    ) -> Mapping[str, Any]:
        return _LazyExtra(
            functools.partial(super()._log_extra, action, context, job_result, **kwargs)
        )

    async def _process_job(self, context: Any) -> None:
        redispatched: list[UUID] = []
        token = _wake_after_run.set(redispatched)
        try:
            await super()._process_job(context)
        finally:
            _wake_after_run.reset(token)
            if redispatched:
                self.wake()


class _LazyExtra(Mapping[str, Any]):
    """A log call's ``extra``, built only when a record is made. Procrastinate builds one for
    each of its log calls, four per job (the job's fields copied twice over), whether or not
    that level is enabled; it showed in the latency from submit to start."""

    __slots__ = ("_build", "_built")

    def __init__(self, build: Callable[[], Mapping[str, Any]]) -> None:
        self._build = build
        self._built: Mapping[str, Any] | None = None

    def _fields(self) -> Mapping[str, Any]:
        if self._built is None:
            self._built = self._build()
        return self._built

    def __getitem__(self, key: str) -> Any:
        return self._fields()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields())

    def __len__(self) -> int:
        return len(self._fields())


class _EventAlsoSetting(asyncio.Event):
    """An event whose setting also sets others, so that a wait on one of those hears it too."""

    def __init__(self, *others: asyncio.Event) -> None:
        super().__init__()
        self._others = others

    def set(self) -> None:
        super().set()
        for other in self._others:
            other.set()


def wake_after_this_run(job_id: UUID) -> None:
    """Called by an attempt that gave its job a dispatch which may already be due."""
    pending = _wake_after_run.get()
    if pending is not None:
        pending.append(job_id)


class DueTimeWaker:
    def __init__(
        self,
        *,
        dsn: str,
        store: JobStore,
        wake: Callable[[], None],
        refresh_interval: float,
        notified: Callable[[str, str], Awaitable[None]],
        queues: Sequence[str] | None = None,
    ) -> None:
        """``notified(channel, payload)`` gets what Procrastinate's channels carry (inserted
        jobs, abort requests); ``wake`` is called when a scheduled dispatch comes due."""
        self.dsn = dsn
        self.queues = queues
        self.store = store
        self.wake = wake
        self.notified = notified
        self.refresh_interval = refresh_interval
        self._timer: asyncio.TimerHandle | None = None
        self._due: float | None = None  # loop time the timer fires at
        self._just_fired = False
        self._refresh_now = asyncio.Event()

    def note(self, due_epoch: float) -> None:
        """Make sure the worker wakes at ``due_epoch`` (seconds since the epoch)."""
        self.note_in(due_epoch - time.time())

    def note_in(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        at = loop.time() + max(0.0, seconds)
        if self._due is not None and self._due <= at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._due = at
        self._timer = loop.call_at(at, self._fire)

    def _fire(self) -> None:
        self._timer = self._due = None
        self.wake()
        self._just_fired = True
        self._refresh_now.set()  # arm the timer for the next due job

    async def run(self) -> None:
        try:
            await asyncio.gather(self._listen(), self._refresh_loop())
        finally:
            if self._timer is not None:
                self._timer.cancel()

    async def _refresh_loop(self) -> None:
        """Re-arm the timer from the table. A job that came due unseen (scheduled while the
        listener was away) wakes the worker at once, except right after the timer fired: the
        fetch it caused already looked, and waking again would only spin on a job that waits
        for a lock or a free slot."""
        while True:
            self._refresh_now.clear()  # a request made during the query runs the loop again
            just_fired, self._just_fired = self._just_fired, False
            try:
                seconds, overdue = await self.store.soonest_due(lookback=self.refresh_interval)
            except psycopg.Error as exc:
                logger.warning("due-time refresh failed: %s", exc)
            else:
                if seconds is not None:
                    self.note_in(seconds)
                if overdue and not just_fired:
                    self.wake()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._refresh_now.wait(), self.refresh_interval)

    async def _listen(self) -> None:
        """Hear due times (``orc_wakeup``), inserted jobs and abort requests (Procrastinate's
        channels).

        A job inserted after the worker's first fetch but before this connection listens is not
        missed either: the refresh that each (re)connection triggers finds it overdue.
        """
        channels = [WAKEUP_CHANNEL, *manager.get_channel_for_queues(self.queues)]
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
                    for channel in channels:
                        await conn.execute(
                            sql.SQL(QUERIES["listen_channel"]).format(sql.Identifier(channel))
                        )
                    self._refresh_now.set()  # catch up on anything scheduled while away
                    while True:
                        async for notify in conn.notifies(timeout=LISTEN_CHECK_SECONDS):
                            await self._heard(notify.channel, notify.payload)
                        # Quiet for a while: make sure the connection is still there (one the
                        # network dropped silently would otherwise leave the worker polling).
                        await conn.execute(QUERIES["ping"])
            except psycopg.OperationalError as exc:
                logger.warning("wake-up listener lost its connection (%s); reconnecting", exc)
                await asyncio.sleep(1.0)

    async def _heard(self, channel: str, payload: str) -> None:
        if channel != WAKEUP_CHANNEL:
            try:
                await self.notified(channel, payload)
            except ValueError:
                logger.warning("ignoring malformed notification %r on %s", payload, channel)
            except Exception:  # one notification must not end the worker's only listener
                logger.exception("handling notification %r on %s failed", payload, channel)
            return
        try:
            self.note(float(payload))
        except ValueError:
            logger.warning("ignoring malformed wake-up %r", payload)


async def run_worker(
    orc: Orchestrator,
    *,
    concurrency: int,
    queues: Sequence[str] | None,
    wait: bool,
    install_signal_handlers: bool,
    name: str | None,
) -> None:
    """Run a worker until it is stopped: by SIGTERM/SIGINT (with ``install_signal_handlers``),
    by ``orc.stop_worker()``, or by cancelling this coroutine; each of them drains."""
    settings = orc.settings
    worker = Worker(
        dispatches=orc.dispatches,
        app=orc.procrastinate,
        queues=queues,
        name=name or "orchestrator",
        concurrency=concurrency,
        wait=wait,
        fetch_job_polling_interval=settings.fetch_polling_interval,
        install_signal_handlers=False,  # ours drain (see drain.py)
        listen_notify=False,  # the waker listens for it
        stalled_worker_timeout=settings.stalled_worker_seconds,
    )
    drain = Drain(
        stop_fetching=worker.stop,
        runner=orc.runner,
        deadline=settings.drain_seconds,
        starting=orc.dispatches.starting,
    )
    orc.drains.append(drain)
    waker = DueTimeWaker(
        dsn=orc.dsn,
        store=orc.store,
        wake=worker.wake,
        refresh_interval=settings.fetch_polling_interval,
        queues=queues,
        notified=worker.notified,
    )
    orc.runner.on_redispatch = wake_after_this_run
    heartbeats = Heartbeats(
        orc.store,
        orc.runner,
        dsn=orc.dsn,
        interval=settings.heartbeat_interval,
        zombie_threshold=settings.zombie_threshold,
        expiry_grace=settings.job_expiry_grace_seconds,
    )
    health = HealthServer(
        port=settings.health_port, ready=lambda: not drain.draining, database_ok=orc.store.ping
    )
    if settings.health_port:
        await health.start()
    if install_signal_handlers:
        drain.install()
    side_tasks = [
        asyncio.create_task(waker.run(), name="due-time waker"),
        asyncio.create_task(heartbeats.run(), name="heartbeats"),
    ]
    run = asyncio.create_task(worker.run(), name="procrastinate worker")
    try:
        await asyncio.shield(run)
    except asyncio.CancelledError:
        drain.begin("worker cancelled")
        await stop_worker(worker, run)
        raise
    finally:
        if install_signal_handlers:
            drain.uninstall()
        orc.drains.remove(drain)
        for task in side_tasks:
            task.cancel()
        await asyncio.gather(*side_tasks, return_exceptions=True)
        await orc.runner.aclose()
        await health.close()


async def stop_worker(worker: Worker, run: asyncio.Task[None]) -> None:
    """Wait for a draining worker to stop, making sure the stop is not lost.

    A stop made before ``Worker.run`` has started is reset by it, and on Python 3.11
    ``asyncio.wait_for`` can swallow a cancellation that arrives as its wait completes
    (CPython gh-86296; psycopg_pool waits for connections with it). So the stop is repeated
    until the worker has actually stopped.
    """
    while not run.done():
        worker.stop()
        await asyncio.wait([run], timeout=0.2)
