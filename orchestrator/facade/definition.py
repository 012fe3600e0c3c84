"""What the application defines: its job types (registered in code, or external in the retry
config) and its classifiers, and the checks that the retry config, the schedules and the
notification targets fit them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import retry_config
from orchestrator.domain.classification import Classifier
from orchestrator.domain.degradation import Fallback, TypeDegradation
from orchestrator.domain.dependencies import ParentPolicy
from orchestrator.domain.errors import ConfigError
from orchestrator.domain.job_types import JobType
from orchestrator.domain.notices import Notifier
from orchestrator.domain.schedules import define
from orchestrator.facade.schedules import Schedules
from orchestrator.runtime.context import JobContext
from orchestrator.services import maintenance
from retry_config import LiveConfig, RetryConfig
from retry_config.names import queue_refusal

F = TypeVar("F", bound=Callable[[JobContext, Any], Awaitable[Any]])


class Definition:
    """The job types by name and the classifiers (the Orchestrator's ``job_types`` and
    ``classifiers``), added to as the application's code is imported."""

    def __init__(
        self,
        job_types: dict[str, JobType],
        classifiers: list[Classifier],
        config: LiveConfig,
        schedules: Schedules,
        notifier: Notifier,
    ) -> None:
        self.job_types = job_types
        self.classifiers = classifiers
        self._config = config
        self._schedules = schedules
        self._notifier = notifier

    def job_type(
        self,
        name: str,
        *,
        fallback: Fallback | None,
        exhausted_message: str | None,
        cron: str | None,
        tz: str,
        backfill_seconds: int,
        tenant_id: str | None,
        cost: Callable[[Any], int] | None,
        on_parent_failure: ParentPolicy,
    ) -> Callable[[F], F]:
        schedule = None
        if cron is not None:
            schedule = define(
                name, name, source=f"job type {name!r}", cron=cron, tz=tz,
                backfill_seconds=backfill_seconds, tenant_id=tenant_id,
            )  # fmt: skip

        def decorate(fn: F) -> F:
            if name in self._config.current.external:
                raise ValueError(
                    f"job type {name!r} is external in {self._config.current.path}: external "
                    "workers run it over the API"
                )
            if name in self.job_types:
                raise ValueError(f"job type {name!r} is already registered")
            if schedule is not None:
                self._schedules.add(schedule)
            self.job_types[name] = JobType.from_function(
                name, fn, fallback=fallback, exhausted_message=exhausted_message, cost=cost,
                on_parent_failure=on_parent_failure,
            )  # fmt: skip
            return fn

        return decorate

    def add_classifier(self, classifier: Classifier) -> Classifier:
        self.classifiers.append(classifier)
        return classifier

    def check(self) -> None:
        self.check_config(self._config.current)
        self._schedules.check()
        self._notifier.check()

    def check_config(self, config: RetryConfig) -> None:
        config.check_names(self.known_job_types())
        external = {q: name for name, q in config.external.items()}
        clashes = [
            f"job type {name!r} is on queue {config.queue_of(name)!r}, the queue of "
            f"the external job type {external[config.queue_of(name)]!r}"
            for name, job_type in sorted(self.job_types.items())
            if not job_type.is_external and config.queue_of(name) in external
        ]
        # A type's queue is its name unless the file names one: a type named after a reserved
        # queue is refused here too (one the file names is refused when the file is read).
        clashes += [
            f"job type {name!r}: {reason}"
            for name in sorted({*self.job_types, *config.external})
            if (reason := queue_refusal(config.queue_of(name))) is not None
        ]
        if clashes:
            raise ConfigError(f"{config.path}: " + "; ".join(clashes))

    def known_job_types(self) -> set[str]:
        return {*self.job_types, *retry_config.built_in_types(), *maintenance.NAMES}


def degradation_of(job_types: Mapping[str, JobType], job_type: str) -> TypeDegradation:
    """How a failed job of ``job_type`` degrades: as its type declares, or by default for a
    type this process does not register."""
    known = job_types.get(job_type)
    return known.degradation if known is not None else TypeDegradation()
