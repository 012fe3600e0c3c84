"""Every exception the orchestrator raises or understands, in one tree.

ConfigError                        CONFIG_INVALID, a ValueError, defined by retry_config (which
                                   cannot depend on this package): the retry config, a setting or
                                   a target that cannot be used; the message names what and where

OrchestratorError                  base; every subclass carries a stable ``code``
├── SubmitError                    a submit was refused; nothing was stored
│   ├── UnknownJobType
│   └── InvalidPayload
├── InvalidArgument                an argument of a call that cannot be used (not an id; text
│                                  PostgreSQL cannot store): nothing was done
├── JobNotFound
├── InvalidTransition              WF_STATE_TRANSITION_INVALID; nothing was changed
├── StaleLease                     a write from an attempt whose lease was superseded
├── DeadLetterError                a dead-letter action that does not apply
├── ScheduleNotFound               no schedule of that name (or not of the caller's tenants)
├── ApplicationConflict            a sync refused: another application declares one of its
│                                  job types, limits or schedules otherwise; nothing was declared
├── ApplicationLive                an application forgotten while a process of it lives
├── MigrationError
├── SchemaOutdated                 the database is not migrated to this version
├── SchemaTooNew                   ... or migrated past it, incompatibly with this version
├── DatabaseUnavailable            the database cannot be reached (the server's reason)
├── TransactionConflict            the database rolled a transaction back (a deadlock or a
│                                  serialization failure): nothing of it was kept; run it again
└── TimedOut                       also a TimeoutError; TRANSIENT_APP (the timeout tree)
    ├── StepTimedOut               a checkpointed step overran: retried from the last checkpoint
    ├── CallTimedOut               one call overran its (per-tool) limit
    └── StreamStalled              a stream sent nothing for its inter-chunk timeout

JobSignal                          raised *by task code* to steer the outcome of an attempt
├── RetryLater(delay)              TRANSIENT_APP, retry after ``delay`` seconds (capped)
├── PermanentError                 PERMANENT: no retry at either layer
│   └── TokenBudgetExhausted       TOKEN_BUDGET_EXHAUSTED: the job's or its tenant's token
│                                  budget is spent (checked before each LLM call)
└── InvalidOutput                  INVALID_OUTPUT: terminal, the output is kept in last_error
"""

from __future__ import annotations

import json
from typing import Any

from retry_config import ConfigError as ConfigError  # re-exported: one class for every config error


class OrchestratorError(Exception):
    code = "ORC_ERROR"


class SubmitError(OrchestratorError):
    code = "SUBMIT_REJECTED"


class UnknownJobType(SubmitError):
    code = "JOB_TYPE_UNKNOWN"

    def __init__(self, job_type: str, known: list[str]) -> None:
        self.job_type = job_type
        super().__init__(
            f"unknown job type {job_type!r}; registered types: {', '.join(sorted(known)) or 'none'}"
        )


class InvalidPayload(SubmitError):
    code = "PAYLOAD_INVALID"

    def __init__(self, job_type: str, detail: str) -> None:
        self.job_type = job_type
        super().__init__(f"invalid payload for job type {job_type!r}: {detail}")


class InvalidArgument(OrchestratorError, ValueError):
    code = "ARGUMENT_INVALID"


class JobNotFound(OrchestratorError):
    code = "JOB_NOT_FOUND"

    def __init__(self, job_id: object) -> None:
        self.job_id = job_id
        super().__init__(f"no job with id {job_id}")


class InvalidTransition(OrchestratorError):
    """A status change the state machine refuses: found by the orchestrator before it wrote
    (the job was not where the write needs it), or refused by the database's own guard
    (``by_database``: SQLSTATE WF001, a write the code never makes on purpose)."""

    code = "WF_STATE_TRANSITION_INVALID"

    def __init__(
        self,
        job_id: object,
        source: str,
        target: str,
        *,
        by_database: bool = False,
        message: str | None = None,
    ) -> None:
        self.job_id, self.source, self.target = job_id, source, target
        self.by_database = by_database
        super().__init__(
            message or f"{self.code}: job {job_id} cannot go from {source} to {target}"
        )


class StaleLease(OrchestratorError):
    code = "WF_LEASE_STALE"

    def __init__(self, job_id: object, lease_token: object) -> None:
        self.job_id, self.lease_token = job_id, lease_token
        # The message names no lease token: it goes to logs and answers (a token is a capability).
        super().__init__(f"{self.code}: job {job_id} is not leased by this attempt; write rejected")


class DeadLetterError(OrchestratorError):
    code = "DLQ_ACTION_INVALID"


class DeadLetterNotFound(DeadLetterError):
    code = "DEAD_LETTER_NOT_FOUND"

    def __init__(self, dead_letter_id: object) -> None:
        super().__init__(f"no dead letter with id {dead_letter_id}")


class ApprovalError(OrchestratorError):
    code = "APPROVAL_INVALID"


class ApprovalNotFound(ApprovalError):
    code = "APPROVAL_NOT_FOUND"

    def __init__(self, approval_id: object) -> None:
        super().__init__(f"no approval with id {approval_id}")


class ScheduleNotFound(OrchestratorError):
    code = "SCHEDULE_NOT_FOUND"

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"no schedule named {name!r}")


class FlowKeyNotFound(OrchestratorError):
    """No job of this key has reached a claim yet (or the name is misspelt)."""

    code = "FLOW_KEY_NOT_FOUND"

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"no flow key named {key!r}")


class ApplicationConflict(OrchestratorError):
    """An application's declaration refused (docs/applications.md): another application
    declares a name of it otherwise. ``conflicts``: (kind, name, other application, {field:
    [ours, theirs]}), each said in the message."""

    code = "APPLICATION_CONFLICT"

    def __init__(
        self, application: str, conflicts: list[tuple[str, str, str, dict[str, list[Any]]]]
    ) -> None:
        self.application = application
        self.conflicts = conflicts
        said = "; ".join(
            f"{kind.replace('_', ' ')} {name!r} is defined otherwise by application {other!r} ("
            + ", ".join(
                f"{field}: {_json(ours)} here, {_json(theirs)} there"
                for field, (ours, theirs) in sorted(difference.items())
            )
            + ")"
            for kind, name, other, difference in conflicts
        )
        super().__init__(
            f"application {application!r} refused: {said}; two applications may share a name "
            "only with one definition (docs/applications.md)"
        )


def _json(value: Any) -> str:
    return "unset" if value is None else json.dumps(value, sort_keys=True)


class ApplicationLive(OrchestratorError):
    """An application cannot be forgotten while a process of it lives: it declares again."""

    code = "APPLICATION_LIVE"


class MigrationError(OrchestratorError):
    code = "MIGRATION_FAILED"


class SchemaOutdated(OrchestratorError):
    """The database lacks this version's schema (or any): ``orchestrator migrate`` brings it."""

    code = "SCHEMA_OUTDATED"


class SchemaTooNew(OrchestratorError):
    """A newer release migrated the database, with migrations this version does not know and
    that are not marked compatible with older workers (docs/operations.md, "Rollout contract")."""

    code = "SCHEMA_TOO_NEW"


class DatabaseUnavailable(OrchestratorError):
    """The database cannot be reached; the message carries the server's (or the network's)
    own reason."""

    code = "DATABASE_UNAVAILABLE"

    def __init__(self, reason: object) -> None:
        super().__init__(f"cannot reach the database: {' '.join(str(reason).split())}")


class TransactionConflict(OrchestratorError):
    """The database rolled a transaction back to break a deadlock or a serialization failure
    (SQLSTATE 40P01, 40001). Nothing it wrote was kept, so running it again is safe: the
    orchestrator does so itself for a statement it runs alone (orchestrator.storage.runner);
    raised when that kept failing, or when the transaction was the caller's."""

    code = "DATABASE_CONFLICT"

    def __init__(self, reason: object) -> None:
        super().__init__(
            f"the database rolled the transaction back ({' '.join(str(reason).split())}); "
            "nothing of it was kept: run it again"
        )


class TimedOut(OrchestratorError, TimeoutError):
    code = "TIMEOUT"


class StepTimedOut(TimedOut):
    code = "STEP_TIMEOUT"

    def __init__(self, step: int, seconds: float) -> None:
        self.step, self.seconds = step, seconds
        super().__init__(f"Step {step} timed out after {seconds:g} seconds")


class CallTimedOut(TimedOut):
    code = "CALL_TIMEOUT"

    def __init__(self, what: str, seconds: float) -> None:
        self.what, self.seconds = what, seconds
        super().__init__(f"{what} timed out after {seconds:g} seconds")


class StreamStalled(TimedOut):
    code = "STREAM_STALLED"

    def __init__(self, what: str, seconds: float) -> None:
        self.what, self.seconds = what, seconds
        super().__init__(f"{what} sent nothing for {seconds:g} seconds: stream stalled")


class JobSignal(Exception):
    """Base for exceptions a task raises on purpose to choose its outcome."""


class RetryLater(JobSignal):
    def __init__(self, delay: float, message: str = "retry requested by the task") -> None:
        if delay < 0:
            raise ValueError("RetryLater delay must be >= 0 seconds")
        self.delay = delay
        super().__init__(message)


class PermanentError(JobSignal):
    def __init__(self, message: str, *, code: str | None = None) -> None:
        self.code = code
        super().__init__(message)


class TokenBudgetExhausted(PermanentError):
    """Raised before an LLM call (``JobContext.check_token_budget``) once the job's own token
    budget, or its tenant's for the current period, is spent: PERMANENT, dead-lettered, never
    retried (docs/configuration.md, "Token accounting and budgets")."""

    CODE = "TOKEN_BUDGET_EXHAUSTED"

    def __init__(self, message: str) -> None:
        super().__init__(message, code=self.CODE)


class InvalidOutput(JobSignal):
    def __init__(self, message: str, *, output: Any = None) -> None:
        self.output = output
        super().__init__(message)
