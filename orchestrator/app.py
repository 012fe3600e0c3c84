"""The single entry point users hold: ``orc = Orchestrator()``.

@orc.job_type("summarise")
async def summarise(ctx: JobContext, payload: Doc) -> Summary: ...

async with orc:
    job_id = await orc.submit("summarise", {"url": ...})
    await orc.run_worker()
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar
from uuid import UUID

import procrastinate
import psycopg
from psycopg_pool import AsyncConnectionPool
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError

import retry_config
from checkpoints import CheckpointStore
from orchestrator import approvals, database, maintenance
from orchestrator.attempt import HOST, AttemptRunner
from orchestrator.classification import Classifier
from orchestrator.context import JobContext
from orchestrator.degradation import Degrader, Fallback
from orchestrator.dispatching import DispatchManager
from orchestrator.drain import Drain
from orchestrator.errors import (
    ConfigError,
    DeadLetterError,
    OrchestratorError,
    SubmitError,
    UnknownJobType,
)
from orchestrator.ids import uuid7
from orchestrator.migrate import MigrationReport, migrate
from orchestrator.models import DeadLetter, Job, JobEvent
from orchestrator.registry import JobType
from orchestrator.retry_strategy import GraphileRetryStrategy
from orchestrator.secrets import Secrets
from orchestrator.settings import Settings
from orchestrator.states import Status
from orchestrator.store import TASK_PREFIX, JobStore

F = TypeVar("F", bound=Callable[[JobContext, Any], Awaitable[Any]])
JobKeyMode = Literal["replace", "preserve_run_at", "unsafe_dedupe"]


class JobSpec(BaseModel):
    """One job to submit; the options follow Graphile Worker's ``addJob``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_type: str
    payload: Any = None
    agent_id: str | None = Field(None, max_length=200)
    run_at: AwareDatetime | None = None
    priority: int = Field(0, ge=-(2**31) + 1, le=2**31 - 1, description="Lower runs first.")
    queue: str | None = Field(None, min_length=1, max_length=128)
    max_retries: int | None = Field(None, ge=0)
    job_key: str | None = Field(None, min_length=1, max_length=512)
    job_key_mode: JobKeyMode = "replace"
    timeout_seconds: int | None = Field(None, gt=0)
    trace_id: str | None = Field(None, min_length=1, max_length=200)


class Orchestrator:
    def __init__(
        self,
        *,
        settings: Settings | None = None,
        retry_config_path: Path | str | None = None,
        dsn: str | None = None,
    ) -> None:
        self.settings = settings or Settings()
        self.retry_config = retry_config.load(retry_config_path or self.settings.retry_config)
        self.job_types: dict[str, JobType] = {}
        self.classifiers: list[Classifier] = []
        self.procrastinate = procrastinate.App(
            connector=procrastinate.PsycopgConnector(),
            periodic_defaults={"max_delay": self.settings.periodic_max_delay},
        )
        self.dispatches = DispatchManager(
            self.procrastinate.connector, task_prefix=TASK_PREFIX, worker_label=HOST
        )
        self.procrastinate.job_manager = self.dispatches
        self._dsn = dsn
        self._pool: AsyncConnectionPool | None = None
        self._store: JobStore | None = None
        self._checkpoints: CheckpointStore | None = None
        self._runner: AttemptRunner | None = None
        self.drains: list[Drain] = []  # the workers running in this process, by their drain
        self.secrets = Secrets(self.settings.secrets_dir)
        self.degrader = Degrader(
            fallback_of=lambda name: getattr(self.job_types.get(name), "fallback", None),
            escalation_type=self.settings.escalation_job_type,
            escalation_target=self.settings.escalation_target,
            submit_row=lambda job_type, payload: self._row(
                _spec(job_type=job_type, payload=payload)
            ),
        )
        self.approval_notices = approvals.ApprovalNotices(
            job_type=self.settings.approval_job_type,
            target=self.settings.approval_target or self.settings.escalation_target,
            submit_row=lambda job_type, payload: self._row(
                _spec(job_type=job_type, payload=payload)
            ),
        )
        maintenance.register(self)

    # -- definition ------------------------------------------------------------------------

    def job_type(self, name: str, *, fallback: Fallback | None = None) -> Callable[[F], F]:
        """Register ``async def fn(ctx, payload) -> result`` as the job type ``name``.

        ``fallback(payload) -> content``: what a job of this type that FAILED for good keeps
        (logged and recorded) instead of a human being notified (orchestrator.degradation).
        """

        def decorate(fn: F) -> F:
            if name in self.job_types:
                raise ValueError(f"job type {name!r} is already registered")
            job_type = JobType.from_function(name, fn, fallback=fallback)
            config = self.retry_config.for_type(name)
            self.procrastinate.task(
                name=TASK_PREFIX + name,
                queue=config.queue or name,
                pass_context=True,
                retry=GraphileRetryStrategy(config.worker_max_attempts),
            )(self._run_attempt)
            self.job_types[name] = job_type
            return fn

        return decorate

    def add_classifier(self, classifier: Classifier) -> Classifier:
        """Consult ``classifier(exc) -> Classified | None`` before the built-in rules."""
        self.classifiers.append(classifier)
        return classifier

    async def _run_attempt(self, pctx: procrastinate.JobContext, job_id: str) -> None:
        assert pctx.job.id is not None
        await self.runner.run(pctx, job_id, self.dispatches.take_claim(pctx.job.id))

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def dsn(self) -> str:
        if self._dsn is None:
            self._dsn = database.resolve_dsn(self.settings)
        return self._dsn

    async def open(self) -> None:
        if self._pool is not None:
            return
        dsn = await asyncio.to_thread(lambda: self.dsn)
        pool = database.create_pool(
            dsn, min_size=self.settings.pool_min_size, max_size=self.settings.pool_max_size
        )
        await pool.open(wait=True)
        # A connector given an external pool keeps it even after close_async, so each opening
        # gets a fresh one (swapped the way App.replace_connector does).
        connector = procrastinate.PsycopgConnector()
        self.procrastinate.connector = self.procrastinate.job_manager.connector = connector
        await connector.open_async(pool)
        self._pool = pool
        self._store = JobStore(pool)
        self._checkpoints = CheckpointStore(pool, notice=self.approval_notices)
        self._runner = AttemptRunner(
            store=self._store,
            checkpoints=self._checkpoints,
            job_types=self.job_types,
            config=lambda: self.retry_config,
            classifiers=self.classifiers,
            dispatches=self.dispatches,
            degrade=self.degrader,
            secrets=self.secrets,
        )

    async def close(self) -> None:
        if self._pool is None:
            return
        await self.procrastinate.close_async()
        await self._pool.close()
        self._pool = self._store = self._checkpoints = self._runner = None

    async def __aenter__(self) -> Orchestrator:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def store(self) -> JobStore:
        if self._store is None:
            raise OrchestratorError("the orchestrator is not open: use `async with orc:`")
        return self._store

    @property
    def runner(self) -> AttemptRunner:
        if self._runner is None:
            raise OrchestratorError("the orchestrator is not open: use `async with orc:`")
        return self._runner

    async def migrate(self) -> MigrationReport:
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            return await migrate(conn)

    # -- submit ----------------------------------------------------------------------------

    async def submit(
        self,
        job_type: str,
        payload: Any = None,
        *,
        agent_id: str | None = None,
        run_at: datetime | None = None,
        priority: int = 0,
        queue: str | None = None,
        max_retries: int | None = None,
        job_key: str | None = None,
        job_key_mode: JobKeyMode = "replace",
        timeout_seconds: int | None = None,
        trace_id: str | None = None,
        connection: psycopg.AsyncConnection[Any] | None = None,
    ) -> UUID:
        """Submit one job and return its id. With ``connection``, the job is written inside
        that connection's open transaction and disappears if it rolls back."""
        spec = _spec(
            job_type=job_type, payload=payload, agent_id=agent_id, run_at=run_at,
            priority=priority, queue=queue, max_retries=max_retries, job_key=job_key,
            job_key_mode=job_key_mode, timeout_seconds=timeout_seconds, trace_id=trace_id,
        )  # fmt: skip
        (job_id,) = await self.submit_many([spec], connection=connection)
        return job_id

    async def submit_many(
        self,
        jobs: Iterable[JobSpec | dict[str, Any]],
        *,
        connection: psycopg.AsyncConnection[Any] | None = None,
    ) -> list[UUID]:
        """Submit many jobs in one round trip; every spec is checked before anything is sent."""
        rows = [self._row(job if isinstance(job, JobSpec) else _spec(**job)) for job in jobs]
        if not rows:
            return []
        results = await self.store.submit(rows, connection=connection)
        return [r.job_id for r in results]

    def _row(self, spec: JobSpec) -> dict[str, Any]:
        job_type = self.job_types.get(spec.job_type)
        if job_type is None:
            raise UnknownJobType(spec.job_type, list(self.job_types))
        config = self.retry_config.for_type(spec.job_type)
        return {
            "id": str(uuid7()),
            "job_type": spec.job_type,
            "payload": job_type.payload_json(spec.payload),
            "queue": spec.queue or config.queue or spec.job_type,
            "priority": spec.priority,
            "run_at": spec.run_at.isoformat() if spec.run_at else None,
            "max_attempts": config.worker_max_attempts,
            "max_retries": config.app_max_retries if spec.max_retries is None else spec.max_retries,
            "job_key": spec.job_key,
            "job_key_mode": spec.job_key_mode,
            "agent_id": spec.agent_id,
            "trace_id": spec.trace_id or uuid.uuid4().hex,
            # Stored effective, so the claim can stamp the attempt's deadline (the backstop).
            "timeout_seconds": spec.timeout_seconds or config.job_timeout_seconds,
        }

    # -- reads and operator actions --------------------------------------------------------

    async def get_job(self, job_id: UUID | str) -> Job:
        return await self.store.get_job(_uuid(job_id))

    async def job_events(self, job_id: UUID | str) -> list[JobEvent]:
        return await self.store.job_events(_uuid(job_id))

    async def list_jobs(
        self, *, status: Status | str | None = None, job_type: str | None = None, limit: int = 50
    ) -> list[Job]:
        return await self.store.list_jobs(
            status=Status(status) if status else None, job_type=job_type, limit=limit
        )

    async def cancel(self, job_id: UUID | str, *, reason: str = "", by: str = "api") -> None:
        await self.store.cancel(_uuid(job_id), {"reason": reason, "by": by})

    async def dead_letters(self, *, state: str | None = None, limit: int = 50) -> list[DeadLetter]:
        return await self.store.dead_letters(state=state, limit=limit)

    async def requeue_dead_letter(self, dead_letter_id: UUID | str) -> UUID:
        """Seed 003's ``requeue``: a new job with the dead job's payload, linked to the letter."""
        letter_id = _uuid(dead_letter_id)
        async with self.store.pool.connection() as conn, conn.transaction():
            letter = await self.store.lock_dead_letter(letter_id, conn)
            if letter.state not in ("recorded", "discard_requested"):
                raise DeadLetterError(f"dead letter {letter_id} is already {letter.state}")
            spec = self._row(JobSpec(job_type=letter.job_type, payload=letter.payload))
            (result,) = await self.store.submit(
                [{**spec, "replay_of": str(letter_id)}], connection=conn
            )
            await self.store.mark_dead_letter_requeued(letter_id, result.job_id, conn)
            return result.job_id

    async def request_discard(self, dead_letter_id: UUID | str, *, by: str, reason: str) -> None:
        """First of the two reviews seed 003 asks for before a dead letter is discarded."""
        if not reason.strip():
            raise DeadLetterError("a discard needs a reason")
        await self.store.request_dead_letter_discard(_uuid(dead_letter_id), by, reason)

    async def confirm_discard(self, dead_letter_id: UUID | str, *, by: str) -> None:
        """Second review: by someone other than the requester."""
        await self.store.confirm_dead_letter_discard(_uuid(dead_letter_id), by)

    async def approve(self, approval_id: UUID | str, *, by: str, reason: str = "") -> None:
        """Approve a waiting step: its job resumes from its last checkpoint (no budget used)."""
        await approvals.decide(self.store, _uuid(approval_id), "approved", by=by, reason=reason)

    async def reject(self, approval_id: UUID | str, *, by: str, reason: str) -> None:
        """Reject a waiting step: its job fails, or resumes down the task's rejection path."""
        await approvals.decide(self.store, _uuid(approval_id), "rejected", by=by, reason=reason)

    async def approvals(
        self, *, status: str | None = "pending", limit: int = 50
    ) -> list[dict[str, Any]]:
        return await self.store.approvals(status=status, limit=limit)

    async def job_steps(self, job_id: UUID | str) -> list[dict[str, Any]]:
        """A job's checkpoints and side effects, in step order."""
        return await self.store.job_steps(_uuid(job_id))

    # -- worker ----------------------------------------------------------------------------

    async def run_worker(
        self,
        *,
        concurrency: int | None = None,
        queues: Sequence[str] | None = None,
        job_types: Sequence[str] | None = None,
        wait: bool = True,
        install_signal_handlers: bool = True,
        name: str | None = None,
    ) -> None:
        from orchestrator.worker import run_worker

        try:
            self.degrader.check()
        except SubmitError as exc:
            raise ConfigError(
                f"ORCHESTRATOR_ESCALATION_TARGET cannot be submitted as a "
                f"{self.settings.escalation_job_type!r} job: {exc}"
            ) from None
        try:
            self.approval_notices.check()
        except SubmitError as exc:
            which = "APPROVAL" if self.settings.approval_target else "ESCALATION"
            raise ConfigError(
                f"ORCHESTRATOR_{which}_TARGET cannot be submitted as an approval notice "
                f"({self.settings.approval_job_type!r} job): {exc}"
            ) from None
        await run_worker(
            self,
            concurrency=concurrency or self.settings.worker_concurrency,
            queues=self.queues_for(queues, job_types),
            wait=wait,
            install_signal_handlers=install_signal_handlers,
            name=name,
        )

    def stop_worker(self) -> None:
        """Drain the workers this process runs, as SIGTERM would."""
        for drain in list(self.drains):
            drain.begin("stop requested")

    def queues_for(
        self, queues: Sequence[str] | None, job_types: Sequence[str] | None
    ) -> list[str] | None:
        """The Procrastinate queues a worker listens to: the given ones, plus each given job
        type's queue, plus the maintenance queue; None (all queues) when neither is given."""
        if not queues and not job_types:
            return None
        chosen = list(queues or [])
        for name in job_types or []:
            if name not in self.job_types:
                raise UnknownJobType(name, list(self.job_types))
            chosen.append(self.retry_config.for_type(name).queue or name)
        chosen.append(maintenance.QUEUE)
        return sorted(set(chosen))


def _spec(**options: Any) -> JobSpec:
    try:
        return JobSpec(**options)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
            for e in exc.errors(include_url=False)
        )
        raise SubmitError(f"invalid submit options: {problems}") from None


def _uuid(value: UUID | str) -> UUID:
    if isinstance(value, UUID):
        return value
    try:
        return UUID(value)
    except ValueError:
        raise OrchestratorError(f"not a job id: {value!r}") from None
