"""External workers: jobs of external job types (``external = true`` in the retry config), run
by another process, in any language, over the HTTP API (docs/api.md, "External workers"). They
get the same state machine, budgets, backoff, dead letters, degradation, sweeps and events as a
job run in this process: only who runs the task differs.

    claim      due dispatches of the asked types' queues are fetched, and each job claimed
               (RUNNING, attempt + 1, a new lease, job.running), as an in-process worker's
               fetch does; the external worker gets the attempt and its lease token
    heartbeat  the job's heartbeat is refreshed if the attempt still holds the lease
    complete   success, a classified failure, or "retry later": the outcome an in-process
               attempt would have had (orchestrator.runtime.outcomes), written with the end of
               the dispatch; refused when the attempt no longer holds the lease
    calls      each LLM call admitted before it is sent, its usage recorded after
               (orchestrator.runtime.external_calls)
    output     a batch of the attempt's live output (docs/output.md), appended to the job's by
               the statement an in-process attempt's batches use, held to the type's size cap

One rule for every report: it is taken only from the attempt that holds the job's lease; any
other (an unknown job, one never claimed, one finished or taken over, a wrong attempt or token)
is StaleLease, the same refusal whatever the reason, so that a report without the lease learns
nothing about the job.

The API server is the Procrastinate worker of these dispatches (its registry row): they stay
``doing`` under it while an external worker holds the lease. An external worker that dies stops
heartbeating; the zombie sweep takes its job, settles its dispatch and gives the job a new one,
which another external worker claims.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, TypeVar
from uuid import UUID

import psycopg
from procrastinate import manager

from orchestrator.domain.classification import Classified, ErrorClass
from orchestrator.domain.errors import InvalidOutput, OrchestratorError, StaleLease
from orchestrator.domain.events import Fault
from orchestrator.domain.failures import Failures
from orchestrator.domain.job_types import JobType
from orchestrator.domain.models import Claim
from orchestrator.domain.secrets import redact
from orchestrator.domain.states import Status
from orchestrator.runtime.external_calls import ExternalCalls, end_attempt
from orchestrator.runtime.loops import keep_running
from orchestrator.runtime.metrics import Metrics
from orchestrator.runtime.outcomes import (
    Completed,
    Outcome,
    OutcomeWriter,
    named,
    of_failure,
    terminal,
)
from orchestrator.runtime.wakeups import Wakeups
from orchestrator.settings import Settings
from orchestrator.storage.applications import application_of
from orchestrator.storage.database import OwnConnection
from orchestrator.storage.dispatches import Dispatch
from orchestrator.storage.jobs import Held
from orchestrator.storage.output import Batch, Written
from orchestrator.storage.stores import Stores
from retry_config import LiveConfig

logger = logging.getLogger("orchestrator.external")
T = TypeVar("T")

#: How a failure an external worker reports may be classified (VALID is no failure).
REPORTABLE = (
    ErrorClass.TRANSIENT_APP,
    ErrorClass.TRANSIENT_INFRA,
    ErrorClass.PERMANENT,
    ErrorClass.INVALID_OUTPUT,
)


class NotExternal(OrchestratorError):
    """A claim named a job type that is not external (HTTP 422)."""

    code = "JOB_TYPE_NOT_EXTERNAL"


@dataclass(frozen=True)
class ExternalTask:
    """What a claim hands an external worker."""

    claim: Claim
    #: Heartbeat at least this often (seconds) ...
    heartbeat_interval: float
    #: ... or the sweep takes the job once its last heartbeat is this old.
    lease_expires_at: datetime
    #: The attempt's wall-clock limit (the job timeout), after which the sweep takes it.
    deadline_at: datetime


@dataclass(frozen=True)
class Succeeded:
    output: Any


@dataclass(frozen=True)
class FailedReport:
    message: str
    code: str
    classification: ErrorClass
    stack: str | None = None


@dataclass(frozen=True)
class RetryLaterReport:
    seconds: float
    message: str


Report = Succeeded | FailedReport | RetryLaterReport
ReplayMode = Literal["succeed", "force_fail", "transient_fail"]


class ExternalRuns:
    """The API server's side of external workers: one Procrastinate registry entry for their
    dispatches, one listener that hears when work arrives, one connection for completions."""

    def __init__(
        self,
        *,
        dsn: str,
        stores: Stores,
        settings: Settings,
        config: LiveConfig,
        job_types: Mapping[str, JobType],
        failures: Failures,
        metrics: Metrics,
        host: str,
        declares: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.stores = stores
        self.declares = declares  # what this server declares, fingerprinted (applications.md)
        self.settings = settings
        self.config = config
        self.job_types = job_types
        self.failures = failures
        self.metrics = metrics
        self.host = host
        self.rng = random.Random()
        self.worker_id: int | None = None
        self.writer = OutcomeWriter(
            stores.dispatches, stores.jobs, OwnConnection(dsn, "external completions"), metrics
        )
        #: Their attempts' LLM calls, admitted and recorded (orchestrator.runtime.external_calls).
        self.calls = ExternalCalls(stores, self.writer, metrics)
        self._fetch_connection = OwnConnection(dsn, "external fetch")
        self._fetching = asyncio.Lock()  # one fetch at a time on its connection
        self._work = asyncio.Event()  # replaced at each wake-up; waiters hold the one they saw
        queues = sorted(set(config.current.external.values()))  # fixed at start-up
        self.wakeups = Wakeups(
            dsn=dsn,
            liveness=stores.liveness,
            wake=self._wake,
            notified=lambda channel, notification: self._wake(),
            refresh_interval=settings.fetch_polling_interval,
            channels=tuple(manager.get_channel_for_queues(queues)),
        )

    async def run(self) -> None:
        """Keep the registry entry and the listener alive until cancelled."""
        await self._register()
        try:
            await asyncio.gather(
                keep_running("external workers' registry", self._registry_heartbeat),
                keep_running("external workers' wake-ups", self.wakeups.run),
            )
        finally:
            with contextlib.suppress(Exception):
                await self._fetch_connection.close()
                await self.writer.connection.close()

    # -- claim -----------------------------------------------------------------------------

    async def claim(
        self,
        job_types: Sequence[str],
        *,
        worker: str,
        limit: int,
        wait: float,
        check: Callable[[], Awaitable[object]],
        check_every: float,
    ) -> list[ExternalTask]:
        """Up to ``limit`` jobs of these external types, claimed for ``worker``; waits up to
        ``wait`` seconds for one to come due when none is (a long-poll), else []. ``check()``
        runs before each fetch and every ``check_every`` seconds of the wait: it raises to end
        it (the worker's token was revoked), and nothing is claimed after it has."""
        queues = sorted({self._queue_of(name) for name in job_types})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            await check()
            seen = self._work
            tasks = await self._fetch(queues, worker=worker, limit=limit)
            left = deadline - loop.time()
            if tasks or left <= 0:
                return tasks
            fetch_at = loop.time() + min(left, self.settings.fetch_polling_interval)
            while not seen.is_set() and (quiet := fetch_at - loop.time()) > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(seen.wait(), min(quiet, check_every))
                await check()

    def _queue_of(self, job_type: str) -> str:
        known = self.job_types.get(job_type)
        if known is None or not known.is_external:
            external = sorted(self.config.current.external)
            raise NotExternal(f"job type {job_type!r} is not external (external: {external})")
        return self.config.current.queue_of(job_type)

    async def _fetch(self, queues: list[str], *, worker: str, limit: int) -> list[ExternalTask]:
        async def fetch(worker_id: int) -> list[Dispatch]:
            async with self._fetching, self._fetch_connection.connection() as conn:
                return await self.stores.dispatches.fetch(
                    limit=limit, queues=queues, worker_id=worker_id, worker=worker, conn=conn
                )

        worker_id, dispatches = await self._registered(fetch)
        tasks = []
        for dispatch in dispatches:
            claim = await self._claim_of(dispatch, worker_id=worker_id, worker=worker)
            if claim is not None:
                self.metrics.attempt_started(claim, dispatch.due_at(claim))
                tasks.append(self._task(claim))
        return tasks

    async def _claim_of(self, dispatch: Dispatch, *, worker_id: int, worker: str) -> Claim | None:
        claim = dispatch.claim
        if dispatch.claim_later:
            claim = await self.stores.dispatches.claim(dispatch, worker_id=worker_id, worker=worker)
        if claim is None:  # stale (its job was replaced, cancelled or claimed): end it
            await self.stores.dispatches.end(dispatch.id, "succeeded")
        return claim

    def _task(self, claim: Claim) -> ExternalTask:
        now = datetime.now(UTC)
        config = self.config.current.for_type(claim.job_type)
        timeout = claim.timeout_seconds or config.job_timeout_seconds
        return ExternalTask(
            claim=claim,
            heartbeat_interval=self.settings.heartbeat_interval,
            lease_expires_at=now + timedelta(seconds=self.settings.zombie_threshold),
            deadline_at=now + timedelta(seconds=timeout),
        )

    # -- heartbeat and completion ----------------------------------------------------------

    async def heartbeat(self, job_id: UUID, *, attempt: int, lease_token: UUID) -> datetime:
        """Refresh the lease of this attempt; when its lease lapses unless refreshed again.
        StaleLease (and nothing changes) when the attempt no longer holds it."""
        if await self.stores.jobs.held(job_id, attempt=attempt, lease_token=lease_token) is None:
            raise StaleLease(job_id, lease_token)
        held = await self.stores.liveness.heartbeat(
            {lease_token: job_id},
            zombie_threshold=self.settings.zombie_threshold,
            expiry_grace=self.settings.job_expiry_grace_seconds,
        )
        if lease_token not in held:
            raise StaleLease(job_id, lease_token)
        return datetime.now(UTC) + timedelta(seconds=self.settings.zombie_threshold)

    async def complete(
        self, job_id: UUID, *, attempt: int, lease_token: UUID, report: Report
    ) -> str:
        """Write what the attempt reported, as its outcome; the outcome's name (completed,
        retried, failed). StaleLease (nothing written) when it does not hold the lease."""
        held = await self.stores.jobs.held(job_id, attempt=attempt, lease_token=lease_token)
        if held is None:
            raise StaleLease(job_id, lease_token)
        return await end_attempt(
            self.writer, self.metrics, held, self._outcome(held, report), lease_token
        )

    async def write_output(
        self, job_id: UUID, *, attempt: int, lease_token: UUID, batch: int,
        chunks: list[dict[str, Any]],
    ) -> Written:  # fmt: skip
        """Append the attempt's output batch number ``batch`` (``chunks``: [{kind, body}], text
        or progress, written outside any step) to its job's, once (sent again under its number,
        it is not written twice), held to the job type's ``output_max_bytes``. StaleLease
        (nothing written) when the attempt does not hold the lease: checked here for its
        ``attempt`` too, then by the write itself, fenced by its token."""
        held = await self.stores.jobs.held(job_id, attempt=attempt, lease_token=lease_token)
        if held is None:
            raise StaleLease(job_id, lease_token)
        claim = held.claim
        max_bytes = self.config.current.for_type(claim.job_type).output_max_bytes
        outside_steps = [{**chunk, "step": None} for chunk in chunks]
        return await self.stores.output.write(Batch(claim.fence, batch, outside_steps, max_bytes))

    def _outcome(self, held: Held, report: Report) -> Outcome:
        claim, dispatch_id = held.claim, held.dispatch_id
        match report:
            case Succeeded(output=output):
                try:
                    result = self.job_types[claim.job_type].result_json(output)
                except InvalidOutput as exc:
                    fault = Fault(str(exc), "OUTPUT_NOT_JSON", ErrorClass.INVALID_OUTPUT,
                                  output=exc.output)  # fmt: skip
                    classified = Classified(ErrorClass.INVALID_OUTPUT, fault.code)
                    return terminal(claim, fault, classified, dispatch_id=dispatch_id,
                                    failures=self.failures)  # fmt: skip
                return Completed(result, held.running_ms)
            case FailedReport() as failed:
                classified = Classified(failed.classification, failed.code)
                fault = Fault(redact(failed.message), failed.code, failed.classification,
                              stack=redact(failed.stack) if failed.stack else None)  # fmt: skip
            case RetryLaterReport(seconds=seconds, message=message):
                classified = Classified(
                    ErrorClass.TRANSIENT_APP, "RETRY_LATER", retry_after=seconds
                )
                fault = Fault(redact(message), classified.code, ErrorClass.TRANSIENT_APP)
        return of_failure(
            claim, fault, classified, dispatch_id=dispatch_id,
            backoff=self.config.current.for_type(claim.job_type).backoff, rng=self.rng,
            failures=self.failures,
        )  # fmt: skip

    # -- the internal replay endpoint ------------------------------------------------------

    async def replay(self, job_id: UUID, mode: ReplayMode) -> str | None:
        """Run this waiting job now, as an attempt whose outcome is ``mode``: ``succeed``,
        ``force_fail`` (a permanent failure: the dead-letter path at once) or ``transient_fail``
        (a transient failure: retried while the type's budget lasts, then dead-lettered). The
        outcome's name; None when the job is not waiting (PENDING or RETRY)."""

        async def claim(worker_id: int) -> Held | None:
            return await self.stores.dispatches.claim_now(
                job_id, worker_id=worker_id, worker=f"{self.host}/replay"
            )

        _, held = await self._registered(claim)
        if held is None:
            return None
        reports: dict[ReplayMode, Report] = {
            "succeed": Succeeded({"replayed": True}),
            "force_fail": FailedReport(
                "forced failure (replay)", "REPLAY_FORCE_FAIL", ErrorClass.PERMANENT
            ),
            "transient_fail": FailedReport(
                "transient failure (replay)", "REPLAY_TRANSIENT_FAIL", ErrorClass.TRANSIENT_APP
            ),
        }
        outcome = self._outcome(held, reports[mode])
        if not await self.writer.write(held.dispatch_id, held.claim, outcome):
            # cancelled (or swept) meanwhile: say why, as any refused write does
            raise await self.stores.jobs.refusal(job_id, Status.COMPLETED, held.claim.lease_token)
        return named(outcome)[0]

    # -- the registry ----------------------------------------------------------------------

    async def _worker_id(self) -> int:
        if self.worker_id is None:
            await self._register()
        assert self.worker_id is not None
        return self.worker_id

    async def _registered(self, work: Callable[[int], Awaitable[T]]) -> tuple[int, T]:
        """``work(worker_id)``; once more under a new registry entry if the registry forgot
        this server's (silent too long: the database was away), as a worker does."""
        worker_id = await self._worker_id()
        try:
            return worker_id, await work(worker_id)
        except psycopg.errors.ForeignKeyViolation:
            await self._register()
            worker_id = await self._worker_id()
            return worker_id, await work(worker_id)

    async def _register(self) -> None:
        self.worker_id = await self.stores.dispatches.register_worker(
            prune_after=self.settings.stalled_worker_seconds
        )
        await self._record_config()

    async def _record_config(self) -> None:
        """Record beside its registry entry which retry config version this server runs (as a
        worker does)."""
        assert self.worker_id is not None
        application, declares = application_of(self.settings), self.declares()
        await self.stores.config_versions.record(
            self.worker_id, worker=f"{self.host}/w{self.worker_id}", config=self.config,
            application=application.name, declares=declares, runs='external',
        )  # fmt: skip
        await self.stores.flow.apply(self.config, application, declares)  # per version

    async def _registry_heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.settings.stalled_worker_seconds / 3)
            if not await self.stores.dispatches.beat_worker(await self._worker_id()):
                await self._register()
            await self._record_config()

    def _wake(self) -> None:
        woken, self._work = self._work, asyncio.Event()
        woken.set()
