"""Several applications on one database (docs/applications.md): what an application declares
of the shared tables, and what the operator is shown of each application.

An application's declaration is, per kind, each name with its definition: the fields of the
shared row it stands for, exactly as the row's writer sends them. Two applications may declare
one name only with one definition (the database's ``orc_declare_v1`` refuses the second that
differs: :class:`~orchestrator.domain.errors.ApplicationConflict`). Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel

from orchestrator.domain.errors import ApplicationConflict
from orchestrator.domain.schedules import Schedule
from retry_config import RetryConfig

#: The application of a process that names none: a database of one application never names it.
DEFAULT_APPLICATION = "default"


class Kind(StrEnum):
    JOB_TYPE = "job_type"  # orc_job_types: what producers writing in SQL read (at migrate)
    LIMIT = "limit"  # orc_flow_limits (owner config)
    LIMIT_OF_TYPE = "limit_of_type"  # orc_flow_job_types: which limit a job type runs under
    SCHEDULE = "schedule"  # orc_schedules
    GRAPHILE = "graphile"  # Graphile Worker's API and its settings (at migrate; migration 0059)


#: The one name of the GRAPHILE kind: the schema of Graphile Worker's API.
GRAPHILE_SCHEMA = "graphile_worker"


Definitions = Mapping[str, Mapping[str, Any]]  # name -> the shared row's fields

#: A limit's fields as its shared row holds them (orc_flow_limits; ``key`` its key_template).
LIMIT_FIELDS = frozenset({
    "concurrency", "requests", "units", "interval_seconds", "weights", "key", "share_by",
    "tenant_share", "learn",
})  # fmt: skip


def limit_definitions(config: RetryConfig) -> dict[Kind, Definitions]:
    """What a config declares of flow control: its limits, and which job type runs under which
    (with the pause after which its calls fall back to other models, when it names any)."""
    return {
        Kind.LIMIT: {
            name: limit.model_dump(include=set(LIMIT_FIELDS))
            for name, limit in config.limits.items()
        },
        Kind.LIMIT_OF_TYPE: {
            name: {"limit": c.limit,
                   "fallback_after_seconds": c.fallback_after_seconds if c.fallback_models
                   else None}
            for name, c in config.job_types.items()
            if c.limit is not None
        },
    }  # fmt: skip


def schedule_definitions(schedules: Iterable[Schedule]) -> Definitions:
    """What a process declares of its schedules: each one's row fields."""
    return {
        s.name: {
            "job_type": s.job_type, "cron": s.options.cron, "tz": s.options.tz,
            "tenant_id": s.options.tenant_id, "backfill_seconds": s.options.backfill_seconds,
        }
        for s in schedules
    }  # fmt: skip


def fingerprint(config: RetryConfig, schedules: Iterable[Schedule]) -> str:
    """What a running process declares (its limits, its types' limits, its schedules), hashed:
    recorded beside its config version, a withdrawal waits while a live peer of its application
    records another (migration 0060)."""
    declared = {k.value: d for k, d in limit_definitions(config).items()}
    declared[Kind.SCHEDULE.value] = schedule_definitions(schedules)
    text = json.dumps(declared, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Application:
    """The application a process belongs to (``ORCHESTRATOR_APPLICATION``), and how long a
    silent process of it still counts as live (``ORCHESTRATOR_STALLED_WORKER_SECONDS``)."""

    name: str = DEFAULT_APPLICATION
    live_seconds: float = 30.0


@dataclass(frozen=True)
class Declaration:
    """What ``application`` declares of ``kinds``. ``whole``: all it declares of them (a name it
    declared before and no longer gives is withdrawn, once every live process of the
    application records the fingerprint ``declares``, the declaring process's; None: at once);
    otherwise it adds and changes only."""

    application: Application
    kinds: Mapping[Kind, Definitions]
    whole: bool = True
    declares: str | None = None


@dataclass(frozen=True)
class Declared:
    """The database's answer: the names withdrawn that no application declares any more (their
    shared rows go), those whose withdrawal waits for a live peer on another config version
    (``deferred``: declare again later), or the conflicts that refused the whole declaration."""

    application: str
    withdrawn: Mapping[Kind, list[str]] = field(default_factory=dict)
    deferred: list[str] = field(default_factory=list)
    conflicts: list[tuple[str, str, str, dict[str, list[Any]]]] = field(default_factory=list)

    def gone(self, kind: Kind) -> list[str]:
        return list(self.withdrawn.get(kind, []))

    def check(self) -> None:
        """ApplicationConflict when the declaration was refused."""
        if self.conflicts:
            raise ApplicationConflict(self.application, self.conflicts)


class ApplicationProcess(BaseModel):
    """A live process of an application (a worker, or ``serve``)."""

    worker_id: int
    worker: str
    config_version: str
    last_heartbeat: datetime


class ApplicationLimit(BaseModel):
    name: str
    definition: dict[str, Any]


class ApplicationConflictView(BaseModel):
    """A declaration of this application refused: ``other`` declares ``name`` otherwise."""

    kind: str
    name: str
    other: str
    difference: dict[str, list[Any]]
    at: datetime


class ApplicationView(BaseModel):
    """One application as the operator sees it: its live processes with their config versions,
    and what it declares (schedules only of the reader's tenants)."""

    name: str
    live: bool
    processes: list[ApplicationProcess]
    config_versions: list[str]
    job_types: list[str]
    limits: list[ApplicationLimit]
    limited_types: dict[str, str]  # job type -> its limit
    schedules: list[str]
    conflicts: list[ApplicationConflictView]


class UnservedJobs(BaseModel):
    """Waiting jobs of a type that no live process runs (a worker of an application that
    declares it; for an external type, its API server): they wait (nothing fails them) until
    one is back. ``due``: of them, those whose time has come; ``queues``: theirs."""

    job_type: str
    pending: int
    retry: int
    due: int
    queues: list[str]


class Applications(BaseModel):
    """The applications sharing the database, and the waiting jobs none of the live ones
    serves."""

    applications: list[ApplicationView]
    unserved: list[UnservedJobs]
