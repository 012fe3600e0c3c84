"""Per-job-type retry configuration: the models, the loader and the default file users edit."""

from retry_config.loader import DEFAULT_PATH, ConfigError, RetryConfig, load, parse
from retry_config.models import (
    AdditiveJitter,
    BackoffConfig,
    FullJitter,
    Jitter,
    JobRetryConfig,
    NoJitter,
    ProportionalJitter,
)

__all__ = [
    "DEFAULT_PATH",
    "AdditiveJitter",
    "BackoffConfig",
    "ConfigError",
    "FullJitter",
    "Jitter",
    "JobRetryConfig",
    "NoJitter",
    "ProportionalJitter",
    "RetryConfig",
    "load",
    "parse",
]
