"""The application's schedules (orchestrator.services.scheduler runs them; docs/job-types.md,
"Schedules"): defined by the retry config, the crontab file and the code, each name once, and
read, paused and resumed by operators."""

from __future__ import annotations

from collections.abc import Collection
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from orchestrator.domain import crontab
from orchestrator.domain.applications import fingerprint
from orchestrator.domain.errors import ConfigError, OrchestratorError
from orchestrator.domain.schedules import Schedule, ScheduleView, define
from orchestrator.facade.arguments import storable, tenants_named
from orchestrator.facade.lifecycle import Lifecycle
from orchestrator.facade.submit import JobRows, job_spec
from orchestrator.services.scheduler import Scheduler
from orchestrator.settings import Settings
from orchestrator.storage.applications import application_of
from retry_config import LiveConfig, RetryConfig


def configured(config: RetryConfig, crontab_file: Path | None) -> dict[str, Schedule]:
    """The retry config's schedules (named after their types), then the crontab file's: read
    when the application is built, before the code defines its own."""
    schedules: dict[str, Schedule] = {}
    for name, options in config.schedules.items():
        source = f"{config.path}: job type {name!r}"
        _add(schedules, Schedule(name=name, job_type=name, options=options, source=source))
    if crontab_file is None:
        return schedules
    try:
        text = crontab_file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"{crontab_file}: cannot read the crontab: {exc.strerror or exc}"
        ) from None
    for schedule in crontab.parse(text, str(crontab_file)):
        _add(schedules, schedule)
    return schedules


def _add(schedules: dict[str, Schedule], schedule: Schedule) -> None:
    taken = schedules.get(schedule.name)
    if taken is not None:
        raise ConfigError(
            f"{schedule.source}: schedule {schedule.name!r} is already defined ({taken.source})"
        )
    schedules[schedule.name] = schedule


class Schedules:
    """The schedules by name (the Orchestrator's ``schedules``), the job rows of their runs,
    and the operators' reads and pauses of them, stored."""

    def __init__(
        self,
        schedules: dict[str, Schedule],
        rows: JobRows,
        settings: Settings,
        lifecycle: Lifecycle,
        config: LiveConfig,
    ) -> None:
        self._schedules = schedules
        self._rows = rows
        self._settings = settings
        self._lifecycle = lifecycle
        self._config = config

    def schedule(self, name: str, job_type: str, *, cron: str, **options: Any) -> Schedule:
        schedule = define(name, job_type, source="orc.schedule", cron=cron, **options)
        self.add(schedule)
        return schedule

    def add(self, schedule: Schedule) -> None:
        _add(self._schedules, schedule)

    def check(self) -> None:
        """Each schedule's run can be submitted: its job type is known, its payload valid."""
        problems = []
        for schedule in self._schedules.values():
            try:
                self.runs(schedule, [datetime.now(UTC)])
            except OrchestratorError as exc:
                problems.append(f"{schedule.source}: schedule {schedule.name!r}: {exc}")
        if problems:
            raise ConfigError("\n".join(problems))

    async def check_keys(self) -> None:
        """Each schedule's run gets its flow key (the database renders it, by the rule a tick's
        submit follows), or a ConfigError names the schedules whose payload lacks a field their
        limit's key names: at start-up, once the database is open (``check`` cannot ask it)."""
        problems = []
        for schedule in self._schedules.values():
            (row,) = self.runs(schedule, [datetime.now(UTC)])
            try:
                await self._lifecycle.stores.jobs.flow_key(row)
            except OrchestratorError as exc:
                problems.append(f"{schedule.source}: schedule {schedule.name!r}: {exc}")
        if problems:
            raise ConfigError("\n".join(problems))

    def runs(self, schedule: Schedule, ticks: list[datetime]) -> list[dict[str, Any]]:
        """The job rows of ``schedule``'s runs at ``ticks``: each due at its tick, keyed
        ``schedule/<name>/<tick>``. That key is given to the row, not the spec: the schedules'
        namespace is refused to every JobSpec (a submit's), the scheduler's being the one
        writer of those keys."""
        o = schedule.options
        return [
            {
                **self._rows.row(
                    job_spec(
                        job_type=schedule.job_type, payload=o.payload, run_at=tick,
                        priority=o.priority, queue=o.queue, max_retries=o.max_retries,
                        tenant_id=o.tenant_id,
                    )
                ),
                "job_key": schedule.job_key(tick),
                "job_key_mode": "unsafe_dedupe",
            }
            for tick in ticks
        ]  # fmt: skip

    def declares(self) -> str:
        """The fingerprint of what this process declares (its config's limits, its schedules):
        recorded beside its config version (docs/applications.md)."""
        return fingerprint(self._config.current, self._schedules.values())

    def scheduler(self) -> Scheduler:
        return Scheduler(
            stores=self._lifecycle.stores, application=application_of(self._settings),
            declares=self.declares, schedules=self._schedules,
            runs=self.runs,
            grace=self._settings.schedule_grace_seconds,
            max_sleep=self._settings.schedule_check_seconds,
        )  # fmt: skip

    async def views(self, *, tenants: Collection[str] | None) -> list[ScheduleView]:
        storable(tenants=tenants)
        tenants_named(tenants=tenants)
        views = await self._lifecycle.stores.schedules.list_schedules(tenants=tenants)
        stored = {view.name for view in views}
        now = datetime.now(UTC)
        views += [
            ScheduleView.defined(schedule, now)
            for schedule in self._schedules.values()
            if schedule.name not in stored
            and (tenants is None or schedule.options.tenant_id in tenants)
        ]
        return sorted(views, key=lambda view: view.name)

    async def pause(self, name: str, *, by: str, tenants: Collection[str] | None) -> ScheduleView:
        storable(name=name, by=by, tenants=tenants)
        tenants_named(tenants=tenants)
        await self._declare()
        return await self._lifecycle.stores.schedules.pause(name, by=by, tenants=tenants)

    async def resume(self, name: str, *, tenants: Collection[str] | None) -> ScheduleView:
        storable(name=name, tenants=tenants)
        tenants_named(tenants=tenants)
        await self._declare()
        return await self._lifecycle.stores.schedules.resume(name, tenants=tenants)

    async def _declare(self) -> None:
        """The schedules this process defines, added and changed as its application's (a
        command run by an operator may hold part of them: it withdraws none)."""
        await self._lifecycle.stores.schedules.sync(
            application_of(self._settings), self._schedules.values(), whole=False
        )
