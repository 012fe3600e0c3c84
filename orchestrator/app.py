"""The single entry point users hold: ``orc = Orchestrator()``.

@orc.job_type("summarise")
async def summarise(ctx: JobContext, payload: Doc) -> Summary: ...

async with orc:
    job_id = await orc.submit("summarise", {"url": ...})
    await orc.run_worker()

It is also where the layers are put together: the domain's policy (job types, the notifier, the
failure shaper), the stores on one pool, the maintenance services, and a worker per
``run_worker`` call, each given what it needs explicitly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import signal
import uuid
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar
from uuid import UUID

import procrastinate
import psycopg
from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

import retry_config
from checkpoints import ApprovalGate, CheckpointStore
from orchestrator.domain import crontab
from orchestrator.domain.classification import Classifier
from orchestrator.domain.degradation import Degrader, Fallback, TypeDegradation
from orchestrator.domain.errors import (
    ConfigError,
    DeadLetterError,
    InvalidArgument,
    InvalidPayload,
    InvalidTransition,
    OrchestratorError,
    SubmitError,
    UnknownJobType,
)
from orchestrator.domain.failures import Failures
from orchestrator.domain.flow import Flow, FlowKey, FlowKeyError, flow_of
from orchestrator.domain.ids import uuid7
from orchestrator.domain.job_types import JobType
from orchestrator.domain.models import DeadLetter, Job, JobEvent, SubmitResult
from orchestrator.domain.notices import Notifier
from orchestrator.domain.rollups import Stats, stats, window
from orchestrator.domain.schedules import Schedule, ScheduleView, define
from orchestrator.domain.secrets import Secrets
from orchestrator.domain.states import Status
from orchestrator.domain.storable import Text, refusal
from orchestrator.domain.traceparent import normalized, trace_id_of
from orchestrator.domain.usage import JobUsage, UsageTotal, groups_of
from orchestrator.runtime import logs, startup
from orchestrator.runtime.attempt import Toolkit
from orchestrator.runtime.config_reload import ConfigReload
from orchestrator.runtime.context import JobContext
from orchestrator.runtime.health import HealthServer
from orchestrator.runtime.metrics import Metrics, NoMetrics
from orchestrator.runtime.worker import Worker
from orchestrator.services import maintenance
from orchestrator.services.approvals import ApprovalDecisions
from orchestrator.services.fleet import FleetMetrics
from orchestrator.services.maintenance import Maintenance
from orchestrator.services.scheduler import Scheduler
from orchestrator.settings import Settings
from orchestrator.storage import database
from orchestrator.storage.database import Pool
from orchestrator.storage.migrate import MigrationReport, migrate
from orchestrator.storage.rows import ApprovalRecord, StepRecord
from orchestrator.storage.stores import Stores
from orchestrator.storage.usage import UsageFilters
from retry_config import MAX_VALUE, FlowLimit, LiveConfig, RetryConfig

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

    from orchestrator.runtime.tracing import Tracing

F = TypeVar("F", bound=Callable[[JobContext, Any], Awaitable[Any]])
logger = logging.getLogger("orchestrator")


JobKeyMode = Literal["replace", "preserve_run_at", "unsafe_dedupe"]


#: A W3C traceparent, as version 00 writes it (orchestrator.domain.traceparent).
Traceparent = Annotated[Text, AfterValidator(normalized)]


class JobSpec(BaseModel):
    """One job to submit; the options follow Graphile Worker's ``addJob``. Every bound is what
    the job table's columns hold, so nothing valid here can fail in the database."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_type: Text
    payload: Any = None
    agent_id: Text | None = Field(None, max_length=200)
    run_at: AwareDatetime | None = None
    priority: int = Field(0, ge=-(2**31) + 1, le=2**31 - 1, description="Lower runs first.")
    queue: Text | None = Field(None, min_length=1, max_length=128)
    max_retries: int | None = Field(None, ge=0, le=MAX_VALUE)
    job_key: Text | None = Field(None, min_length=1, max_length=512)
    job_key_mode: JobKeyMode = "replace"
    timeout_seconds: int | None = Field(None, gt=0, le=MAX_VALUE)
    trace_id: Text | None = Field(None, min_length=1, max_length=200)
    #: Whose job it is (docs/contracts.md, "Tenants"); none by default.
    tenant_id: Text | None = Field(None, min_length=1, max_length=200)
    #: The W3C trace context the job continues: its trace id becomes the job's trace_id.
    traceparent: Traceparent | None = None
    #: What the job costs in its limit's units (e.g. tokens; docs/flow-control.md); unset: its
    #: type's estimate, or 1.
    cost: int | None = Field(None, ge=0, le=MAX_VALUE)
    #: The most tokens the job's LLM calls may spend, all kinds counted; past it the next call
    #: fails the job with TOKEN_BUDGET_EXHAUSTED (docs/configuration.md). None: no budget.
    token_budget: int | None = Field(None, gt=0, le=2**63 - 1)

    @model_validator(mode="after")
    def _one_trace(self) -> JobSpec:
        if self.trace_id and self.traceparent and self.trace_id != trace_id_of(self.traceparent):
            raise ValueError("trace_id differs from the trace id of traceparent")
        return self


class Orchestrator:
    def __init__(
        self,
        *,
        settings: Settings | None = None,
        retry_config_path: Path | str | None = None,
        dsn: str | None = None,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        """``tracer_provider``: spans go there (tracing on, whatever ``settings.tracing``
        says); by default, to the global provider when ``ORCHESTRATOR_TRACING=otel``."""
        self.settings = settings or Settings()
        self.tracing = _tracing(self.settings, tracer_provider)
        #: The retry config in effect: a worker and ``serve`` reload it when its file changes.
        self.live_config = LiveConfig(
            retry_config.load(retry_config_path or self.settings.retry_config)
        )
        self._config_reload: ConfigReload | None = None
        self.job_types: dict[str, JobType] = {
            name: JobType.external(name) for name in self.retry_config.external
        }
        self.classifiers: list[Classifier] = []
        #: The schedules, by name: the retry config's, the crontab file's, then the code's.
        self.schedules: dict[str, Schedule] = {}
        self._schedules_of_config()
        self.secrets = Secrets(self.settings.secrets_dir)
        self.notifier = Notifier(
            submit_row=lambda job_type, payload: self._row(
                _spec(job_type=job_type, payload=payload)
            ),
            escalation_type=self.settings.escalation_job_type,
            escalation_target=self.settings.escalation_target,
            approval_type=self.settings.approval_job_type,
            approval_target=self.settings.approval_target,
        )
        self.failures = Failures(Degrader(of_type=self._degradation_of, notifier=self.notifier))
        self.procrastinate = procrastinate.App(connector=procrastinate.PsycopgConnector())
        maintenance.register(self.procrastinate, self.settings, self.retry_config)
        self._dsn = dsn
        self._pool: Pool | None = None
        self._opened: _Opened | None = None
        #: Undoes the connector swap of the current opening (App.replace_connector's context).
        self._connector_swap = contextlib.ExitStack()
        self.workers: list[Worker] = []  # the workers running in this process
        # Served by each worker's health port (/metrics).
        self.metrics = Metrics() if self.settings.metrics else NoMetrics()
        self.metrics.watch(lambda: self.workers)
        self.metrics.config_applied(self.retry_config.version)

    # -- definition ------------------------------------------------------------------------

    def job_type(
        self,
        name: str,
        *,
        fallback: Fallback | None = None,
        exhausted_message: str | None = None,
        cron: str | None = None,
        tz: str = "UTC",
        backfill_seconds: int = 0,
        tenant_id: str | None = None,
        cost: Callable[[Any], int] | None = None,
    ) -> Callable[[F], F]:
        """Register ``async def fn(ctx, payload) -> result`` as the job type ``name``.

        ``fallback(payload) -> content``: what a job of this type that FAILED for good keeps
        (logged and recorded) instead of a human being notified; ``exhausted_message``: what
        ``job.degraded`` and the human notification say when its transient failures spent the
        retry budget (orchestrator.domain.degradation). ``cron``: the type also runs by itself,
        at each tick of this expression read in ``tz`` (a schedule named after the type, with
        no payload, in ``tenant_id``; ``backfill_seconds``: ``schedule``'s). A malformed
        expression or zone is refused here (ConfigError naming it). ``cost(payload) -> int``:
        a job's estimated cost in its limit's units, given its typed payload, when the submit
        declares none (docs/flow-control.md).
        """
        schedule = None
        if cron is not None:
            schedule = define(
                name, name, source=f"job type {name!r}", cron=cron, tz=tz,
                backfill_seconds=backfill_seconds, tenant_id=tenant_id,
            )  # fmt: skip

        def decorate(fn: F) -> F:
            if name in self.retry_config.external:
                raise ValueError(
                    f"job type {name!r} is external in {self.retry_config.path}: external "
                    "workers run it over the API"
                )
            if name in self.job_types:
                raise ValueError(f"job type {name!r} is already registered")
            if schedule is not None:
                self._add_schedule(schedule)
            self.job_types[name] = JobType.from_function(
                name, fn, fallback=fallback, exhausted_message=exhausted_message, cost=cost
            )
            return fn

        return decorate

    def add_classifier(self, classifier: Classifier) -> Classifier:
        """Consult ``classifier(exc) -> Classified | None`` before the built-in rules."""
        self.classifiers.append(classifier)
        return classifier

    def check_definition(self) -> None:
        """Before a worker or the API server starts: the retry config fits the application
        (check_config), and the notification targets are usable (ConfigError naming what is
        wrong)."""
        self.check_config(self.retry_config)
        self._check_schedules()
        self.notifier.check()

    def check_config(self, config: RetryConfig) -> None:
        """``config`` names only known job types, and no in-process job type shares a queue
        with an external one: at start-up, and for each new version a reload reads."""
        config.check_names(self.known_job_types())
        external = {q: name for name, q in config.external.items()}
        clashes = [
            f"job type {name!r} is on queue {config.queue_of(name)!r}, the queue of "
            f"the external job type {external[config.queue_of(name)]!r}"
            for name, job_type in sorted(self.job_types.items())
            if not job_type.is_external and config.queue_of(name) in external
        ]
        if clashes:
            raise ConfigError(f"{config.path}: " + "; ".join(clashes))

    def known_job_types(self) -> set[str]:
        """The names a retry config may configure: the registered job types, the built-in
        ones, and the maintenance services."""
        return {*self.job_types, *retry_config.built_in_types(), *maintenance.NAMES}

    # -- the retry config in effect ---------------------------------------------------------

    @property
    def retry_config(self) -> RetryConfig:
        """The retry config in effect now (read it once per decision: a reload replaces it)."""
        return self.live_config.current

    @staticmethod
    def fixed_at_start(scope: str) -> frozenset[str]:
        """The fields of a scope (``[defaults]`` or a job type) that a reload leaves as they
        are, and a restart applies: the queues (the workers' lanes and the external types'
        queues are chosen at start-up), ``external`` (its job types are declared then),
        ``schedule`` (the schedules are defined when the application is built), and a
        maintenance service's ``worker_max_attempts`` (the retry strategy of its Procrastinate
        periodic task is fixed when the task is registered)."""
        fixed = {"queue", "external", "schedule"}
        if scope in maintenance.NAMES:
            fixed.add("worker_max_attempts")
        return frozenset(fixed)

    def hold_fixed(
        self, new: RetryConfig, running: RetryConfig
    ) -> tuple[RetryConfig, dict[str, list[str]]]:
        """``new`` as a reload applies it over ``running`` (the fields fixed at start-up kept),
        and the fields fixed at start-up that it would change, per scope."""
        return retry_config.hold_fixed(new, running, self.fixed_at_start, maintenance.NAMES)

    def config_reload(self) -> ConfigReload | None:
        """The watch of the retry config file that this process's workers and API server
        share (one per Orchestrator); None when the retry_config_poll_seconds setting is 0."""
        if self.settings.retry_config_poll_seconds == 0:
            return None
        if self._config_reload is None:
            self._config_reload = ConfigReload(
                self.live_config, check=self.check_config, hold=self.hold_fixed,
                metrics=self.metrics,
                interval=self.settings.retry_config_poll_seconds,
            )  # fmt: skip
        return self._config_reload

    def _degradation_of(self, job_type: str) -> TypeDegradation:
        known = self.job_types.get(job_type)
        return known.degradation if known is not None else TypeDegradation()

    # -- schedules (orchestrator.services.scheduler; docs/job-types.md, "Schedules") -------

    def schedule(self, name: str, job_type: str, *, cron: str, **options: Any) -> Schedule:
        """Run ``job_type`` at each tick of ``cron``: one ordinary job per tick, once in the
        fleet, its job key ``schedule/<name>/<tick>``. ``options``: ``tz`` (IANA, default
        UTC), ``backfill_seconds``, ``payload``, ``tenant_id``, ``priority``, ``queue``,
        ``max_retries`` (retry_config.ScheduleConfig). A malformed expression or zone, or a
        name taken, is refused here (ConfigError naming it)."""
        schedule = define(name, job_type, source="orc.schedule", cron=cron, **options)
        self._add_schedule(schedule)
        return schedule

    def _add_schedule(self, schedule: Schedule) -> None:
        taken = self.schedules.get(schedule.name)
        if taken is not None:
            raise ConfigError(
                f"{schedule.source}: schedule {schedule.name!r} is already defined ({taken.source})"
            )
        self.schedules[schedule.name] = schedule

    def _schedules_of_config(self) -> None:
        """The retry config's schedules (named after their types), then the crontab file's."""
        config = self.retry_config
        for name, options in config.schedules.items():
            source = f"{config.path}: job type {name!r}"
            self._add_schedule(Schedule(name=name, job_type=name, options=options, source=source))
        path = self.settings.crontab
        if path is None:
            return
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read the crontab: {exc.strerror or exc}") from None
        for schedule in crontab.parse(text, str(path)):
            self._add_schedule(schedule)

    def _check_schedules(self) -> None:
        """Each schedule's run can be submitted: its job type is known, its payload valid."""
        problems = []
        for schedule in self.schedules.values():
            try:
                self._runs(schedule, [datetime.now(UTC)])
            except OrchestratorError as exc:
                problems.append(f"{schedule.source}: schedule {schedule.name!r}: {exc}")
        if problems:
            raise ConfigError("\n".join(problems))

    def _runs(self, schedule: Schedule, ticks: list[datetime]) -> list[dict[str, Any]]:
        """The job rows of ``schedule``'s runs at ``ticks``: each due at its tick."""
        o = schedule.options
        return [
            self._row(
                _spec(
                    job_type=schedule.job_type, payload=o.payload, run_at=tick,
                    priority=o.priority, queue=o.queue, max_retries=o.max_retries,
                    tenant_id=o.tenant_id, job_key=schedule.job_key(tick),
                    job_key_mode="unsafe_dedupe",
                )
            )
            for tick in ticks
        ]  # fmt: skip

    def scheduler(self) -> Scheduler:
        """The scheduler of this application's schedules (``run()`` until cancelled): every
        worker and ``serve`` runs one."""
        return Scheduler(
            stores=self.stores, schedules=self.schedules, runs=self._runs,
            grace=self.settings.schedule_grace_seconds,
            max_sleep=self.settings.schedule_check_seconds,
        )  # fmt: skip

    async def list_schedules(self, *, tenants: Collection[str] | None = None) -> list[ScheduleView]:
        """Every schedule, by name, with its last and next run; ``tenants``: only theirs. One
        this application defines that no process has stored yet is shown as it will start."""
        _storable(tenants=tenants)
        views = await self.stores.schedules.list_schedules(tenants=tenants)
        stored = {view.name for view in views}
        now = datetime.now(UTC)
        views += [
            ScheduleView.defined(schedule, now)
            for schedule in self.schedules.values()
            if schedule.name not in stored
            and (tenants is None or schedule.options.tenant_id in tenants)
        ]
        return sorted(views, key=lambda view: view.name)

    async def pause_schedule(
        self, name: str, *, by: str, tenants: Collection[str] | None = None
    ) -> ScheduleView:
        """Hold ``name``: no tick of it runs until it is resumed (ScheduleNotFound for one
        unknown, or not of ``tenants``)."""
        _storable(name=name, by=by, tenants=tenants)
        await self.stores.schedules.sync(self.schedules.values())
        return await self.stores.schedules.pause(name, by=by, tenants=tenants)

    async def resume_schedule(
        self, name: str, *, tenants: Collection[str] | None = None
    ) -> ScheduleView:
        """Let ``name`` run again from its next tick: the ticks it missed while paused never
        run."""
        _storable(name=name, tenants=tenants)
        await self.stores.schedules.sync(self.schedules.values())
        return await self.stores.schedules.resume(name, tenants=tenants)

    # -- flow control (docs/flow-control.md) ------------------------------------------------

    async def flow_keys(self, key: str | None = None) -> list[FlowKey]:
        """Every flow key (or ``key``): its limit, running and waiting jobs, its window's
        spending, its pause and adaptive rate."""
        _storable(key=key)
        return await self.stores.flow.keys(key)

    async def pause_flow_key(
        self, key: str, *, seconds: float, reason: str = "", by: str = "api"
    ) -> FlowKey:
        """No job of ``key`` starts for ``seconds`` (FlowKeyNotFound for an unknown key)."""
        _storable(key=key, reason=reason, by=by)
        if not 0 < seconds <= 86_400 * 30:
            raise InvalidArgument(f"seconds: {seconds:g} is not in (0, 2592000]")
        until = datetime.now(UTC) + timedelta(seconds=seconds)
        await self.stores.flow.pause(key, until=until, reason=reason or "paused", by=by)
        return await self.stores.flow.get(key)

    async def resume_flow_key(self, key: str) -> FlowKey:
        """Lift ``key``'s pause, a provider's or an operator's, and its adaptive slow-down:
        its waiting jobs start at once, as its limits allow."""
        _storable(key=key)
        await self.stores.flow.resume(key)
        return await self.stores.flow.get(key)

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def dsn(self) -> str:
        if self._dsn is None:
            self._dsn = database.resolve_dsn(self.settings)
        return database.with_connect_timeout(self._dsn, self.settings.connect_timeout)

    async def wait_for_database(
        self, *, probe_port: int = 0, probe_host: str = "0.0.0.0",
        probe_setting: str = "ORCHESTRATOR_HEALTH_PORT",
    ) -> None:  # fmt: skip
        """Wait until the database answers, as a worker or ``serve`` does at start-up (its
        probe on ``probe_port`` answers not ready meanwhile); fail at once when no wait can
        help (orchestrator.runtime.startup). ``open`` then checks the schema."""
        dsn = await asyncio.to_thread(lambda: self.dsn)
        await startup.wait_for_database(
            dsn, probe_port=probe_port, probe_host=probe_host, probe_setting=probe_setting
        )

    async def open(self) -> None:
        if self._opened is not None:
            return
        dsn = await asyncio.to_thread(lambda: self.dsn)
        await database.check_database(dsn)
        pool = database.create_pool(
            dsn, min_size=self.settings.pool_min_size, max_size=self.settings.pool_max_size,
            timeout=self.settings.pool_timeout,
        )  # fmt: skip
        await pool.open()  # connects in the background; check_database already did once
        # A connector given an external pool keeps it even after close_async, so each opening
        # gets a fresh one, swapped in by App.replace_connector until close(). Procrastinate's
        # own writes (the periodic deferrer's) go through it.
        connector = procrastinate.PsycopgConnector()
        self._connector_swap.enter_context(self.procrastinate.replace_connector(connector))
        await connector.open_async(pool)
        self._opened = _Opened.on(pool, self)

    async def close(self) -> None:
        if self._opened is None:
            return
        await self.procrastinate.close_async()
        await self._opened.stores.queries.pool.close()
        self._connector_swap.close()
        self._opened = None

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
    def opened(self) -> _Opened:
        if self._opened is None:
            raise OrchestratorError("the orchestrator is not open: use `async with orc:`")
        return self._opened

    @property
    def stores(self) -> Stores:
        return self.opened.stores

    @property
    def maintenance(self) -> Maintenance:
        """The maintenance services (their ``run_once`` is what each periodic tick runs)."""
        return self.opened.maintenance

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
        tenant_id: str | None = None,
        traceparent: str | None = None,
        cost: int | None = None,
        token_budget: int | None = None,
        connection: psycopg.AsyncConnection[Any] | None = None,
    ) -> UUID:
        """Submit one job and return its id. With ``connection``, the job is written inside
        that connection's open transaction and disappears if it rolls back. A submit the
        database rolls back in a conflict (a deadlock) is run again; inside ``connection``'s
        transaction it cannot be, and raises TransactionConflict: run the transaction again.
        ``traceparent`` (W3C): the trace the job continues (docs/operations.md, "Traces").
        ``cost``: what it costs in its limit's units (docs/flow-control.md).
        ``token_budget``: the most tokens its LLM calls may spend (docs/configuration.md,
        "Token accounting and budgets")."""
        spec = _spec(
            job_type=job_type, payload=payload, agent_id=agent_id, run_at=run_at,
            priority=priority, queue=queue, max_retries=max_retries, job_key=job_key,
            job_key_mode=job_key_mode, timeout_seconds=timeout_seconds, trace_id=trace_id,
            tenant_id=tenant_id, traceparent=traceparent, cost=cost,
            token_budget=token_budget,
        )  # fmt: skip
        (job_id,) = await self.submit_many([spec], connection=connection)
        return job_id

    async def submit_many(
        self,
        jobs: Iterable[JobSpec | dict[str, Any]],
        *,
        connection: psycopg.AsyncConnection[Any] | None = None,
    ) -> list[UUID]:
        """Submit many jobs in one round trip; every spec is checked before anything is sent.
        With tracing, each job gets a span of its own (orchestrator.runtime.tracing)."""
        specs = [job if isinstance(job, JobSpec) else _spec(**job) for job in jobs]
        return [r.job_id for r in await self.submit_specs(specs, connection=connection)]

    async def submit_specs(
        self, specs: Sequence[JobSpec], *, connection: psycopg.AsyncConnection[Any] | None = None
    ) -> list[SubmitResult]:
        """As ``submit_many``, saying of each job whether it was created, or a keyed submit
        replaced or deduplicated a job already there."""
        rows = [self._row(spec) for spec in specs]
        if not rows:
            return []
        budgets = [spec.token_budget for spec in specs]
        if self.tracing is None:
            return await self._submit_rows(rows, budgets, connection)
        chosen = [spec.trace_id is not None or spec.traceparent is not None for spec in specs]
        with self.tracing.submits(rows, chosen) as spans:
            results = await self._submit_rows(rows, budgets, connection)
            self.tracing.submitted(spans, results)
        return results

    async def _submit_rows(
        self,
        rows: list[dict[str, Any]],
        budgets: list[int | None],
        connection: psycopg.AsyncConnection[Any] | None,
    ) -> list[SubmitResult]:
        """The jobs, and the token budgets of those given one, in one transaction (a job a
        keyed submit deduplicated keeps its own)."""
        if all(b is None for b in budgets):
            return await self.stores.jobs.submit(rows, connection)

        async def with_budgets(conn: psycopg.AsyncConnection[Any]) -> list[SubmitResult]:
            results = await self.stores.jobs.submit(rows, conn)
            given = [
                (r.job_id, b)
                for r, b in zip(results, budgets, strict=True)
                if b is not None and r.outcome != "deduplicated"
            ]
            if given:
                ids, tokens = zip(*given, strict=True)
                await self.stores.usage.set_budgets(ids, tokens, conn)
            return results

        if connection is not None:
            return await with_budgets(connection)
        return await self.stores.queries.in_transaction(with_budgets)

    def _row(self, spec: JobSpec) -> dict[str, Any]:
        job_type = self.job_types.get(spec.job_type)
        if job_type is None:
            raise UnknownJobType(spec.job_type, list(self.job_types))
        retry_config = self.retry_config
        config = retry_config.for_type(spec.job_type)
        queue = self._queue_of(spec, job_type)
        payload = job_type.payload_json(spec.payload)
        flow = _flow_of(spec, job_type, payload, retry_config.limit_of(spec.job_type))
        size = len(json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode())
        if size > self.settings.max_payload_bytes:
            raise InvalidPayload(
                spec.job_type,
                f"payload: {size} bytes, over the limit of {self.settings.max_payload_bytes} "
                "(ORCHESTRATOR_MAX_PAYLOAD_BYTES)",
            )
        return {
            "id": str(uuid7()),
            "job_type": spec.job_type,
            "payload": payload,
            "queue": queue,
            "priority": spec.priority,
            "run_at": spec.run_at.isoformat() if spec.run_at else None,
            "max_attempts": config.worker_max_attempts,
            "max_retries": config.app_max_retries if spec.max_retries is None else spec.max_retries,
            "job_key": spec.job_key,
            "job_key_mode": spec.job_key_mode,
            "agent_id": spec.agent_id,
            "trace_id": spec.trace_id
            or (trace_id_of(spec.traceparent) if spec.traceparent else None)
            or uuid.uuid4().hex,
            "traceparent": spec.traceparent,
            "tenant_id": spec.tenant_id,
            # Stored effective, so the claim can stamp the attempt's deadline (the backstop).
            "timeout_seconds": spec.timeout_seconds or config.job_timeout_seconds,
            "flow_key": flow and flow.key,
            "flow_limit": flow and flow.limit,
            "flow_cost": flow and flow.cost,
            "flow_share": flow and flow.share,
        }

    def _queue_of(self, spec: JobSpec, job_type: JobType) -> str:
        """An external type's jobs stay on its queue, and no other job goes there: in-process
        workers never take those queues, external workers take only them."""
        own = self.retry_config.queue_of(spec.job_type)
        if spec.queue is None or spec.queue == own:
            return own
        if job_type.is_external:
            raise SubmitError(
                f"queue: job type {spec.job_type!r} is external; its jobs go on its own queue "
                f"{own!r}"
            )
        external = {q: name for name, q in self.retry_config.external.items()}
        if spec.queue in external:
            raise SubmitError(
                f"queue: {spec.queue!r} is the queue of the external job type "
                f"{external[spec.queue]!r}"
            )
        return spec.queue

    # -- reads and operator actions --------------------------------------------------------

    async def get_job(self, job_id: UUID | str) -> Job:
        return await self.stores.jobs.get(_uuid(job_id))

    async def job_events(self, job_id: UUID | str) -> list[JobEvent]:
        return await self.stores.jobs.history(_uuid(job_id))

    async def list_jobs(
        self,
        *,
        status: Status | str | None = None,
        job_type: str | None = None,
        tenant_id: str | None = None,
        job_key: str | None = None,
        limit: int = 50,
    ) -> list[Job]:
        """Newest first, of the given status, type, tenant and job key (each: any when None;
        a key is per tenant, so without ``tenant_id`` every tenant's job with the key)."""
        _storable(job_type=job_type, tenant_id=tenant_id, job_key=job_key)
        return await self.stores.jobs.list_jobs(
            status=_status(status) if status else None,
            job_type=job_type,
            tenant_id=tenant_id,
            job_key=job_key,
            limit=limit,
        )

    async def cancel(self, job_id: UUID | str, *, reason: str = "", by: str = "api") -> None:
        _storable(reason=reason, by=by)
        with self._counting_refusals():
            await self.stores.jobs.cancel(_uuid(job_id), reason=reason, by=by)

    async def dead_letters(
        self,
        *,
        state: str | None = None,
        tenant_id: str | None = None,
        limit: int = 50,
        tenants: Collection[str] | None = None,
    ) -> list[DeadLetter]:
        """Newest first, in the given state and of the given tenant (each: any when None);
        ``tenants``: only letters of these tenants."""
        _storable(state=state, tenant_id=tenant_id, tenants=tenants)
        return await self.stores.dead_letters.list_letters(
            state=state, tenant_id=tenant_id, limit=limit, tenants=tenants
        )

    async def dead_letter(self, dead_letter_id: UUID | str) -> DeadLetter:
        return await self.stores.dead_letters.get(_uuid(dead_letter_id, "dead letter"))

    async def requeue_dead_letter(self, dead_letter_id: UUID | str) -> UUID:
        """The dead-letter flow's ``requeue``: a new job with the dead job's payload and tenant,
        linked to the letter."""
        letter_id = _uuid(dead_letter_id, "dead letter")
        stores = self.stores

        async def requeue(conn: psycopg.AsyncConnection[Any]) -> UUID:
            letter = await stores.dead_letters.lock(letter_id, conn)
            if letter.state not in ("recorded", "discard_requested"):
                raise DeadLetterError(f"dead letter {letter_id} is already {letter.state}")
            spec = self._row(
                JobSpec(
                    job_type=letter.job_type, payload=letter.payload, tenant_id=letter.tenant_id
                )
            )
            (result,) = await stores.jobs.submit([{**spec, "replay_of": str(letter_id)}], conn)
            await stores.dead_letters.mark_requeued(letter_id, result.job_id, conn)
            return result.job_id

        return await stores.queries.in_transaction(requeue)

    async def request_discard(self, dead_letter_id: UUID | str, *, by: str, reason: str) -> None:
        """The first of the two reviews a discard needs."""
        _storable(by=by, reason=reason)
        if not reason.strip():
            raise DeadLetterError("a discard needs a reason")
        await self.stores.dead_letters.request_discard(
            _uuid(dead_letter_id, "dead letter"), by, reason
        )

    async def confirm_discard(self, dead_letter_id: UUID | str, *, by: str) -> None:
        """Second review: by someone other than the requester."""
        _storable(by=by)
        await self.stores.dead_letters.confirm_discard(_uuid(dead_letter_id, "dead letter"), by)

    async def approve(self, approval_id: UUID | str, *, by: str, reason: str = "") -> None:
        """Approve a waiting step: its job resumes from its last checkpoint (no budget used)."""
        approval = _uuid(approval_id, "approval")
        _storable(by=by, reason=reason)
        with self._counting_refusals():
            await self.opened.decisions.decide(approval, "approved", by=by, reason=reason)

    async def reject(self, approval_id: UUID | str, *, by: str, reason: str) -> None:
        """Reject a waiting step: its job fails, or resumes down the task's rejection path."""
        approval = _uuid(approval_id, "approval")
        _storable(by=by, reason=reason)
        with self._counting_refusals():
            await self.opened.decisions.decide(approval, "rejected", by=by, reason=reason)

    async def approvals(
        self,
        *,
        status: str | None = "pending",
        limit: int = 50,
        tenants: Collection[str] | None = None,
    ) -> list[ApprovalRecord]:
        """Newest first; ``tenants``: only approvals of these tenants' jobs."""
        _storable(status=status, tenants=tenants)
        return await self.stores.approvals.list_approvals(
            status=status, limit=limit, tenants=tenants
        )

    @contextlib.contextmanager
    def _counting_refusals(self) -> Iterator[None]:
        """An operator's action the state machine refuses is counted (the database's own
        refusals are counted where they are raised: refused_by_database)."""
        try:
            yield
        except InvalidTransition as exc:
            if not exc.by_database:
                self.metrics.transition_refused(exc.source, exc.target, "request")
            raise

    def refused_by_database(self, exc: InvalidTransition) -> None:
        """The database's guard refused a status change: a write the code never makes on
        purpose (a bug, versions side by side, SQL by hand). Logged and counted: it pages."""
        logger.error("%s", exc)
        self.metrics.transition_refused(exc.source, exc.target, "database")

    async def job_steps(self, job_id: UUID | str) -> list[StepRecord]:
        """A job's checkpoints and side effects, in step order."""
        return await self.stores.jobs.steps(_uuid(job_id))

    async def stats(
        self,
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        step: int | None = None,
        by: Sequence[str] = (),
        tenants: Collection[str] | None = None,
    ) -> Stats:
        """The jobs that finished per step of ``step`` seconds in ``[since, until)`` (outcomes,
        retries by layer, durations) and the queue depth, split by ``by`` (``job_type``,
        ``queue``, ``tenant``), read from the rollups, never the jobs (docs/operations.md,
        "Rollups"); ``tenants``: only these tenants' jobs. Defaults: the last hour, by minute.
        A range or step the rollups cannot answer raises StatsQueryInvalid naming it."""
        _storable(tenants=tenants)
        asked = window(since=since, until=until, step=step, by=by, now=datetime.now(UTC))
        store = self.stores.rollups
        return stats(
            asked,
            await store.job_stats(asked, tenants=tenants),
            await store.queue_depth(asked, tenants=tenants),
            await store.rolled_up_to(),
        )

    async def llm_usage(
        self,
        *,
        by: str | Sequence[str] = ("tenant", "model"),
        since: datetime | None = None,
        until: datetime | None = None,
        tenant_id: str | None = None,
        agent_id: str | None = None,
        model: str | None = None,
        job_type: str | None = None,
        job_id: UUID | str | None = None,
        tenants: Collection[str] | None = None,
        limit: int = 1000,
    ) -> list[UsageTotal]:
        """LLM calls and their tokens recorded in ``[since, until)`` (either end open when
        None), grouped by ``by`` (any of ``job``, ``tenant``, ``agent``, ``model``,
        ``job_type``; none: one total), largest first, at most ``limit`` groups; narrowed by
        the other arguments; ``tenants``: only these tenants' jobs (docs/configuration.md,
        "Token accounting and budgets")."""
        groups = groups_of(by)
        _storable(
            tenant_id=tenant_id, agent_id=agent_id, model=model, job_type=job_type,
            tenants=tenants,
        )  # fmt: skip
        if since is not None and until is not None and until <= since:
            raise InvalidArgument(f"until ({until.isoformat()}) is not after since")
        if not 1 <= limit <= 100_000:
            raise InvalidArgument(f"limit: {limit} is not between 1 and 100000")
        filters = UsageFilters(
            since=since, until=until, tenant_id=tenant_id, agent_id=agent_id, model=model,
            job_type=job_type, job_id=_uuid(job_id) if job_id is not None else None,
            tenants=frozenset(tenants) if tenants is not None else None,
        )  # fmt: skip
        return await self.stores.usage.totals(groups, filters, limit=limit)

    async def job_usage(self, job_id: UUID | str) -> JobUsage:
        """A job's LLM calls with their tokens, their total, and its token budget."""
        job = await self.get_job(job_id)  # JobNotFound for no such job
        return await self.stores.usage.of_job(job.id)

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
        """Run a worker until it is stopped: by SIGTERM/SIGINT (with
        ``install_signal_handlers``), by ``stop_worker()``, or by cancelling this coroutine;
        each of them drains (docs/operations.md)."""
        self.check_definition()
        logs.make_visible(self.settings.log_format)
        opened = self.opened
        worker = Worker(
            dsn=self.dsn,
            stores=opened.stores,
            kit=Toolkit(
                job_types=dict(self.job_types),
                config=self.live_config,
                classifiers=tuple(self.classifiers),
                failures=self.failures,
                secrets=self.secrets,
                checkpoints=opened.checkpoints,
                gate=opened.gate,
                rng=random.Random(),
                metrics=self.metrics,
                tracing=self.tracing,
                usage=opened.stores.usage,
                flow=opened.stores.flow,
            ),
            metrics=self.metrics,
            procrastinate_app=self.procrastinate,
            services=opened.maintenance,
            settings=self.settings,
            concurrency=concurrency or self.settings.worker_concurrency,
            queues=self.queues_for(queues, job_types),
            excluded_queues=sorted(set(self.retry_config.external.values())),
            maintenance_queue=maintenance.QUEUE,
            wait=wait,
            name=name or "orchestrator",
            config_reload=self.config_reload(),
        )
        self.workers.append(worker)
        scheduling = asyncio.create_task(self.scheduler().run(), name="schedules")
        try:
            await worker.run(install_signal_handlers=install_signal_handlers)
        finally:
            self.workers.remove(worker)
            scheduling.cancel()
            await asyncio.gather(scheduling, return_exceptions=True)

    async def run_exporter(self, *, port: int | None = None) -> None:
        """Serve the fleet's metrics (orchestrator.services.fleet) on ``port`` (the
        exporter_port setting) at /metrics, with /healthz and /readyz, until cancelled or
        stopped by SIGTERM/SIGINT. One per fleet: every scrape reads the database."""
        fleet = FleetMetrics(
            self.stores.fleet, zombie_threshold=self.settings.zombie_threshold,
            max_tenants=self.settings.metrics_max_tenants,
            min_interval=self.settings.exporter_min_interval,
        )  # fmt: skip
        server = HealthServer(
            port=port or self.settings.exporter_port, ready=lambda: True,
            database_ok=self.stores.liveness.ping, metrics=fleet.exposition,
        )  # fmt: skip
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await server.start()
        try:
            await stop.wait()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            await server.close()

    def stop_worker(self) -> None:
        """Drain the workers this process runs, as SIGTERM would."""
        for worker in list(self.workers):
            worker.drain.begin("stop requested")

    def running_jobs(self) -> set[UUID]:
        """The jobs whose attempts the workers of this process are running."""
        return {job_id for worker in self.workers for job_id in worker.running_jobs()}

    def queues_for(
        self, queues: Sequence[str] | None, job_types: Sequence[str] | None
    ) -> list[str] | None:
        """The queues of a worker's jobs lane: the given ones, plus each given job type's
        queue; None (all queues) when neither is given. Maintenance has a lane of its own."""
        if not queues and not job_types:
            return None
        chosen = list(queues or [])
        for name in job_types or []:
            if name not in self.job_types:
                raise UnknownJobType(name, list(self.job_types))
            if self.job_types[name].is_external:
                raise ConfigError(f"job type {name!r} is external: external workers run it")
            chosen.append(self.retry_config.queue_of(name))
        return sorted(set(chosen))


class _Opened:
    """What an open Orchestrator holds: its stores on one pool, and what is built on them."""

    def __init__(
        self,
        stores: Stores,
        checkpoints: CheckpointStore,
        gate: ApprovalGate,
        decisions: ApprovalDecisions,
        maintenance: Maintenance,
    ) -> None:
        self.stores = stores
        self.checkpoints = checkpoints
        self.gate = gate
        self.decisions = decisions
        self.maintenance = maintenance

    @classmethod
    def on(cls, pool: Pool, orc: Orchestrator) -> _Opened:
        stores = Stores.on(pool, on_refused=orc.refused_by_database)
        checkpoints = CheckpointStore(stores.queries)
        decisions = ApprovalDecisions(stores=stores, failures=orc.failures)
        return cls(
            stores=stores,
            checkpoints=checkpoints,
            gate=ApprovalGate(stores.approvals, orc.notifier),
            decisions=decisions,
            maintenance=Maintenance.build(
                stores=stores, checkpoints=checkpoints, failures=orc.failures,
                decisions=decisions, config=orc.live_config, settings=orc.settings,
                on_run=orc.metrics.maintenance_run,
            ),
        )  # fmt: skip


def _tracing(settings: Settings, provider: TracerProvider | None) -> Tracing | None:
    """Tracing when it is asked for; None (off) otherwise, without importing opentelemetry."""
    if provider is None and settings.tracing == "off":
        return None
    try:
        from orchestrator.runtime.tracing import Tracing
    except ImportError as exc:
        if not (exc.name or "").startswith("opentelemetry"):
            raise
        raise ConfigError(
            "ORCHESTRATOR_TRACING=otel needs OpenTelemetry's API: pip install "
            "'agent-orchestrator[otel]'"
        ) from None
    return Tracing(provider)


def _flow_of(
    spec: JobSpec, job_type: JobType, payload: Any, limit: tuple[str, FlowLimit] | None
) -> Flow | None:
    """The job's flow under its type's limit (None: no limit): its key rendered from the
    payload (InvalidPayload naming the field the key needs), its cost declared or estimated."""
    if limit is None:
        return None
    name, config = limit
    cost = spec.cost if spec.cost is not None else job_type.cost_of(payload)
    try:
        return flow_of(
            name, config, job_type=spec.job_type, tenant_id=spec.tenant_id,
            agent_id=spec.agent_id, payload=payload, cost=cost,
        )  # fmt: skip
    except FlowKeyError as exc:
        raise InvalidPayload(spec.job_type, str(exc)) from None


def _spec(**options: Any) -> JobSpec:
    try:
        return JobSpec(**options)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
            for e in exc.errors(include_url=False)
        )
        raise SubmitError(f"invalid submit options: {problems}") from None


def _uuid(value: UUID | str, what: str = "job") -> UUID:
    if isinstance(value, UUID):
        return value
    try:
        return UUID(value)
    except ValueError:
        article = "an" if what[0] in "aeiou" else "a"
        raise InvalidArgument(f"not {article} {what} id: {value!r}") from None


def _status(value: Status | str) -> Status:
    try:
        return Status(value)
    except ValueError:
        known = ", ".join(s.value for s in Status)
        raise InvalidArgument(f"status: {value!r} is not a status (one of {known})") from None


def _storable(**texts: str | Collection[str] | None) -> None:
    """The string rule (orchestrator.domain.storable) for the operator calls' text: refused
    naming the argument, before anything is read or written (a submit's options are checked by
    JobSpec)."""
    for name, value in texts.items():
        for text in [value] if isinstance(value, str) else value or ():
            reason = refusal(text)
            if reason is not None:
                raise InvalidArgument(f"{name}: {reason}")
