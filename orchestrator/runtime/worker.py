"""A worker: fetch dispatches for free slots, run each attempt as a task, write its outcome.

One :class:`Worker` per ``run_worker`` call. It owns its slots, its running attempts, its
clients and its connections; several can run side by side in one process (on different
queues, say) without sharing any of them. Procrastinate is its infrastructure layer through
public seams only: its schema and SQL functions (the fetch inside ``orc_fetch_dispatches_v3``,
``procrastinate_finish_job_v1``, ``procrastinate_retry_job_v2``, the worker registry), its
retry strategies, its notification channels, and its periodic deferrer and tasks (the
maintenance services), which this worker runs like any other Procrastinate task.

    lanes           the jobs lane (``concurrency`` slots, the worker's queues) and the
                    maintenance lane (one slot, the maintenance queue), each with a fetch loop
                    of its own (orchestrator.runtime.lanes): maintenance never waits behind
                    the backlog
    fetch loop      while a lane has a free slot: fetch up to that many dispatches in one
                    statement (their jobs claimed by it), start each in a task of its own; when
                    none is due, wait for a wake-up (an insert, a due time, a freed slot) or
                    the poll
    a job dispatch  its Attempt runs the task and returns an outcome; its slot is free from
                    then on, while the OutcomeWriter writes the outcome with the dispatch's end
                    (the lane bounds those writes, orchestrator.runtime.lanes); a job others
                    wait for holds it until its completion is written, with the slot's next
                    fetch in the same transaction: it may claim what that end released
    other dispatch  a Procrastinate task (a maintenance service's tick), run as Procrastinate
                    runs it: its retry strategy decides a failure; a task this worker does not
                    know (a newer release's, in a rolling deploy) is left for one that does
    side loops      wake-ups (one listener, one due-time timer), heartbeats of running jobs,
                    the worker's registry heartbeat, the abort poll, the periodic deferrer;
                    each outlives its errors (orchestrator.runtime.loops)
    stop            a drain (orchestrator.runtime.drain): no more fetches; running attempts go
                    on until they end or the drain deadline hands them back
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import procrastinate
import psycopg
from procrastinate import periodic

from orchestrator.domain.errors import TransactionConflict
from orchestrator.domain.models import Claim
from orchestrator.runtime import current_attempt
from orchestrator.runtime.attempt import Attempt, Toolkit
from orchestrator.runtime.clients import Clients
from orchestrator.runtime.config_reload import ConfigReload
from orchestrator.runtime.drain import Drain
from orchestrator.runtime.health import HealthServer
from orchestrator.runtime.heartbeat import Heartbeats
from orchestrator.runtime.lanes import Lane, lanes_for
from orchestrator.runtime.loops import CONNECTION_ERRORS, Backoff, keep_running, until_written
from orchestrator.runtime.metrics import Metrics
from orchestrator.runtime.outcomes import Abandoned, Completed, OutcomeWriter, named
from orchestrator.runtime.running import Running
from orchestrator.runtime.wakeups import Wakeups
from orchestrator.settings import Settings
from orchestrator.storage.applications import application_of
from orchestrator.storage.database import OwnConnection, describe_database
from orchestrator.storage.dispatches import Completion, Dispatch, Taker
from orchestrator.storage.stores import Stores

logger = logging.getLogger("orchestrator.worker")

#: The attempt span's place when tracing is off: nothing to enter, nothing to end.
NO_SPAN = contextlib.nullcontext(None)

#: This process, as it appears in ``locked_by`` (``/w<Procrastinate worker id>`` is added).
HOST = f"{socket.gethostname()}/{os.getpid()}"
ABORT_POLL_SECONDS = 5.0  # as Procrastinate's: aborts a lost notification would have carried
#: A task this worker does not know is due again this much later, for another worker ...
UNKNOWN_TASK_SECONDS = 10.0
#: ... and fails after this many such turns (an hour): no worker of the fleet knows it.
UNKNOWN_TASK_TURNS = 360


class Worker:
    def __init__(
        self,
        *,
        dsn: str,
        stores: Stores,
        kit: Toolkit,
        procrastinate_app: procrastinate.App,
        services: Any,
        settings: Settings,
        concurrency: int,
        queues: Sequence[str] | None,
        metrics: Metrics,
        excluded_queues: Sequence[str] = (),
        maintenance_queue: str | None = None,
        wait: bool = True,
        name: str = "orchestrator",
        config_reload: ConfigReload | None = None,
        declares: Callable[[], str | None] | None = None,
    ) -> None:
        """``services``: what the Procrastinate tasks this worker runs find in their context's
        ``additional_context["services"]`` (the maintenance services), whose ticks come on
        ``maintenance_queue`` (None: no maintenance lane). ``excluded_queues``: queues it never
        takes (external job types'); listening on every queue, it also leaves those of other
        applications' job types (docs/applications.md), as it learns them at registration and
        with each registry heartbeat. ``config_reload``: the watch of the retry config file
        (shared by the workers of its process; None: no reload). ``declares``: the fingerprint
        of what its process declares, recorded beside its config version
        (docs/applications.md; None: none)."""
        self.dsn = dsn
        self.stores = stores
        self.kit = kit
        self.app = procrastinate_app
        self.services = services
        self.settings = settings
        self.lanes = lanes_for(
            queues=queues, concurrency=concurrency, maintenance_queue=maintenance_queue,
            excluded=excluded_queues,
        )  # fmt: skip
        self._excluded = tuple(excluded_queues)
        #: The queues of this application's own job types (in-process ones).
        self._own = {
            kit.config.current.queue_of(name)
            for name, job_type in kit.job_types.items()
            if not job_type.is_external
        }
        self.jobs_lane = self.lanes[0]
        self.wait = wait
        self.name = name
        self.config_reload = config_reload
        self.declares: Callable[[], str | None] = declares or (lambda: None)
        self.worker_id: int | None = None
        self.running = Running()
        self.clients = Clients(kit.tracing)
        self.drain = Drain(
            stop_fetching=self.stop_fetching, running=self.running, deadline=settings.drain_seconds
        )
        self._fetch_connection = OwnConnection(dsn, "fetch")
        self._completions_connection = OwnConnection(dsn, "completions")
        self.metrics = metrics
        self.writer = OutcomeWriter(
            stores.dispatches, stores.jobs, self._completions_connection, metrics
        )
        self.heartbeats = Heartbeats(
            stores.liveness,
            self.running,
            dsn=dsn,
            interval=settings.heartbeat_interval,
            zombie_threshold=settings.zombie_threshold,
            expiry_grace=settings.job_expiry_grace_seconds,
            metrics=metrics,
        )
        self._fetching = True  # the jobs lane's last fetch reached the database
        self._stopped = asyncio.Event()  # set once the worker stops fetching

    # -- control ---------------------------------------------------------------------------

    @property
    def queues(self) -> list[str] | None:
        """The queues of the jobs lane (None: every queue)."""
        return self.jobs_lane.queues

    @property
    def concurrency(self) -> int:
        return self.jobs_lane.capacity

    def wake(self) -> None:
        """Fetch jobs now: one may be due (its due time reached, its lock freed). The
        maintenance lane hears of its ticks on its own channel (and polls for a retried one):
        its fetch, which filters the backlog, is not run for every job's due time."""
        self.jobs_lane.wake()

    def stop_fetching(self) -> None:
        """Fetch no more; dispatches already fetched (and so claimed) run to their end."""
        self._stopped.set()
        for lane in self.lanes:
            lane.stop()

    def notified(self, channel: str, notification: dict[str, Any]) -> None:
        """What Procrastinate announced on ``channel``: a dispatch inserted (the lanes that
        listen there fetch now), or one asked to abort (its job was cancelled)."""
        match notification.get("type"):
            case "job_inserted":
                for lane in self.lanes:
                    if channel in lane.channels:
                        lane.wake()
            case "abort_job_requested":
                self.abort(int(notification["job_id"]))

    def abort(self, dispatch_id: int) -> None:
        """The job that dispatch runs was cancelled: its attempt stops and writes nothing."""
        attempt = self.running.dispatches().get(dispatch_id)
        if attempt is not None:
            attempt.abandon("the job was cancelled")

    def running_jobs(self) -> set[Any]:
        return self.running.jobs()

    @property
    def free_slots(self) -> int:
        """Free slots of the jobs lane."""
        return self.jobs_lane.free

    # -- what a scrape reads (orchestrator.runtime.metrics.WorkerState) ----------------------

    def lane_slots(self) -> list[tuple[str, int, int]]:
        return [(lane.name, lane.capacity, lane.free) for lane in self.lanes]

    @property
    def running_count(self) -> int:
        return len(self.running)

    @property
    def ready(self) -> bool:
        return not self.drain.draining and self._fetching

    def heartbeat_age(self) -> float:
        return self.heartbeats.age()

    # -- lifecycle -------------------------------------------------------------------------

    async def run(self, *, install_signal_handlers: bool = False) -> None:
        """Run until stopped: SIGTERM/SIGINT (with ``install_signal_handlers``), a drain begun
        from outside (``self.drain.begin``), or this coroutine cancelled; each of them drains.
        Without ``wait``, it returns once nothing is due and what it started has ended."""
        if install_signal_handlers:
            self.drain.install()  # first: a SIGTERM at any moment from here on drains
        settings = self.settings
        health = HealthServer(
            port=settings.health_port,
            ready=lambda: not self.drain.draining,
            database_ok=self.stores.liveness.ping,
            metrics=self.metrics.exposition,
        )
        side: list[asyncio.Task[None]] = []
        try:
            if settings.health_port:
                await health.start()
            await self._register()
            logger.info(
                "worker %s (%s/w%s) started: database %s, queues %s, concurrency %d%s",
                self.name, HOST, self.worker_id, describe_database(self.dsn),
                ", ".join(self.queues) if self.queues else "all", self.concurrency,
                "".join(f", {lane.name} lane" for lane in self.lanes[1:]),
            )  # fmt: skip
            side = [asyncio.create_task(body(), name=name) for name, body in self._side_loops()]
            loop = asyncio.create_task(self._run(), name=f"worker {self.name}")
            try:
                await asyncio.shield(loop)
            except asyncio.CancelledError:
                self.drain.begin("worker cancelled")
                await loop
                raise
        finally:
            if install_signal_handlers:
                self.drain.uninstall()
            self.drain.close()
            for task in side:
                task.cancel()
            await asyncio.gather(*side, return_exceptions=True)
            await self._close(health)

    async def _run(self) -> None:
        loops = [
            asyncio.create_task(self._fetch_loop(lane), name=f"{lane.name} lane")
            for lane in self.lanes
        ]
        try:
            await asyncio.gather(*loops)
        finally:
            for loop in loops:
                loop.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            # What was started ends (a drain's deadline hands it back).
            while started := [task for lane in self.lanes for task in lane.tasks]:
                await asyncio.wait(started)

    async def _close(self, health: HealthServer) -> None:
        await health.close()
        await self.clients.aclose()
        await self._fetch_connection.close()
        await self._completions_connection.close()
        if self.worker_id is not None:
            with contextlib.suppress(Exception):  # the registry forgets a silent worker anyway
                await self.stores.dispatches.unregister_worker(self.worker_id)

    def _side_loops(self) -> list[tuple[str, Callable[[], Coroutine[Any, Any, None]]]]:
        settings = self.settings
        wakeups = Wakeups(
            dsn=self.dsn,
            liveness=self.stores.liveness,
            wake=self.wake,
            notified=self.notified,
            refresh_interval=settings.fetch_polling_interval,
            channels=list(dict.fromkeys(c for lane in self.lanes for c in lane.channels)),
        )
        deferrer = periodic.PeriodicDeferrer(
            registry=self.app.periodic_registry, max_delay=settings.periodic_max_delay
        )
        loops: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("wake-ups", wakeups.run),
            ("heartbeats", self.heartbeats.run),
            ("worker registry heartbeat", self._registry_heartbeat),
            ("abort poll", self._abort_poll),
            ("periodic deferrer", deferrer.worker),
        ]
        if self.config_reload is not None:
            loops.append(("retry config reload", self.config_reload.run))
        return [(name, functools.partial(keep_running, name, body)) for name, body in loops]

    # -- the fetch loop --------------------------------------------------------------------

    async def _fetch_loop(self, lane: Lane) -> None:
        backoff, conflicts = Backoff(), Backoff()
        while not self._stopped.is_set():
            if lane.free == 0:
                lane.slot_freed.clear()
                await lane.slot_freed.wait()
                continue
            lane.woken.clear()  # what woke it is seen by this fetch
            try:
                dispatches = await self._fetch(lane)
            except CONNECTION_ERRORS as exc:
                # The database is away: try again, more slowly each time, until it is back.
                if lane is self.jobs_lane:
                    self._fetching = False
                if not backoff.failures:
                    logger.warning("%s lane: database unreachable (%s); trying again",
                                   lane.name, exc)  # fmt: skip
                await self._pause(backoff.next(), self._stopped)
                continue
            except TransactionConflict as exc:
                # The fetch waits for no lock, so this is not expected; nothing was claimed.
                logger.warning("%s lane: %s; fetching again", lane.name, exc)
                await self._pause(conflicts.next(), self._stopped)
                continue
            if backoff.failures:
                logger.warning("%s lane: the database is back", lane.name)
                backoff.reset()
                if lane is self.jobs_lane:
                    self._fetching = True
            conflicts.reset()
            for dispatch in dispatches:  # claimed: each is started, even if a stop came
                self._start(lane, dispatch)
            if dispatches or lane.woken.is_set():
                continue  # more may be due, or something came during the fetch
            if not self.wait:
                if lane.idle:
                    return  # nothing due, and nothing running that could make more
                await asyncio.wait(list(lane.tasks), return_when=asyncio.FIRST_COMPLETED)
                continue
            await self._pause(self.settings.fetch_polling_interval, lane.woken)

    async def _fetch(self, lane: Lane) -> list[Dispatch]:
        assert self.worker_id is not None
        try:
            async with self._fetch_connection.connection() as conn:
                return await self.stores.dispatches.fetch(
                    limit=lane.free, queues=lane.queues, worker_id=self.worker_id,
                    worker=HOST, conn=conn, excluded=lane.excluded,
                )  # fmt: skip
        except psycopg.errors.ForeignKeyViolation:
            # The registry forgot this worker (silent too long: the database was away).
            await self._register()
            return []

    async def _pause(self, seconds: float, until: asyncio.Event) -> None:
        """Wait ``seconds``, or until ``until`` is set (new work or a stop; a stop)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await until.wait()

    async def _register(self) -> None:
        self.worker_id = await until_written(
            "worker registry",
            lambda: self.stores.dispatches.register_worker(
                prune_after=self.settings.stalled_worker_seconds
            ),
        )
        await until_written("worker registry", self._record_config)

    async def _record_config(self) -> None:
        """Record beside its registry entry which retry config version this worker runs
        (``orchestrator config show --workers`` reads it)."""
        assert self.worker_id is not None
        application, declares = application_of(self.settings), self.declares()
        await self.stores.config_versions.record(
            self.worker_id, worker=f"{HOST}/w{self.worker_id}", config=self.kit.config,
            application=application.name, declares=declares, runs='jobs',
        )  # fmt: skip
        await self.stores.flow.apply(self.kit.config, application, declares)  # per version
        if self.jobs_lane.queues is None:  # every queue: but other applications' own
            foreign = await self.stores.applications.foreign_queues(application)
            self.jobs_lane.excluded = tuple(sorted(set(self._excluded) | (foreign - self._own)))

    def _start(self, lane: Lane, dispatch: Dispatch) -> None:
        """Run the dispatch in a task of its own, in a slot of ``lane`` (free once its outcome
        is written and the task ends)."""
        lane.take(
            asyncio.create_task(
                self._run_dispatch(dispatch, lane),
                name=f"dispatch {dispatch.id} ({dispatch.task_name})",
            )
        )

    async def _run_dispatch(self, dispatch: Dispatch, lane: Lane) -> None:
        try:
            if dispatch.is_job:
                await self._run_job(dispatch, lane)
            else:
                await self._run_task(dispatch)
        except Exception:  # a write that failed: the sweep or the safety net takes it from here
            logger.exception("dispatch %s (%s) failed", dispatch.id, dispatch.task_name)

    async def _run_job(self, dispatch: Dispatch, lane: Lane) -> None:
        claim = dispatch.claim
        if dispatch.claim_later:
            claim = await until_written(
                f"dispatch {dispatch.id}'s claim", lambda: self._claim(dispatch)
            )
        if claim is None:
            logger.info("dispatch %s is stale or a duplicate of its job's; ended", dispatch.id)
            await until_written(
                f"dispatch {dispatch.id}'s end",
                lambda: self.stores.dispatches.end(dispatch.id, "succeeded"),
            )
            return
        with current_attempt.running(claim):  # its log records carry the attempt's fields
            await self._attempt(dispatch, claim, lane)

    async def _attempt(self, dispatch: Dispatch, claim: Claim, lane: Lane) -> None:
        """Run the attempt (in its span, when tracing is on) and write its outcome, its slot
        in ``lane`` already free for the next fetch (unless jobs wait for this one:
        :meth:`_complete_releasing`)."""
        tracing = self.kit.tracing
        attempt = Attempt(claim, dispatch.id, kit=self.kit, clients=self.clients)
        self.running.add(attempt)
        self.metrics.attempt_started(claim, dispatch.due_at(claim))
        started = time.monotonic()
        try:
            with NO_SPAN if tracing is None else tracing.attempt(claim) as span:
                try:
                    outcome = await attempt.run()
                except asyncio.CancelledError:  # not the attempt's own: the event loop closes
                    handed_back = attempt.hand_back("cancelled")
                    attempt.releasing = True
                    await asyncio.shield(self.writer.write(dispatch.id, claim, handed_back))
                    raise
                except BaseException as exc:  # not an error of the task's: the attempt crashed
                    logger.error(
                        "attempt %s of job %s crashed (%r); its dispatch ends failed and the "
                        "sweep recovers the job", claim.attempt, claim.id, exc,
                    )  # fmt: skip
                    self.metrics.attempt_finished(
                        claim.job_type, "crashed", time.monotonic() - started
                    )
                    await until_written(
                        f"dispatch {dispatch.id}'s end",
                        lambda: self.stores.dispatches.end(dispatch.id, "failed"),
                    )
                    return
                if attempt.lost is not None:  # lost its job after the task ended: write nothing
                    outcome = Abandoned(attempt.lost)
                logger.info(
                    "job %s (%s) attempt %d: %s", claim.id, claim.job_type, claim.attempt,
                    type(outcome).__name__.lower(), extra=current_attempt.fields_of(claim),
                )  # fmt: skip
                name, error_class, layer = named(outcome)
                self.metrics.attempt_finished(
                    claim.job_type, name, time.monotonic() - started, error_class=error_class,
                    layer=layer,
                )  # fmt: skip
                if tracing is not None and span is not None:
                    tracing.ended(span, outcome)
                attempt.releasing = True
                if (
                    claim.has_dependants
                    and isinstance(outcome, Completed)
                    and not self._stopped.is_set()
                ):
                    await self._complete_releasing(dispatch.id, claim, outcome, lane)
                    return
                lane.ran(asyncio.current_task())
                await until_written(
                    f"job {claim.id}'s outcome",
                    lambda: self.writer.write(dispatch.id, claim, outcome),
                )
        finally:
            self.running.remove(attempt)

    async def _complete_releasing(
        self, dispatch_id: int, claim: Claim, outcome: Completed, lane: Lane
    ) -> None:
        """A job others wait for completed: its end may release them, so its slot's next
        dispatch is fetched in the completion's statement (orchestrator.runtime.outcomes), and
        a chain's next link starts with no wake-up, no empty fetch while the completion is
        written, and one commit. The slot passes to what was fetched (a worker that is stopping
        writes its completions alone)."""
        completion = Completion(claim, outcome.result, outcome.duration_ms, dispatch_id)
        assert self.worker_id is not None
        taker = Taker(lane.queues, lane.excluded, self.worker_id, HOST)
        fetched = await until_written(
            f"job {claim.id}'s outcome", lambda: self.writer.complete_and_fetch(completion, taker)
        )
        lane.ran(asyncio.current_task())
        for next_dispatch in fetched:  # claimed: started even if a stop came meanwhile
            self._start(lane, next_dispatch)

    async def _claim(self, dispatch: Dispatch) -> Claim | None:
        """The claim the fetch left for later: another transaction held the job when it tried.
        (One whose acknowledgement was lost finds nothing when tried again: the dispatch ends,
        and the sweep recovers the job, as after a fetch whose acknowledgement was lost.)"""
        assert self.worker_id is not None
        return await self.stores.dispatches.claim(dispatch, worker_id=self.worker_id, worker=HOST)

    async def _run_task(self, dispatch: Dispatch) -> None:
        """A plain Procrastinate task, as Procrastinate's own worker runs one: with its context
        when it asks for it; a failure is retried as its retry strategy decides."""
        store = self.stores.dispatches
        ending: Callable[[], Awaitable[object]]
        task = self.app.tasks.get(dispatch.task_name)
        if task is None:
            await self._leave_unknown(dispatch)
            return
        job = dispatch.procrastinate_job()
        context = procrastinate.JobContext(
            app=self.app,
            worker_name=self.name,
            worker_queues=self.queues,
            job=job,
            start_timestamp=time.time(),
            additional_context={"services": self.services},
            abort_reason=lambda: None,
        )
        try:
            result = task(*([context] if task.pass_context else []), **job.task_kwargs)
            if inspect.isawaitable(result):
                await result
        except Exception as exc:
            retry = task.get_retry_exception(exception=exc, job=job)
            if retry is not None:
                retry_at = retry.retry_decision.retry_at
                logger.warning("task %s (dispatch %s) failed; retried at %s: %s",
                               task.name, dispatch.id, retry_at, exc)  # fmt: skip
                ending = partial(store.retry_task, dispatch.id, retry_at)
            else:
                logger.exception("task %s (dispatch %s) failed", task.name, dispatch.id)
                ending = partial(store.end, dispatch.id, "failed")
        else:
            ending = partial(store.end, dispatch.id, "succeeded")
        # Through an outage: a tick's dispatch left doing would hold its lock until the safety
        # net found it.
        await until_written(f"dispatch {dispatch.id}'s end", ending)

    async def _leave_unknown(self, dispatch: Dispatch) -> None:
        """A task this worker does not know (a newer release's maintenance tick, in a rolling
        deploy) is left for a worker that does: given back, due again in a while, rather than
        failed. One no worker has known for an hour of such turns ends failed."""
        store = self.stores.dispatches
        ending: Callable[[], Awaitable[object]]
        if dispatch.runs >= UNKNOWN_TASK_TURNS:
            logger.warning(
                "dispatch %s: no worker has known a task named %r for %d turns; ended failed",
                dispatch.id, dispatch.task_name, dispatch.runs,
            )  # fmt: skip
            ending = partial(store.end, dispatch.id, "failed")
        else:
            logger.info("dispatch %s: no task named %r here; left for a worker that knows it",
                        dispatch.id, dispatch.task_name)  # fmt: skip
            retry_at = datetime.now(UTC) + timedelta(seconds=UNKNOWN_TASK_SECONDS)
            ending = partial(store.retry_task, dispatch.id, retry_at)
        await until_written(f"dispatch {dispatch.id}'s end", ending)

    # -- side loops ------------------------------------------------------------------------

    async def _registry_heartbeat(self) -> None:
        """Keep this worker alive in Procrastinate's registry (the safety net tells dead
        workers' dispatches by it); register again if it was forgotten meanwhile."""
        while True:
            await asyncio.sleep(self.settings.stalled_worker_seconds / 3)
            assert self.worker_id is not None
            if not await self.stores.dispatches.beat_worker(self.worker_id):
                await self._register()
            await self._record_config()

    async def _abort_poll(self) -> None:
        """Abort requests a lost notification would have carried."""
        while True:
            await asyncio.sleep(ABORT_POLL_SECONDS)
            running = self.running.dispatches()
            if running:
                for dispatch_id in await self.stores.dispatches.aborting(list(running)):
                    self.abort(dispatch_id)
