"""The workers this process runs: each built on the open stores from the application's
definition, with the scheduler of its schedules beside it, and drained on request."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING
from uuid import UUID

from checkpoints.children import ChildRows
from orchestrator.domain.errors import ConfigError, UnknownJobType
from orchestrator.domain.failures import Failures
from orchestrator.domain.secrets import Secrets
from orchestrator.facade.definition import Definition
from orchestrator.facade.lifecycle import Lifecycle
from orchestrator.facade.reloads import ConfigWatch
from orchestrator.facade.schedules import Schedules
from orchestrator.runtime import logs
from orchestrator.runtime.attempt import Toolkit
from orchestrator.runtime.metrics import Metrics
from orchestrator.runtime.output import OutputWrites
from orchestrator.runtime.worker import Worker
from orchestrator.services import maintenance
from orchestrator.settings import Settings
from retry_config import LiveConfig

if TYPE_CHECKING:
    import procrastinate

    from orchestrator.runtime.tracing import Tracing


class Workers:
    def __init__(
        self,
        running: list[Worker],
        *,
        definition: Definition,
        config: LiveConfig,
        settings: Settings,
        lifecycle: Lifecycle,
        schedules: Schedules,
        config_watch: ConfigWatch,
        failures: Failures,
        secrets: Secrets,
        metrics: Metrics,
        tracing: Tracing | None,
        procrastinate_app: procrastinate.App,
        child_rows: ChildRows,
    ) -> None:
        self._running = running
        self._child_rows = child_rows
        self._definition = definition
        self._config = config
        self._settings = settings
        self._lifecycle = lifecycle
        self._schedules = schedules
        self._config_watch = config_watch
        self._failures = failures
        self._secrets = secrets
        self._metrics = metrics
        self._tracing = tracing
        self._procrastinate = procrastinate_app

    async def run(
        self,
        *,
        concurrency: int | None,
        queues: Sequence[str] | None,
        job_types: Sequence[str] | None,
        wait: bool,
        install_signal_handlers: bool,
        name: str | None,
    ) -> None:
        self._definition.check()
        logs.make_visible(self._settings.log_format)
        opened = self._lifecycle.opened
        await self._schedules.check_keys()
        worker = Worker(
            dsn=self._lifecycle.dsn,
            stores=opened.stores,
            kit=Toolkit(
                job_types=dict(self._definition.job_types),
                config=self._config,
                classifiers=tuple(self._definition.classifiers),
                failures=self._failures,
                secrets=self._secrets,
                checkpoints=opened.checkpoints,
                gate=opened.gate,
                rng=random.Random(),
                metrics=self._metrics,
                graph=opened.stores.graph,
                child_rows=self._child_rows,
                output=OutputWrites(opened.stores.output),
                tracing=self._tracing,
                usage=opened.stores.usage,
                flow=opened.stores.flow,
            ),
            metrics=self._metrics,
            procrastinate_app=self._procrastinate,
            services=opened.maintenance,
            settings=self._settings,
            concurrency=concurrency or self._settings.worker_concurrency,
            queues=self.queues_for(queues, job_types),
            excluded_queues=sorted(set(self._config.current.external.values())),
            maintenance_queue=maintenance.QUEUE,
            wait=wait,
            name=name or "orchestrator",
            config_reload=self._config_watch.reload(),
            declares=self._schedules.declares,
        )
        self._running.append(worker)
        scheduling = asyncio.create_task(self._schedules.scheduler().run(), name="schedules")
        try:
            await worker.run(install_signal_handlers=install_signal_handlers)
        finally:
            self._running.remove(worker)
            scheduling.cancel()
            await asyncio.gather(scheduling, return_exceptions=True)

    def stop(self) -> None:
        for worker in list(self._running):
            worker.drain.begin("stop requested")

    def running_jobs(self) -> set[UUID]:
        return {job_id for worker in self._running for job_id in worker.running_jobs()}

    def queues_for(
        self, queues: Sequence[str] | None, job_types: Sequence[str] | None
    ) -> list[str] | None:
        if not queues and not job_types:
            return None
        known = self._definition.job_types
        chosen = list(queues or [])
        for name in job_types or []:
            if name not in known:
                raise UnknownJobType(name, list(known))
            if known[name].is_external:
                raise ConfigError(f"job type {name!r} is external: external workers run it")
            chosen.append(self._config.current.queue_of(name))
        return sorted(set(chosen))
