"""Per-job-type retry configuration: the models, the loader and the default file users edit."""

from retry_config.changes import DEFAULTS, Changes, describe, diff, hold_fixed, shown
from retry_config.live import LiveConfig
from retry_config.loader import (
    DEFAULT_PATH,
    ConfigError,
    RetryConfig,
    built_in_types,
    load,
    parse,
    parse_bytes,
    read,
    unknown_type,
    version_of,
)
from retry_config.models import (
    MAX_VALUE,
    AdditiveJitter,
    BackoffConfig,
    FlowLimit,
    FullJitter,
    Jitter,
    JobRetryConfig,
    NoJitter,
    ProportionalJitter,
    ScheduleConfig,
)

__all__ = [
    "DEFAULTS",
    "DEFAULT_PATH",
    "MAX_VALUE",
    "AdditiveJitter",
    "BackoffConfig",
    "Changes",
    "ConfigError",
    "FlowLimit",
    "FullJitter",
    "Jitter",
    "JobRetryConfig",
    "LiveConfig",
    "NoJitter",
    "ProportionalJitter",
    "RetryConfig",
    "ScheduleConfig",
    "built_in_types",
    "describe",
    "diff",
    "hold_fixed",
    "load",
    "parse",
    "parse_bytes",
    "read",
    "shown",
    "unknown_type",
    "version_of",
]
