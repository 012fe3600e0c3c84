"""The single entry point users hold: ``orc = Orchestrator()``.

@orc.job_type("summarise")
async def summarise(ctx: JobContext, payload: Doc) -> Summary: ...

async with orc:
    job_id = await orc.submit("summarise", {"url": ...})
    await orc.run_worker()

It is also where the layers are put together: the domain's policy (job types, the notifier, the
failure shaper), the stores on one pool, the maintenance services, and a worker per
``run_worker`` call, each given what it needs explicitly. Each method hands its work to the
module of its concern (orchestrator.facade), given the objects that concern needs.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Collection, Iterable, Sequence
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any
from uuid import UUID

import procrastinate
import psycopg

import retry_config
from orchestrator.domain.applications import Application, Applications
from orchestrator.domain.classification import Classifier
from orchestrator.domain.dead_letters import Action, BulkReview, LetterFilter
from orchestrator.domain.degradation import Degrader, Fallback
from orchestrator.domain.dependencies import Dependency, ParentPolicy
from orchestrator.domain.errors import ConfigError, InvalidArgument, InvalidTransition
from orchestrator.domain.failures import Failures
from orchestrator.domain.flow import FlowKey
from orchestrator.domain.job_types import JobType
from orchestrator.domain.models import Awaited, DeadLetter, Job, JobEvent, SubmitResult
from orchestrator.domain.notices import Notifier
from orchestrator.domain.rollups import Stats
from orchestrator.domain.schedules import Schedule, ScheduleView
from orchestrator.domain.secrets import Secrets
from orchestrator.domain.states import Status
from orchestrator.domain.summary import FleetSummary
from orchestrator.domain.usage import JobUsage, UsageTotal
from orchestrator.facade import actions, exporter, reloads, schedules
from orchestrator.facade.actions import OperatorActions
from orchestrator.facade.definition import Definition, F, degradation_of
from orchestrator.facade.flow_keys import FlowKeys
from orchestrator.facade.lifecycle import Lifecycle, Opened
from orchestrator.facade.reads import Reads
from orchestrator.facade.reloads import ConfigWatch
from orchestrator.facade.schedules import Schedules
from orchestrator.facade.stats import Statistics
from orchestrator.facade.submit import JobKeyMode, JobRows, JobSpec, Submitter, job_spec
from orchestrator.facade.summary import fleet_summary
from orchestrator.facade.workers import Workers
from orchestrator.runtime.config_reload import ConfigReload
from orchestrator.runtime.metrics import Metrics, NoMetrics
from orchestrator.runtime.worker import Worker
from orchestrator.services import maintenance
from orchestrator.services.maintenance import Maintenance
from orchestrator.services.scheduler import Scheduler
from orchestrator.settings import Settings
from orchestrator.storage.applications import application_of
from orchestrator.storage.migrate import MigrationReport, Plan
from orchestrator.storage.rows import ApprovalRecord, StepRecord
from orchestrator.storage.stores import Stores
from retry_config import LiveConfig, RetryConfig

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

    from orchestrator.runtime.tracing import Tracing

__all__ = ["JobSpec", "Orchestrator"]


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
        self.job_types: dict[str, JobType] = {
            name: JobType.external(name) for name in self.retry_config.external
        }
        self.classifiers: list[Classifier] = []
        #: The schedules, by name: the retry config's, the crontab file's, then the code's.
        self.schedules: dict[str, Schedule] = schedules.configured(
            self.retry_config, self.settings.crontab
        )
        self.secrets = Secrets(self.settings.secrets_dir)
        rows = JobRows(self.job_types, self.live_config, self.settings)
        self._rows = rows
        self.notifier = Notifier(
            submit_row=lambda job_type, payload: rows.row(
                job_spec(job_type=job_type, payload=payload)
            ),
            escalation_type=self.settings.escalation_job_type,
            escalation_target=self.settings.escalation_target,
            approval_type=self.settings.approval_job_type,
            approval_target=self.settings.approval_target,
        )
        self.failures = Failures(
            Degrader(
                of_type=functools.partial(degradation_of, self.job_types), notifier=self.notifier
            )
        )
        self.procrastinate = procrastinate.App(connector=procrastinate.PsycopgConnector())
        maintenance.register(self.procrastinate, self.settings, self.retry_config)
        self.workers: list[Worker] = []  # the workers running in this process
        # Served by each worker's health port (/metrics).
        self.metrics = Metrics() if self.settings.metrics else NoMetrics()
        self.metrics.watch(lambda: self.workers)
        self.metrics.config_applied(self.retry_config.version)
        self._lifecycle = Lifecycle(
            settings=self.settings, dsn=dsn, procrastinate_app=self.procrastinate,
            failures=self.failures, notifier=self.notifier, config=self.live_config,
            metrics=self.metrics, on_refused=self.refused_by_database,
        )  # fmt: skip
        self._schedules = Schedules(
            self.schedules, rows, self.settings, self._lifecycle, self.live_config
        )
        self._definition = Definition(
            self.job_types, self.classifiers, self.live_config, self._schedules, self.notifier
        )
        self._config_watch = ConfigWatch(
            self.live_config, check=self._definition.check_config, settings=self.settings,
            metrics=self.metrics,
            # a change holds every worker at once
            applied=lambda: self._lifecycle.apply_flow_limits(self.declares()),
        )  # fmt: skip
        self._submitter = Submitter(rows, self._lifecycle, self.tracing)
        self._reads = Reads(self._lifecycle, self.settings.stalled_worker_seconds)
        self._actions = OperatorActions(self._lifecycle, rows, self.metrics)
        self._flow_keys = FlowKeys(self._lifecycle)
        self._statistics = Statistics(self._lifecycle)
        self._workers = Workers(
            self.workers, definition=self._definition, config=self.live_config,
            settings=self.settings, lifecycle=self._lifecycle, schedules=self._schedules,
            config_watch=self._config_watch, failures=self.failures, secrets=self.secrets,
            metrics=self.metrics, tracing=self.tracing, procrastinate_app=self.procrastinate,
            child_rows=rows.children,
        )  # fmt: skip

    # -- definition (orchestrator.facade.definition) ----------------------------------------

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
        on_parent_failure: ParentPolicy = "cancel",
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
        declares none (docs/flow-control.md). ``on_parent_failure``: what a job of the type does
        when a job it depends on fails for good or is cancelled, unless its submit says
        (``cancel``, ``run`` or ``wait``: docs/workflows.md).
        """
        return self._definition.job_type(
            name, fallback=fallback, exhausted_message=exhausted_message, cron=cron, tz=tz,
            backfill_seconds=backfill_seconds, tenant_id=tenant_id, cost=cost,
            on_parent_failure=on_parent_failure,
        )  # fmt: skip

    def add_classifier(self, classifier: Classifier) -> Classifier:
        """Consult ``classifier(exc) -> Classified | None`` before the built-in rules."""
        return self._definition.add_classifier(classifier)

    def check_definition(self) -> None:
        """Before a worker or the API server starts: the retry config fits the application
        (check_config), and the notification targets are usable (ConfigError naming what is
        wrong)."""
        self._definition.check()

    async def check_schedules(self) -> None:
        """Once open, before the API server starts its scheduler: each schedule's run gets its
        flow key (ConfigError naming the schedules whose payload lacks a field it names)."""
        await self._schedules.check_keys()

    def check_config(self, config: RetryConfig) -> None:
        """``config`` names only known job types, and no in-process job type shares a queue
        with an external one: at start-up, and for each new version a reload reads."""
        self._definition.check_config(config)

    def known_job_types(self) -> set[str]:
        """The names a retry config may configure: the registered job types, the built-in
        ones, and the maintenance services."""
        return self._definition.known_job_types()

    @property
    def application(self) -> Application:
        """The application this process belongs to (docs/applications.md)."""
        return application_of(self.settings)

    def declares(self) -> str:
        """The fingerprint of what this process declares of the shared rows (its limits, its
        schedules; docs/applications.md)."""
        return self._schedules.declares()

    # -- the retry config in effect (orchestrator.facade.reloads) ---------------------------

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
        return reloads.fixed_at_start(scope)

    def hold_fixed(
        self, new: RetryConfig, running: RetryConfig
    ) -> tuple[RetryConfig, dict[str, list[str]]]:
        """``new`` as a reload applies it over ``running`` (the fields fixed at start-up kept),
        and the fields fixed at start-up that it would change, per scope."""
        return reloads.hold_fixed(new, running)

    def config_reload(self) -> ConfigReload | None:
        """The watch of the retry config file that this process's workers and API server
        share (one per Orchestrator); None when the retry_config_poll_seconds setting is 0."""
        return self._config_watch.reload()

    # -- schedules (orchestrator.facade.schedules; docs/job-types.md, "Schedules") ---------

    def schedule(self, name: str, job_type: str, *, cron: str, **options: Any) -> Schedule:
        """Run ``job_type`` at each tick of ``cron``: one ordinary job per tick, once in the
        fleet, its job key ``schedule/<name>/<tick>``. ``options``: ``tz`` (IANA, default
        UTC), ``backfill_seconds``, ``payload``, ``tenant_id``, ``priority``, ``queue``,
        ``max_retries`` (retry_config.ScheduleConfig). A malformed expression or zone, or a
        name taken, is refused here (ConfigError naming it)."""
        return self._schedules.schedule(name, job_type, cron=cron, **options)

    def scheduler(self) -> Scheduler:
        """The scheduler of this application's schedules (``run()`` until cancelled): every
        worker and ``serve`` runs one."""
        return self._schedules.scheduler()

    async def list_schedules(self, *, tenants: Collection[str] | None = None) -> list[ScheduleView]:
        """Every schedule, by name, with its last and next run; ``tenants``: only theirs. One
        this application defines that no process has stored yet is shown as it will start."""
        return await self._schedules.views(tenants=tenants)

    async def pause_schedule(
        self, name: str, *, by: str, tenants: Collection[str] | None = None
    ) -> ScheduleView:
        """Hold ``name``: no tick of it runs until it is resumed (ScheduleNotFound for one
        unknown, or not of ``tenants``)."""
        return await self._schedules.pause(name, by=by, tenants=tenants)

    async def resume_schedule(
        self, name: str, *, tenants: Collection[str] | None = None
    ) -> ScheduleView:
        """Let ``name`` run again from its next tick: the ticks it missed while paused never
        run."""
        return await self._schedules.resume(name, tenants=tenants)

    # -- flow control (orchestrator.facade.flow_keys; docs/flow-control.md) -----------------

    async def flow_keys(self, key: str | None = None) -> list[FlowKey]:
        """Every flow key (or ``key``): its limit, running and waiting jobs, its window's
        spending, its pause and adaptive rate."""
        return await self._flow_keys.keys(key)

    async def pause_flow_key(
        self, key: str, *, seconds: float, reason: str = "", by: str = "api"
    ) -> FlowKey:
        """No job of ``key`` starts for ``seconds`` (FlowKeyNotFound for an unknown key)."""
        return await self._flow_keys.pause(key, seconds=seconds, reason=reason, by=by)

    async def resume_flow_key(self, key: str) -> FlowKey:
        """Lift ``key``'s pause, a provider's or an operator's, and its adaptive slow-down:
        its waiting jobs start at once, as its limits allow."""
        return await self._flow_keys.resume(key)

    # -- lifecycle (orchestrator.facade.lifecycle) ------------------------------------------

    @property
    def dsn(self) -> str:
        return self._lifecycle.dsn

    async def wait_for_database(
        self, *, probe_port: int = 0, probe_host: str = "0.0.0.0",
        probe_setting: str = "ORCHESTRATOR_HEALTH_PORT",
    ) -> None:  # fmt: skip
        """Wait until the database answers, as a worker or ``serve`` does at start-up (its
        probe on ``probe_port`` answers not ready meanwhile); fail at once when no wait can
        help (orchestrator.runtime.startup). ``open`` then checks the schema."""
        await self._lifecycle.wait_for_database(
            probe_port=probe_port, probe_host=probe_host, probe_setting=probe_setting
        )

    async def open(self) -> None:
        await self._lifecycle.open()

    async def close(self) -> None:
        await self._lifecycle.close()

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
    def opened(self) -> Opened:
        return self._lifecycle.opened

    @property
    def stores(self) -> Stores:
        return self.opened.stores

    @property
    def maintenance(self) -> Maintenance:
        """The maintenance services (their ``run_once`` is what each periodic tick runs)."""
        return self.opened.maintenance

    async def migrate(self) -> MigrationReport:
        return await self._lifecycle.migrate(self._rows.producers())

    async def plan_migrate(self) -> Plan:
        """What :meth:`migrate` would do to the database, changing nothing (``orchestrator
        migrate --plan``)."""
        return await self._lifecycle.plan_migrate(self._rows.producers())

    # -- submit (orchestrator.facade.submit) ------------------------------------------------

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
        depends_on: Sequence[UUID | str | Dependency] = (),
        connection: psycopg.AsyncConnection[Any] | None = None,
    ) -> UUID:
        """Submit one job and return its id. With ``connection``, the job is written inside
        that connection's open transaction and disappears if it rolls back. A submit the
        database rolls back in a conflict (a deadlock) is run again; inside ``connection``'s
        transaction it cannot be, and raises TransactionConflict: run the transaction again.
        ``traceparent`` (W3C): the trace the job continues (docs/operations.md, "Traces").
        ``cost``: what it costs in its limit's units (docs/flow-control.md).
        ``token_budget``: the most tokens its LLM calls may spend (docs/configuration.md,
        "Token accounting and budgets"). ``depends_on``: the jobs it waits for, by id, each
        maybe with its policy (``Dependency``; docs/workflows.md)."""
        spec = job_spec(
            job_type=job_type, payload=payload, agent_id=agent_id, run_at=run_at,
            priority=priority, queue=queue, max_retries=max_retries, job_key=job_key,
            job_key_mode=job_key_mode, timeout_seconds=timeout_seconds, trace_id=trace_id,
            tenant_id=tenant_id, traceparent=traceparent, cost=cost,
            token_budget=token_budget, depends_on=depends_on,
        )  # fmt: skip
        (job_id,) = await self.submit_many([spec], connection=connection)
        return job_id

    async def submit_many(
        self,
        jobs: Iterable[JobSpec | dict[str, Any]],
        *,
        connection: psycopg.AsyncConnection[Any] | None = None,
    ) -> list[UUID]:
        """Submit many jobs in one round trip; every spec is checked before anything is sent
        (its flow key by the statement, which writes nothing when it refuses one).
        With tracing, each job gets a span of its own (orchestrator.runtime.tracing)."""
        specs = [job if isinstance(job, JobSpec) else job_spec(**job) for job in jobs]
        return [r.job_id for r in await self.submit_specs(specs, connection=connection)]

    async def submit_specs(
        self, specs: Sequence[JobSpec], *, connection: psycopg.AsyncConnection[Any] | None = None
    ) -> list[SubmitResult]:
        """As ``submit_many``, saying of each job whether it was created, or a keyed submit
        replaced or deduplicated a job already there."""
        return await self._submitter.submit(specs, connection)

    # -- reads (orchestrator.facade.reads) --------------------------------------------------

    async def get_job(self, job_id: UUID | str) -> Job:
        return await self._reads.job(job_id)

    async def forget_application(self, name: str) -> list[str]:
        """Withdraw everything the application ``name``, gone for good, declares (refused while
        a process of it lives): the shared rows no other application declares go; what went."""
        (rule,) = Settings.model_fields["application"].metadata  # ORCHESTRATOR_APPLICATION's
        if not re.fullmatch(rule.pattern, name):
            raise InvalidArgument(
                f"name: {name!r} is not an application's name (lower-case letters, "
                "digits, '_', '.' and '-', starting with a letter, at most 63 characters)"
            )
        application = application_of(self.settings.model_copy(update={"application": name}))
        return await self._actions.forget_application(application)

    async def applications(self, *, tenants: Collection[str] | None = None) -> Applications:
        """The applications sharing the database (docs/applications.md), and the waiting jobs
        that no live one serves; ``tenants``: only what names them."""
        return await self._reads.applications(tenants=tenants)

    async def summary(self, *, tenants: Collection[str] | None = None) -> FleetSummary:
        """The fleet at a glance: unfinished jobs by status, the processes that run jobs, what
        waits unserved or held, what waits for a person, and what is wrong (``problems``, each
        with what to do); ``tenants``: only what concerns them."""
        return await fleet_summary(self._lifecycle, self.settings, tenants=tenants)

    async def job_events(self, job_id: UUID | str) -> list[JobEvent]:
        return await self._reads.events(job_id)

    async def parents(self, job_id: UUID | str) -> list[Awaited]:
        """The jobs ``job_id`` depends on, in order, each with how it ended so far and its
        result or failure (docs/workflows.md)."""
        return await self._reads.parents(job_id)

    async def children(
        self, job_id: UUID | str, *, after: UUID | None = None, limit: int = 100
    ) -> list[Awaited]:
        """The children ``job_id`` spawned (``step.spawn``), in the order made, a page after
        the child ``after`` (docs/workflows.md)."""
        return await self._reads.children(job_id, after=after, limit=limit)

    async def job_steps(self, job_id: UUID | str) -> list[StepRecord]:
        """A job's checkpoints and side effects, in step order."""
        return await self._reads.steps(job_id)

    async def list_jobs(
        self,
        *,
        status: Status | str | None = None,
        job_type: str | None = None,
        tenant_id: str | None = None,
        job_key: str | None = None,
        agent_id: str | None = None,
        created_after: datetime | None = None,
        created_before: datetime | None = None,
        limit: int = 50,
    ) -> list[Job]:
        """Newest first, of the given status, type, tenant, job key and agent, created in
        [``created_after``, ``created_before``) (each: any when None; a key is per tenant, so
        without ``tenant_id`` every tenant's job with the key): the API's filters."""
        return await self._reads.jobs(
            status=status, job_type=job_type, tenant_id=tenant_id, job_key=job_key,
            agent_id=agent_id, created_after=created_after, created_before=created_before,
            limit=limit,
        )  # fmt: skip

    async def dead_letters(
        self,
        *,
        state: str | None = None,
        job_type: str | None = None,
        tenant_id: str | None = None,
        error: str | None = None,
        limit: int = 50,
        tenants: Collection[str] | None = None,
    ) -> list[DeadLetter]:
        """Newest first: in the given state (``open``: awaiting review, ``all``, or one state;
        None: any), of the given type and tenant, whose error has ``error`` in its code,
        message or class (any case); ``tenants``: only letters of these
        tenants."""
        return await self._reads.dead_letters(
            state=state, job_type=job_type, tenant_id=tenant_id, error=error, limit=limit,
            tenants=tenants,
        )  # fmt: skip

    async def dead_letter(self, dead_letter_id: UUID | str) -> DeadLetter:
        return await self._reads.dead_letter(dead_letter_id)

    async def dead_letter_of_job(self, job_id: UUID | str) -> DeadLetter | None:
        """The job's latest dead letter, if it has one."""
        return await self._reads.dead_letter_of_job(job_id)

    async def approvals(
        self,
        *,
        status: str | None = "pending",
        limit: int = 50,
        tenants: Collection[str] | None = None,
    ) -> list[ApprovalRecord]:
        """Newest first; ``tenants``: only approvals of these tenants' jobs."""
        return await self._reads.approvals(status=status, limit=limit, tenants=tenants)

    # -- operator actions (orchestrator.facade.actions) -------------------------------------

    async def cancel(self, job_id: UUID | str, *, reason: str = "", by: str = "api") -> None:
        await self._actions.cancel(job_id, reason=reason, by=by)

    async def requeue_dead_letter(self, dead_letter_id: UUID | str) -> UUID:
        """The dead-letter flow's ``requeue``: a new job with the dead job's payload and tenant,
        linked to the letter."""
        return await self._actions.requeue_dead_letter(dead_letter_id)

    async def request_discard(self, dead_letter_id: UUID | str, *, by: str, reason: str) -> None:
        """The first of the two reviews a discard needs."""
        await self._actions.request_discard(dead_letter_id, by=by, reason=reason)

    async def confirm_discard(self, dead_letter_id: UUID | str, *, by: str) -> None:
        """Second review: by someone other than the requester."""
        await self._actions.confirm_discard(dead_letter_id, by=by)

    async def review_dead_letters(
        self, action: Action, ids: Sequence[UUID | str] | None = None, *,
        job_type: str | None = None, tenant_id: str | None = None, error: str | None = None,
        by: str = "", reason: str = "", tenants: Collection[str] | None = None,
    ) -> BulkReview:  # fmt: skip
        """``action`` (``requeue``, ``discard-request``, ``discard-confirm``) on the letters
        given by id, or (no ids) on those of the given type, tenant and error (as
        dead_letters'; none: all) in a state the action takes, at most BULK_MAX a call
        (``more``: call again), each in its own transaction; ``tenants``: only these tenants'
        letters. Each letter's outcome (docs/operations.md, "Dead letters")."""
        matching = LetterFilter(job_type, tenant_id, error)
        return await self._actions.review_dead_letters(
            action, ids, matching=matching, by=by, reason=reason, tenants=tenants
        )

    async def requeue_dead_letters(
        self, ids: Sequence[UUID | str] | None = None, *, job_type: str | None = None,
        tenant_id: str | None = None, error: str | None = None,
        tenants: Collection[str] | None = None,
    ) -> BulkReview:  # fmt: skip
        """Requeue these letters, or the open ones matching the filters (review_dead_letters)."""
        return await self.review_dead_letters(
            "requeue", ids, job_type=job_type, tenant_id=tenant_id, error=error, tenants=tenants
        )

    async def request_discards(
        self, ids: Sequence[UUID | str] | None = None, *, by: str, reason: str,
        job_type: str | None = None, tenant_id: str | None = None, error: str | None = None,
        tenants: Collection[str] | None = None,
    ) -> BulkReview:  # fmt: skip
        """The first review of each letter's discard (of the recorded ones)."""
        return await self.review_dead_letters(
            "discard-request", ids, job_type=job_type, tenant_id=tenant_id, error=error, by=by,
            reason=reason, tenants=tenants,
        )  # fmt: skip

    async def confirm_discards(
        self, ids: Sequence[UUID | str] | None = None, *, by: str,
        job_type: str | None = None, tenant_id: str | None = None, error: str | None = None,
        tenants: Collection[str] | None = None,
    ) -> BulkReview:  # fmt: skip
        """The second review of each letter's discard (of those requested): refused, letter by
        letter, where ``by`` is the person who requested it."""
        return await self.review_dead_letters(
            "discard-confirm", ids, job_type=job_type, tenant_id=tenant_id, error=error, by=by,
            tenants=tenants,
        )  # fmt: skip

    async def approve(self, approval_id: UUID | str, *, by: str, reason: str = "") -> None:
        """Approve a waiting step: its job resumes from its last checkpoint (no budget used)."""
        await self._actions.decide(approval_id, "approved", by=by, reason=reason)

    async def reject(self, approval_id: UUID | str, *, by: str, reason: str) -> None:
        """Reject a waiting step: its job fails, or resumes down the task's rejection path."""
        await self._actions.decide(approval_id, "rejected", by=by, reason=reason)

    def refused_by_database(self, exc: InvalidTransition) -> None:
        """The database's guard refused a status change: a write the code never makes on
        purpose (a bug, versions side by side, SQL by hand). Logged and counted: it pages."""
        actions.refused_by_database(self.metrics, exc)

    # -- stats and usage (orchestrator.facade.stats) ----------------------------------------

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
        return await self._statistics.stats(
            since=since, until=until, step=step, by=by, tenants=tenants
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
        return await self._statistics.llm_usage(
            by=by, since=since, until=until, tenant_id=tenant_id, agent_id=agent_id,
            model=model, job_type=job_type, job_id=job_id, tenants=tenants, limit=limit,
        )  # fmt: skip

    async def job_usage(self, job_id: UUID | str) -> JobUsage:
        """A job's LLM calls with their tokens, their total, and its token budget."""
        return await self._statistics.job_usage(job_id)

    # -- workers (orchestrator.facade.workers, orchestrator.facade.exporter) ----------------

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
        await self._workers.run(
            concurrency=concurrency, queues=queues, job_types=job_types, wait=wait,
            install_signal_handlers=install_signal_handlers, name=name,
        )  # fmt: skip

    async def run_exporter(self, *, port: int | None = None) -> None:
        """Serve the fleet's metrics (orchestrator.services.fleet) on ``port`` (the
        exporter_port setting) at /metrics, with /healthz and /readyz, until cancelled or
        stopped by SIGTERM/SIGINT. One per fleet: every scrape reads the database."""
        await exporter.serve(self.stores, self.settings, port=port)

    def stop_worker(self) -> None:
        """Drain the workers this process runs, as SIGTERM would."""
        self._workers.stop()

    def running_jobs(self) -> set[UUID]:
        """The jobs whose attempts the workers of this process are running."""
        return self._workers.running_jobs()

    def queues_for(
        self, queues: Sequence[str] | None, job_types: Sequence[str] | None
    ) -> list[str] | None:
        """The queues of a worker's jobs lane: the given ones, plus each given job type's
        queue; None (all queues) when neither is given. Maintenance has a lane of its own."""
        return self._workers.queues_for(queues, job_types)


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
