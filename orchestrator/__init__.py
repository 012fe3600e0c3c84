"""A durable, two-layer retry orchestrator for LLM agent jobs, on PostgreSQL and Procrastinate.

The public surface is what this module exports; everything else is internal.
"""

from orchestrator.app import JobSpec, Orchestrator
from orchestrator.classification import Classified, ErrorClass, classify
from orchestrator.context import JobContext
from orchestrator.errors import (
    ApprovalError,
    CallTimedOut,
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
    UnknownJobType,
)
from orchestrator.models import DeadLetter, Job, JobEvent, LastError
from orchestrator.settings import Settings
from orchestrator.states import Status
from retry_config import ConfigError

__all__ = [
    "ApprovalError",
    "CallTimedOut",
    "Classified",
    "ConfigError",
    "DeadLetter",
    "DeadLetterError",
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
    "UnknownJobType",
    "classify",
]
