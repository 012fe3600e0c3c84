"""Several applications on one database (docs/applications.md): what an application declares
of the shared tables, and what the operator is shown of each application.

An application's declaration is, per kind, each name with its definition: the fields of the
shared row it stands for, exactly as the row's writer sends them. Two applications may declare
one name only with one definition (the database's ``orc_declare_v1`` refuses the second that
differs: :class:`~orchestrator.domain.errors.ApplicationConflict`). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel

from orchestrator.domain.errors import ApplicationConflict
from orchestrator.settings import Settings

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


@dataclass(frozen=True)
class Application:
    """The application a process belongs to (``ORCHESTRATOR_APPLICATION``), and how long a
    silent process of it still counts as live (``ORCHESTRATOR_STALLED_WORKER_SECONDS``)."""

    name: str = DEFAULT_APPLICATION
    live_seconds: float = 30.0

    @classmethod
    def of(cls, settings: Settings) -> Application:
        return cls(settings.application, settings.stalled_worker_seconds)


@dataclass(frozen=True)
class Declaration:
    """What ``application`` declares of ``kinds``. ``whole``: all it declares of them (a name it
    declared before and no longer gives is withdrawn, once no live process of the application
    runs another config ``version`` than this one; None: at once); otherwise it adds and
    changes only."""

    application: Application
    kinds: Mapping[Kind, Definitions]
    whole: bool = True
    version: str | None = None


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
    """Waiting jobs of a type that no live application declares: they wait (nothing fails
    them) until a process of an application that runs the type is back."""

    job_type: str
    pending: int
    retry: int


class Applications(BaseModel):
    """The applications sharing the database, and the waiting jobs none of the live ones
    serves."""

    applications: list[ApplicationView]
    unserved: list[UnservedJobs]


def shown_weights(weights: Mapping[str, Any], tenants: Collection[str] | None) -> dict[str, Any]:
    """A limit's weights as a reader of ``tenants`` may see them: a tenant's name is its own
    (None: every tenant's)."""
    return dict(weights) if tenants is None else {k: v for k, v in weights.items() if k in tenants}
