"""The per-job-type retry configuration (seed 004's ``JobRetryConfig``) as pydantic models.

Models are frozen and reject unknown fields, so a typo in the config file is an error at load,
not a silently ignored setting.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NoJitter(_Frozen):
    mode: Literal["none"] = "none"


class FullJitter(_Frozen):
    """Uniform in [0, delay] (seed 004: spreads a thundering herd over the whole interval)."""

    mode: Literal["full"] = "full"


class ProportionalJitter(_Frozen):
    """Uniform in [delay·(1-ratio), delay·(1+ratio)] (seed 000: ±30%)."""

    mode: Literal["proportional"] = "proportional"
    ratio: float = Field(0.3, gt=0, le=1)


class AdditiveJitter(_Frozen):
    """delay + uniform in [0, max_ms] (seed 003: 0-300 ms)."""

    mode: Literal["additive"] = "additive"
    max_ms: int = Field(300, ge=0)


def _jitter_shorthand(value: Any) -> Any:
    """Accept ``jitter = "full"`` and the seed's ``jitter = true/false`` as well as a table."""
    if value is True:
        return {"mode": "full"}
    if value is False:
        return {"mode": "none"}
    if isinstance(value, str):
        return {"mode": value}
    return value


Jitter = Annotated[
    NoJitter | FullJitter | ProportionalJitter | AdditiveJitter,
    Field(discriminator="mode"),
    BeforeValidator(_jitter_shorthand),
]


class BackoffConfig(_Frozen):
    """Application-layer backoff: ``min(cap, base · multiplier^(n-1))`` plus jitter."""

    base_ms: int = Field(1_000, gt=0)
    cap_ms: int = Field(300_000, gt=0)
    multiplier: float = Field(2.0, ge=1)
    jitter: Jitter = FullJitter()

    @model_validator(mode="after")
    def _cap_not_below_base(self) -> BackoffConfig:
        if self.cap_ms < self.base_ms:
            raise ValueError(f"cap_ms ({self.cap_ms}) must be >= base_ms ({self.base_ms})")
        return self


class JobRetryConfig(_Frozen):
    """Everything that governs retries and timeouts of one job type."""

    worker_max_attempts: int = Field(
        3, ge=1, description="Total infrastructure runs per dispatch (Graphile's maxAttempts)."
    )
    app_max_retries: int = Field(3, ge=0, description="Application-level retries (RETRY state).")
    backoff: BackoffConfig = BackoffConfig()
    job_timeout_seconds: int = Field(3_600, gt=0)
    call_timeout_ms: int = Field(120_000, gt=0)
    connect_timeout_ms: int = Field(30_000, gt=0)
    queue: str | None = Field(
        None, min_length=1, max_length=128, description="Procrastinate queue; the type's name."
    )

    @model_validator(mode="after")
    def _inner_timeouts_fit(self) -> JobRetryConfig:
        if self.connect_timeout_ms > self.call_timeout_ms:
            raise ValueError(
                f"connect_timeout_ms ({self.connect_timeout_ms}) must be <= "
                f"call_timeout_ms ({self.call_timeout_ms})"
            )
        if self.call_timeout_ms > self.job_timeout_seconds * 1_000:
            raise ValueError(
                f"call_timeout_ms ({self.call_timeout_ms}) must be <= job_timeout_seconds "
                f"({self.job_timeout_seconds}) x 1000: an inner timeout has to fire first"
            )
        return self
