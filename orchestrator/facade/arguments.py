"""The operator calls' arguments, checked before anything is read or written: a malformed one
is refused with InvalidArgument naming it, never sent to the database."""

from __future__ import annotations

from collections.abc import Collection
from uuid import UUID

from orchestrator.domain.errors import InvalidArgument
from orchestrator.domain.states import Status
from orchestrator.domain.storable import refusal
from retry_config.names import tenant_refusal


def uuid_of(value: UUID | str, what: str = "job") -> UUID:
    if isinstance(value, UUID):
        return value
    try:
        return UUID(value)
    except ValueError:
        article = "an" if what[0] in "aeiou" else "a"
        raise InvalidArgument(f"not {article} {what} id: {value!r}") from None


def status_of(value: Status | str) -> Status:
    try:
        return Status(value)
    except ValueError:
        known = ", ".join(s.value for s in Status)
        raise InvalidArgument(f"status: {value!r} is not a status (one of {known})") from None


def storable(**texts: str | Collection[str] | None) -> None:
    """The string rule (orchestrator.domain.storable) for the operator calls' text: refused
    naming the argument, before anything is read or written (a submit's options are checked by
    JobSpec)."""
    for name, value in texts.items():
        for text in [value] if isinstance(value, str) else value or ():
            reason = refusal(text)
            if reason is not None:
                raise InvalidArgument(f"{name}: {reason}")


def tenants_named(**tenants: str | Collection[str] | None) -> None:
    """Each tenant named (a ``tenant_id``, or a collection of ``tenants``) names one: never
    empty or blank (retry_config.names), refused naming the argument before anything is read."""
    for name, value in tenants.items():
        for tenant in [value] if isinstance(value, str) else value or ():
            reason = tenant_refusal(tenant)
            if reason is not None:
                raise InvalidArgument(f"{name}: {reason}")
