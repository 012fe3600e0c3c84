"""Load and validate a retry config file (TOML).

File shape::

    [defaults]                      # every field of JobRetryConfig; optional
    app_max_retries = 3
    [defaults.backoff]
    base_ms = 1000

    [job_types.http_request]        # merged over [defaults], field by field
    worker_max_attempts = 5

    [limits.anthropic]              # fleet-wide limits per key (docs/flow-control.md)
    key = "anthropic:{payload.model}"
    concurrency = 20

    [token_budgets."acme"]          # a tenant's token budget per period (retry_config.budgets)
    tokens = 1000000

Any problem raises :class:`ConfigError` whose message names the file, the job type and the field,
one line per problem (every problem is reported at once). A field set in ``[defaults]`` is
reported against ``defaults`` only, not against every type that inherits it. Which job types a
file may name is known only to the application: :meth:`RetryConfig.check_names` refuses a table
that names none of them, and suggests the closest.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from retry_config.budgets import TokenBudget, parse_budgets
from retry_config.models import FlowLimit, JobRetryConfig, ScheduleConfig
from retry_config.names import limit_refusal

DEFAULT_PATH = Path(__file__).with_name("default.toml")
_TOP_LEVEL = {"defaults", "job_types", "limits", "token_budgets"}


class ConfigError(ValueError):
    """The retry config cannot be used; the message says where and why."""

    code = "CONFIG_INVALID"


@dataclass(frozen=True)
class RetryConfig:
    """The loaded file: a config per named job type, and defaults for every other type."""

    path: Path
    defaults: JobRetryConfig
    job_types: Mapping[str, JobRetryConfig] = field(default_factory=dict)
    #: The file's content hash (:func:`version_of`): which edit this is, whatever its mtime.
    version: str = ""
    #: Token budgets by tenant (``[token_budgets."<tenant>"]``).
    token_budgets: Mapping[str, TokenBudget] = field(default_factory=dict)
    #: The fleet-wide limits (``[limits.<name>]``), by name (docs/flow-control.md).
    limits: Mapping[str, FlowLimit] = field(default_factory=dict)

    def limit_of(self, job_type: str) -> tuple[str, FlowLimit] | None:
        """The limit a job type runs under, with its name, if any."""
        name = self.for_type(job_type).limit
        return None if name is None else (name, self.limits[name])

    def for_type(self, job_type: str) -> JobRetryConfig:
        return self.job_types.get(job_type, self.defaults)

    def queue_of(self, job_type: str) -> str:
        return self.for_type(job_type).queue or job_type

    @property
    def schedules(self) -> dict[str, ScheduleConfig]:
        """The schedules this file declares (``[job_types.<name>.schedule]``), by job type."""
        return {name: c.schedule for name, c in self.job_types.items() if c.schedule is not None}

    @property
    def external(self) -> dict[str, str]:
        """The external job types (declared here, run over the API), each with its queue."""
        return {name: self.queue_of(name) for name, c in self.job_types.items() if c.external}

    def check_names(self, known: Iterable[str]) -> None:
        """Refuse tables of job types that are not in ``known`` nor declared external here (a
        typo would otherwise leave the type it meant on ``[defaults]``, silently)."""
        names = sorted(set(known))
        problems = [
            f"{self.path}: {unknown_type(name, names)}"
            for name, config in self.job_types.items()
            if name not in names and not config.external
        ]
        if problems:
            raise ConfigError("\n".join(problems))


def unknown_type(name: str, known: Iterable[str]) -> str:
    """``job type 'x' is neither registered nor built in``, with the closest known name."""
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"job type {name!r} is neither registered nor built in{hint}"


@functools.cache
def built_in_types() -> frozenset[str]:
    """The job types the default file configures: the built-in ones."""
    return frozenset(tomllib.loads(DEFAULT_PATH.read_text(encoding="utf-8"))["job_types"])


def version_of(content: bytes) -> str:
    """A file version's name: the first 12 hex digits of its SHA-256."""
    return hashlib.sha256(content).hexdigest()[:12]


def load(path: Path | str | None = None) -> RetryConfig:
    path = Path(path) if path is not None else DEFAULT_PATH
    return parse_bytes(read(path), path)


def read(path: Path) -> bytes:
    """The file's bytes (through any symlinks: a ConfigMap mount's ``..data``)."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None


def parse_bytes(content: bytes, path: Path) -> RetryConfig:
    """The config a file's ``content`` holds, named by its version."""
    try:
        raw = tomllib.loads(content.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return parse(raw, path, version=version_of(content))


def parse(raw: Mapping[str, Any], path: Path, *, version: str = "") -> RetryConfig:
    unknown = sorted(set(raw) - _TOP_LEVEL)
    if unknown:
        raise ConfigError(
            f"{path}: unknown top-level key(s) {', '.join(map(repr, unknown))}; "
            "expected [defaults], [job_types.<name>], [limits.<name>] and [token_budgets.<tenant>]"
        )
    defaults_raw = _table(raw.get("defaults", {}), path, "[defaults]")
    types_raw = _table(raw.get("job_types", {}), path, "[job_types]")

    problems: list[str] = []
    for per_type in ("external", "schedule", "limit"):
        if per_type in defaults_raw:
            problems.append(
                f"{path}: defaults: field {per_type!r}: set it per job type ([job_types.<name>])"
            )
    defaults = _validate(defaults_raw, path, "defaults", problems)
    job_types: dict[str, JobRetryConfig] = {}
    for name, entry in types_raw.items():
        own = _table(entry, path, f"[job_types.{name}]")
        merged = _deep_merge(defaults_raw, own)
        config = _validate(merged, path, f"job type {name!r}", problems, own=own)
        if config is not None:
            job_types[name] = config
    limits = _limits(_table(raw.get("limits", {}), path, "[limits]"), path, problems)
    for name, config in job_types.items():
        if config.limit is not None and limits is not None and config.limit not in limits:
            close = difflib.get_close_matches(config.limit, list(limits), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(
                f"{path}: job type {name!r}: field 'limit': no [limits.{config.limit}]{hint}"
            )
    budgets = parse_budgets(raw.get("token_budgets", {}), path, problems)
    if problems or defaults is None or limits is None:
        raise ConfigError("\n".join(problems))
    return RetryConfig(
        path=path,
        defaults=defaults,
        job_types=job_types,
        version=version,
        limits=limits,
        token_budgets=budgets,
    )


def _limits(raw: Mapping[str, Any], path: Path, problems: list[str]) -> dict[str, FlowLimit] | None:
    """The ``[limits.<name>]`` tables, or None with their problems added."""
    limits: dict[str, FlowLimit] = {}
    before = len(problems)
    for name, entry in raw.items():
        reserved = limit_refusal(name)
        if reserved is not None:
            problems.append(f"{path}: [limits.{name}]: {reserved}")
            continue
        try:
            limits[name] = FlowLimit.model_validate(_table(entry, path, f"[limits.{name}]"))
        except ValidationError as exc:
            for err in exc.errors(include_url=False):
                loc = ".".join(str(p) for p in err["loc"]) or "(entry)"
                problems.append(f"{path}: limit {name!r}: field {loc!r}: {err['msg']}")
    return None if len(problems) > before else limits


def _validate(
    data: Mapping[str, Any],
    path: Path,
    where: str,
    problems: list[str],
    own: Mapping[str, Any] | None = None,
) -> JobRetryConfig | None:
    """The config, or None with its problems added. ``own``: the type's own table; a field it
    does not set came from ``[defaults]``, whose problems are reported there once."""
    try:
        return JobRetryConfig.model_validate(data)
    except ValidationError as exc:
        for err in exc.errors(include_url=False):
            parts = [p for p in err["loc"] if not _is_union_tag(p)]
            if own is not None and parts and not _sets(own, parts):
                continue  # inherited from [defaults], and reported against it
            loc = ".".join(str(p) for p in parts) or "(entry)"
            problems.append(f"{path}: {where}: field {loc!r}: {err['msg']}")
        return None


def _sets(table: Mapping[str, Any], loc: list[Any]) -> bool:
    """Whether ``table`` itself sets the field at ``loc`` (or a table that holds it)."""
    value: Any = table
    for part in loc:
        if isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value):
            value = value[part]  # an item of a list field (fallback_models)
            continue
        if not isinstance(value, Mapping) or part not in value:
            return False
        value = value[part]
    return True


def _is_union_tag(part: object) -> bool:
    # pydantic inserts the discriminator value ('full', 'additive', ...) into error locations.
    return part in {"none", "full", "proportional", "additive"}


def _table(value: Any, path: Path, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: {where} must be a table, got {type(value).__name__}")
    return value


def _deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        # A jitter table is one choice (its ``mode`` decides its fields), so it is replaced whole.
        if key != "jitter" and isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged
