"""Per-job-type retry configuration: the models, the loader and the default file users edit."""

from retry_config.loader import (
    DEFAULT_PATH,
    ConfigError,
    RetryConfig,
    built_in_types,
    load,
    parse,
    unknown_type,
)
from retry_config.models import (
    MAX_VALUE,
    AdditiveJitter,
    BackoffConfig,
    FullJitter,
    Jitter,
    JobRetryConfig,
    NoJitter,
    ProportionalJitter,
    ScheduleConfig,
)

__all__ = [
    "DEFAULT_PATH",
    "MAX_VALUE",
    "AdditiveJitter",
    "BackoffConfig",
    "ConfigError",
    "FullJitter",
    "Jitter",
    "JobRetryConfig",
    "NoJitter",
    "ProportionalJitter",
    "RetryConfig",
    "ScheduleConfig",
    "built_in_types",
    "load",
    "parse",
    "unknown_type",
]
