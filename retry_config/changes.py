"""What an edit of the retry config changes: per scope (``[defaults]``, each job type a file
names, and each ``[limits.<name>]``), per field, old -> new. Pure, for ``orchestrator config
diff`` and for the log line a reload writes per changed type.

A job type is compared by its effective config (``for_type``): a field it inherits from
``[defaults]`` changes with it, and a type whose table goes falls back to ``[defaults]``. The
backoff table is compared field by field (``backoff.base_ms``); a jitter is one choice (its
``mode`` decides its fields) and ``tool_timeouts_ms`` one map, each compared whole.

Some fields are fixed at start-up (:func:`hold_fixed`): a running process keeps their old
values, and the edit names them so that the reload can say a restart applies them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from pydantic import BaseModel

from retry_config.loader import RetryConfig
from retry_config.models import BackoffConfig, FlowLimit, JobRetryConfig

#: The scope of the ``[defaults]`` table (brackets: no job type is named so).
DEFAULTS = "[defaults]"
#: The scope of the tenants' token budgets (``tenant.tokens``, ``tenant.period``).
TOKEN_BUDGETS = "[token_budgets]"

#: field path -> (old value, new value), as JSON values.
FieldChanges = dict[str, tuple[Any, Any]]
#: scope ([defaults] or a job type) -> its changed fields; scopes without a change are left out.
Changes = dict[str, FieldChanges]


def diff(old: RetryConfig, new: RetryConfig) -> Changes:
    """Every field whose value differs between ``old`` and ``new``, per scope."""
    scopes = {DEFAULTS: (old.defaults, new.defaults)} | {
        name: (old.for_type(name), new.for_type(name))
        for name in sorted({*old.job_types, *new.job_types})
    }
    changes: Changes = {}
    for scope, (before, after) in scopes.items():
        a, b = fields_of(before), fields_of(after)
        changed = {path: (a[path], b[path]) for path in a if a[path] != b[path]}
        if changed:
            changes[scope] = changed
    for name in sorted({*old.limits, *new.limits}):
        a, b = _limit_fields(old.limits.get(name)), _limit_fields(new.limits.get(name))
        changed = {p: (a.get(p), b.get(p)) for p in sorted({*a, *b}) if a.get(p) != b.get(p)}
        if changed:
            changes[f"[limits.{name}]"] = changed
    a, b = _budgets(old), _budgets(new)
    budgets = {p: (a.get(p), b.get(p)) for p in sorted({*a, *b}) if a.get(p) != b.get(p)}
    if budgets:
        changes[TOKEN_BUDGETS] = budgets
    return changes


def _limit_fields(limit: FlowLimit | None) -> dict[str, Any]:
    """A limit's fields as JSON values; none for a limit the file does not have."""
    return {} if limit is None else limit.model_dump(mode="json")


def _budgets(config: RetryConfig) -> dict[str, Any]:
    return {
        f"{tenant}.{name}": value
        for tenant, budget in config.token_budgets.items()
        for name, value in budget.model_dump(mode="json").items()
    }


def fields_of(config: JobRetryConfig) -> dict[str, Any]:
    """The config's fields by path (``backoff.base_ms``), as JSON values."""
    found: dict[str, Any] = {}
    for name in type(config).model_fields:
        value = getattr(config, name)
        if isinstance(value, BackoffConfig):
            found.update({f"{name}.{k}": v for k, v in fields_of_backoff(value).items()})
        else:
            found[name] = _json(value)
    return found


def fields_of_backoff(backoff: BackoffConfig) -> dict[str, Any]:
    return {name: _json(getattr(backoff, name)) for name in type(backoff).model_fields}


def _json(value: Any) -> Any:
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


def describe(changes: Changes) -> list[str]:
    """One line per scope: ``job type 'x': backoff.base_ms 50 -> 2000, app_max_retries 3 -> 5``."""
    return [
        f"{_scope(scope)}: "
        + ", ".join(f"{path} {shown(old)} -> {shown(new)}" for path, (old, new) in fields.items())
        for scope, fields in changes.items()
    ]


def _scope(scope: str) -> str:
    return scope if scope.startswith("[") else f"job type {scope!r}"


def shown(value: Any) -> str:
    """A field's value as a diff shows it: JSON, or ``unset``."""
    return "unset" if value is None else json.dumps(value, separators=(",", ":"))


def hold_fixed(
    new: RetryConfig,
    running: RetryConfig,
    fixed_of: Callable[[str], frozenset[str]],
    also: Iterable[str] = (),
) -> tuple[RetryConfig, dict[str, list[str]]]:
    """``new`` with the fields fixed at start-up (``fixed_of(scope)``) kept as ``running``
    has them, and which of them the edit changes (scope -> field names). ``also``: job types
    to hold even when no file names them (they inherit ``[defaults]``)."""
    held: dict[str, list[str]] = {}

    def keep(scope: str, before: JobRetryConfig, after: JobRetryConfig) -> JobRetryConfig:
        names = [f for f in sorted(fixed_of(scope)) if getattr(before, f) != getattr(after, f)]
        if not names:
            return after
        held[scope] = names
        return after.model_copy(update={f: getattr(before, f) for f in names})

    defaults = keep(DEFAULTS, running.defaults, new.defaults)
    job_types: dict[str, JobRetryConfig] = {}
    for name in sorted({*running.job_types, *new.job_types, *also}):
        config = keep(name, running.for_type(name), new.for_type(name))
        if name in new.job_types or name in held:  # a type not named here keeps its hold
            job_types[name] = config
    return replace(new, defaults=defaults, job_types=job_types), held
