"""A durable, two-layer retry orchestrator for LLM agent jobs, on PostgreSQL and Procrastinate.

The public surface is what this module exports; everything else is internal. The package is
layered (docs/architecture.md): ``domain`` (the state machine and pure policy), ``storage``
(SQL and stores), the top-level ``checkpoints`` package (durable steps), ``runtime`` (the
worker), ``services`` (maintenance), ``app`` (the Orchestrator, which puts them together;
``facade``, its concerns) and ``interfaces`` (the command line). The names below are loaded
when first used, so importing a lower layer (``orchestrator.domain.errors``, say, as
``checkpoints`` does) never pulls in the layers above it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator.app import JobSpec, Orchestrator
    from orchestrator.domain.classification import Classified, ErrorClass, classify
    from orchestrator.domain.dependencies import Dependency
    from orchestrator.domain.errors import (
        ApprovalError,
        CallTimedOut,
        ConfigError,
        DatabaseUnavailable,
        DeadLetterError,
        InvalidOutput,
        InvalidPayload,
        InvalidTransition,
        JobNotFound,
        JobSignal,
        OrchestratorError,
        PermanentError,
        RetryLater,
        StaleLease,
        StepTimedOut,
        SubmitError,
        TimedOut,
        TransactionConflict,
        UnknownJobType,
    )
    from orchestrator.domain.models import Awaited, DeadLetter, Job, JobEvent, LastError
    from orchestrator.domain.states import Status
    from orchestrator.runtime.context import JobContext
    from orchestrator.settings import Settings

_HOMES = {
    "orchestrator.app": ("JobSpec", "Orchestrator"),
    "orchestrator.domain.classification": ("Classified", "ErrorClass", "classify"),
    "orchestrator.domain.errors": (
        "ApprovalError", "CallTimedOut", "ConfigError", "DatabaseUnavailable", "DeadLetterError",
        "InvalidOutput",
        "InvalidPayload", "InvalidTransition", "JobNotFound", "JobSignal", "OrchestratorError",
        "PermanentError", "RetryLater", "StaleLease", "StepTimedOut", "SubmitError", "TimedOut",
        "TransactionConflict", "UnknownJobType",
    ),
    "orchestrator.domain.dependencies": ("Dependency",),
    "orchestrator.domain.models": ("DeadLetter", "Job", "JobEvent", "LastError", "Awaited"),
    "orchestrator.domain.states": ("Status",),
    "orchestrator.runtime.context": ("JobContext",),
    "orchestrator.settings": ("Settings",),
}  # fmt: skip
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [
    "ApprovalError",
    "Awaited",
    "CallTimedOut",
    "Classified",
    "ConfigError",
    "DatabaseUnavailable",
    "DeadLetter",
    "DeadLetterError",
    "Dependency",
    "ErrorClass",
    "InvalidOutput",
    "InvalidPayload",
    "InvalidTransition",
    "Job",
    "JobContext",
    "JobEvent",
    "JobNotFound",
    "JobSignal",
    "JobSpec",
    "LastError",
    "Orchestrator",
    "OrchestratorError",
    "PermanentError",
    "RetryLater",
    "Settings",
    "StaleLease",
    "Status",
    "StepTimedOut",
    "SubmitError",
    "TimedOut",
    "TransactionConflict",
    "UnknownJobType",
    "classify",
]


def __getattr__(name: str) -> object:
    home = _HOME_OF.get(name)
    if home is None:
        raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # loaded once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
