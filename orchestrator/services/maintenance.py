"""The maintenance services, and the Procrastinate periodic tasks that tick them.

    sweep_zombies      ZombieSweep       RUNNING jobs whose heartbeat went stale: RETRY or FAILED
    retry_safety_net   RetrySafetyNet    waiting jobs whose dispatch was lost: a new dispatch
    expire_approvals   ApprovalExpiry    approvals past their expiry: decided as expired
    prune_checkpoints  CheckpointPrune   checkpoints and ledger rows past their retention
    prune_finished     FinishedPrune     finished jobs past their retention, whole; old bookkeeping
    rollup_jobs        JobRollup         closed minutes' finished jobs into rollups, queue depth

Each is a small service with explicit dependencies and a ``run_once`` that works in bounded
batches and returns what it did (logged once per run). Each is ticked by a Procrastinate periodic
task on the ``maintenance`` queue, deferred by every worker's periodic deferrer: a unique row per
(task, tick) makes each tick run once in the fleet, and a tick missed by more than
``periodic_max_delay`` is skipped (no backfill). The worker that runs a tick hands the task its
services (``additional_context["services"]``). A tick's dispatch is retried as its entry in the
retry config says (``worker_max_attempts`` of the table named after the service).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import procrastinate

from checkpoints import CheckpointStore
from orchestrator.domain.failures import Failures
from orchestrator.services.approvals import ApprovalDecisions, ApprovalExpiry
from orchestrator.services.prune import CheckpointPrune
from orchestrator.services.retention import FinishedPrune
from orchestrator.services.retry_strategy import GraphileRetryStrategy
from orchestrator.services.rollup import JobRollup
from orchestrator.services.safety_net import RetrySafetyNet
from orchestrator.services.sweep import ZombieSweep
from orchestrator.settings import Settings
from orchestrator.storage.stores import Stores
from retry_config import LiveConfig, RetryConfig
from retry_config.names import MAINTENANCE_QUEUE

logger = logging.getLogger(__name__)

#: The queue the services tick on (retry_config.names: reserved, no job may go there).
QUEUE = MAINTENANCE_QUEUE
TASK_PREFIX = "orchestrator."  # Procrastinate task name of a service: TASK_PREFIX + its name
#: The services by name; each may have a table of that name in the retry config.
NAMES = (ZombieSweep.name, RetrySafetyNet.name, ApprovalExpiry.name, CheckpointPrune.name,
         FinishedPrune.name, JobRollup.name)  # fmt: skip


class Result(Protocol):
    @property
    def handled(self) -> int: ...

    def sentence(self) -> str:
        """What the run did, for its log line."""
        ...


class Service(Protocol):
    name: str

    async def run_once(self) -> Result: ...


#: Told of each run: the service's name and what it did (action -> rows), or None if it failed.
OnRun = Callable[[str, dict[str, int] | None], None]


@dataclass(frozen=True)
class Maintenance:
    sweep: ZombieSweep
    safety_net: RetrySafetyNet
    approval_expiry: ApprovalExpiry
    prune: CheckpointPrune
    finished: FinishedPrune
    rollup: JobRollup
    on_run: OnRun

    @classmethod
    def build(
        cls,
        *,
        stores: Stores,
        checkpoints: CheckpointStore,
        failures: Failures,
        decisions: ApprovalDecisions,
        config: LiveConfig,
        settings: Settings,
        on_run: OnRun,
    ) -> Maintenance:
        s = settings
        return cls(
            sweep=ZombieSweep(
                stores=stores, failures=failures, config=config, threshold=s.zombie_threshold,
                expiry_grace=s.job_expiry_grace_seconds, batch_size=s.sweep_batch_size,
                limit=s.sweep_limit,
            ),
            safety_net=RetrySafetyNet(
                stores=stores, grace_seconds=s.safety_net_grace_seconds,
                stalled_seconds=s.stalled_worker_seconds, batch_size=s.safety_net_batch_size,
            ),
            approval_expiry=ApprovalExpiry(
                stores=stores, decisions=decisions, batch_size=s.approvals_batch_size
            ),
            prune=CheckpointPrune(
                checkpoints=checkpoints, retention_days=s.checkpoint_retention_days,
                batch_size=s.prune_batch_size,
            ),
            finished=FinishedPrune(
                stores=stores,
                days=s.job_retention_days, failed_days=s.failed_job_retention_days,
                config=config,
                batch_size=s.retention_batch_size, run_seconds=s.retention_run_seconds,
                archive_dir=s.archive_dir,
            ),
            rollup=JobRollup(
                rollups=stores.rollups, batch_minutes=s.rollup_batch_minutes,
                settle_seconds=s.rollup_settle_seconds, retention_days=s.rollup_retention_days,
                hourly_retention_days=s.rollup_hourly_retention_days,
                prune_batch_size=s.prune_batch_size,
            ),
            on_run=on_run,
        )  # fmt: skip

    def service(self, name: str) -> Service:
        services: tuple[Service, ...] = (self.sweep, self.safety_net, self.approval_expiry,
                                         self.prune, self.finished, self.rollup)  # fmt: skip
        for service in services:
            if service.name == name:
                return service
        raise LookupError(f"no maintenance service named {name!r}")

    async def run(self, name: str) -> Result:
        """One run of the service ``name``, reported to ``on_run``, and logged (one warning
        in words) when it handled anything."""
        try:
            result = await self.service(name).run_once()
        except Exception:
            self.on_run(name, None)
            raise
        self.on_run(name, _rows(result))
        if result.handled:
            logger.warning("%s: %s", name, result.sentence())
        return result


def _rows(result: Any) -> dict[str, int]:
    """A result's counts by action (its fields: retried, failed, passed_over, ...); a flag
    (a bool, which Python counts as an int) is not a count of rows."""
    return {
        k: v
        for k, v in dataclasses.asdict(result).items()
        if isinstance(v, int) and not isinstance(v, bool)
    }


def register(app: procrastinate.App, settings: Settings, config: RetryConfig) -> None:
    """Declare the services' periodic tasks on ``app``, each with its retry strategy: fixed
    here, a reload of the retry config does not change it (a restart does)."""
    crons = {
        ZombieSweep.name: settings.sweep_cron,
        RetrySafetyNet.name: settings.safety_net_cron,
        ApprovalExpiry.name: settings.approvals_cron,
        CheckpointPrune.name: settings.prune_cron,
        FinishedPrune.name: settings.retention_cron,
        JobRollup.name: settings.rollup_cron,
    }
    for name, cron in crons.items():
        _tick(app, name, cron, config.for_type(name).worker_max_attempts)


def _tick(app: procrastinate.App, name: str, cron: str, attempts: int) -> None:
    @app.periodic(cron=cron, periodic_id=name)
    @app.task(
        name=TASK_PREFIX + name,
        queue=QUEUE,
        pass_context=True,
        retry=GraphileRetryStrategy(attempts),
    )
    async def tick(context: procrastinate.JobContext, timestamp: int) -> None:
        services: Maintenance = context.additional_context["services"]
        await services.run(name)
