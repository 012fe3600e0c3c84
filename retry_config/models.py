"""The per-job-type retry configuration (the design's ``JobRetryConfig``) as pydantic models.

Models are frozen and reject unknown fields, so a typo in the config file is an error at load,
not a silently ignored setting.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal
from zoneinfo import ZoneInfo

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from retry_config.names import MAX_TENANT, Queue, TenantId, tenant_refusal
from retry_config.schedule import CRON_FORMS, check_cron, zone

#: No single step should take more than 10 minutes.
DEFAULT_STEP_TIMEOUT_SECONDS = 600
#: The largest count, duration (in its unit) or delay a config may hold: what the job table's
#: integer columns store, and far inside what a timestamp can be moved by (a delay of this many
#: milliseconds is under 25 days). A larger value is refused at load, not when a job first needs
#: it.
MAX_VALUE = 2**31 - 1


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NoJitter(_Frozen):
    mode: Literal["none"] = "none"


class FullJitter(_Frozen):
    """Uniform in [0, delay] (spreads a thundering herd over the whole interval)."""

    mode: Literal["full"] = "full"


class ProportionalJitter(_Frozen):
    """Uniform in [delay·(1-ratio), delay·(1+ratio)] (e.g. ±30%)."""

    mode: Literal["proportional"] = "proportional"
    ratio: float = Field(0.3, gt=0, le=1)


class AdditiveJitter(_Frozen):
    """delay + uniform in [0, max_ms] (e.g. 0-300 ms)."""

    mode: Literal["additive"] = "additive"
    max_ms: int = Field(300, ge=0, le=MAX_VALUE)


def _jitter_shorthand(value: Any) -> Any:
    """Accept ``jitter = "full"`` and the design's ``jitter = true/false`` as well as a table."""
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

    base_ms: int = Field(1_000, gt=0, le=MAX_VALUE)
    cap_ms: int = Field(300_000, gt=0, le=MAX_VALUE)
    multiplier: float = Field(2.0, ge=1, le=1_000)
    jitter: Jitter = FullJitter()

    @model_validator(mode="after")
    def _cap_not_below_base(self) -> BackoffConfig:
        if self.cap_ms < self.base_ms:
            raise ValueError(f"cap_ms ({self.cap_ms}) must be >= base_ms ({self.base_ms})")
        return self


class ScheduleConfig(_Frozen):
    """One schedule's options. Each tick submits one ordinary job of the schedule's type."""

    cron: str = Field(description=f"When it fires: {CRON_FORMS}.")
    tz: str = Field("UTC", description="The IANA time zone the expression is read in.")
    backfill_seconds: int = Field(
        0,
        ge=0,
        le=MAX_VALUE,
        description="After downtime, the ticks missed within this many seconds still run "
        "(Graphile Worker's backfillPeriod); older ones are skipped. 0: none beyond the "
        "scheduler's grace (ORCHESTRATOR_SCHEDULE_GRACE_SECONDS).",
    )
    payload: Any = Field(None, description="Every run's payload.")
    tenant_id: TenantId | None = Field(None, description="The tenant every run belongs to.")
    priority: int = Field(0, ge=-(2**31) + 1, le=2**31 - 1, description="Lower runs first.")
    queue: Queue | None = Field(
        None, description="The type's own; not one the orchestrator reserves."
    )
    max_retries: int | None = Field(
        None, ge=0, le=MAX_VALUE, description="Application retries; unset: the type's."
    )

    @field_validator("cron")
    @classmethod
    def _cron(cls, value: str) -> str:
        return check_cron(value)

    @field_validator("tz")
    @classmethod
    def _tz(cls, value: str) -> str:
        zone(value)
        return value

    @property
    def zone(self) -> ZoneInfo:
        return zone(self.tz)


_KEY_FIELDS = ("job_type", "tenant", "agent")


class FlowLimit(_Frozen):
    """A fleet-wide limit (docs/flow-control.md): each key its template renders gets these
    allowances, enforced at the claim, in the database."""

    key: str = Field(
        "{job_type}",
        min_length=1,
        max_length=200,
        description="The key template: literal text and {job_type}, {tenant}, {agent}, "
        '{payload.<field>} (e.g. "anthropic:{payload.model}"). Never put a secret in it.',
    )
    concurrency: int | None = Field(
        None, gt=0, le=MAX_VALUE, description="The most jobs of one key running at once."
    )
    requests: int | None = Field(
        None,
        gt=0,
        le=MAX_VALUE,
        description="Calls (requests) one key may make per interval; a job's start admits its "
        "first call, and each further call is admitted before it is sent.",
    )
    units: int | None = Field(
        None,
        gt=0,
        le=MAX_VALUE,
        description="Units (e.g. tokens) one key may spend per interval; a job's cost is "
        "declared at submit or estimated by its type, and reconciled with what it used.",
    )
    interval_seconds: float = Field(
        60, gt=0, le=86_400, description="The sliding window of requests and units."
    )
    learn: bool = Field(
        False,
        description="Learn each key's limits from its provider's replies (their "
        "anthropic-ratelimit-* or x-ratelimit-* headers): a lower provider limit lowers the "
        "key's requests and units (the configured ones stay ceilings), a limit with nothing "
        "remaining holds the key until its reset. With learn, no number need be configured.",
    )
    share_by: Literal["tenant", "agent", "none"] = Field(
        "tenant", description="Whose jobs share a key's capacity fairly when they wait."
    )
    weights: dict[str, Annotated[float, Field(gt=0, le=1_000)]] = Field(
        default_factory=dict,
        description="A share's weight (default 1): a share of weight 3 starts three jobs (or "
        "units) for each one of a share of weight 1 while both wait.",
    )
    tenant_share: float | None = Field(
        None,
        gt=0,
        le=1,
        description="The most of one key's concurrency, requests and units that one share (a "
        'tenant; an agent with share_by = "agent") may hold at once, as a fraction (e.g. 0.5; '
        "each at least 1). Unset: a share may take the whole key when no other waits.",
    )

    @field_validator("weights")
    @classmethod
    def _shares_named(cls, value: dict[str, float]) -> dict[str, float]:
        """A share is a tenant (or an agent): named, never empty or blank (retry_config.names)."""
        for share in value:
            if tenant_refusal(share) is not None:
                raise ValueError(
                    f"weights: {share!r} names no tenant or agent: a share's name has 1 to "
                    f"{MAX_TENANT} characters, not all whitespace"
                )
        return value

    @field_validator("key")
    @classmethod
    def _template(cls, value: str) -> str:
        for name in re.findall(r"\{([^{}]*)\}", value):
            if name in _KEY_FIELDS or re.fullmatch(r"payload(\.[A-Za-z0-9_-]+)+", name):
                continue
            raise ValueError(
                f"unknown placeholder {{{name}}}: use {{job_type}}, {{tenant}}, {{agent}} or "
                "{payload.<field>}"
            )
        if value.count("{") != value.count("}"):
            raise ValueError("unbalanced braces in the key template")
        return value

    @model_validator(mode="after")
    def _limits_something(self) -> FlowLimit:
        numbers = (self.concurrency, self.requests, self.units)
        if all(number is None for number in numbers) and not self.learn:
            raise ValueError("set at least one of concurrency, requests and units, or learn = true")
        if self.tenant_share is not None and self.share_by == "none":
            raise ValueError(
                'tenant_share caps one share of a key, and share_by = "none" makes none: set '
                'share_by to "tenant" or "agent", or remove tenant_share'
            )
        return self


class JobRetryConfig(_Frozen):
    """Everything that governs retries and timeouts of one job type."""

    worker_max_attempts: int = Field(
        3,
        ge=1,
        le=MAX_VALUE,
        description="Total infrastructure runs per dispatch (Graphile's maxAttempts).",
    )
    app_max_retries: int = Field(
        3, ge=0, le=MAX_VALUE, description="Application-level retries (RETRY state)."
    )
    backoff: BackoffConfig = BackoffConfig()
    job_timeout_seconds: int = Field(
        3_600,
        gt=0,
        le=MAX_VALUE,
        description="Wall-clock limit of one attempt; overrunning fails the job.",
    )
    step_timeout_seconds: int | None = Field(
        None,
        gt=0,
        le=MAX_VALUE,
        description="Limit of one checkpointed step; overrunning retries from the last "
        f"checkpoint. Unset: {DEFAULT_STEP_TIMEOUT_SECONDS} s, or the job timeout if shorter.",
    )
    call_timeout_ms: int = Field(
        120_000, gt=0, le=MAX_VALUE, description="Total limit of one external call."
    )
    connect_timeout_ms: int = Field(
        30_000, gt=0, le=MAX_VALUE, description="Connect phase of one call."
    )
    inter_chunk_timeout_ms: int | None = Field(
        None,
        gt=0,
        le=MAX_VALUE,
        description="Streaming calls: longest silence between two chunks (tokens) before the "
        "stream counts as stalled (60 s for LLM streams in the default file). Unset: no such "
        "limit.",
    )
    tool_timeouts_ms: dict[str, Annotated[int, Field(gt=0, le=MAX_VALUE)]] = Field(
        default_factory=dict,
        description="Per-tool call limits; other calls use call_timeout_ms.",
    )
    fallback_models: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(
        default_factory=list,
        max_length=20,
        description="llm_generate and run_agent: the models a call moves to, in this order, "
        "when its model is overloaded (529) or rate-limited (429) with a hint longer than "
        "fallback_after_seconds, within the same attempt; each model is tried at most once per "
        "call. Empty: no fallback.",
    )
    fallback_after_seconds: float = Field(
        30,
        ge=0,
        le=MAX_VALUE,
        description="A rate limit (429) whose server hint is longer than this moves the call to "
        "the next of fallback_models; a shorter one, or none, is retried on the same model. "
        "Under a flow-control limit, a key paused for longer than this lets the type's jobs "
        "through to the next model.",
    )
    queue: Queue | None = Field(
        None,
        description="Procrastinate queue; the type's name. Not one the orchestrator reserves "
        "(maintenance).",
    )
    retention_days: float | None = Field(
        None,
        ge=0,
        le=36_500,
        description="Days a COMPLETED or CANCELLED job of this type is kept after it finished,"
        " with its events, checkpoints, ledger and dispatches. Unset:"
        " ORCHESTRATOR_JOB_RETENTION_DAYS.",
    )
    failed_retention_days: float | None = Field(
        None,
        ge=0,
        le=36_500,
        description="Days a FAILED job of this type is kept (and longer while its dead letter"
        " awaits review). Unset: ORCHESTRATOR_FAILED_JOB_RETENTION_DAYS.",
    )
    output_max_bytes: int = Field(
        1_048_576,
        ge=0,
        le=MAX_VALUE,
        description="Most bytes of live output (ctx.output, the LLM types' text deltas) a job "
        "keeps, across its attempts; past it one `cut` record is written and later output is "
        "dropped (docs/output.md).",
    )
    external: bool = Field(
        False,
        description="Run by external workers over the HTTP API (task-claim, heartbeat, "
        "task-complete; docs/api.md), in any language; in-process workers never take its "
        "queue. Set per job type, not in [defaults].",
    )
    schedule: ScheduleConfig | None = Field(
        None,
        description="Run this type by itself on a cron schedule (docs/job-types.md, "
        '"Schedules"): a schedule named after the type. Set per job type, not in [defaults].',
    )
    limit: str | None = Field(
        None,
        min_length=1,
        max_length=100,
        description="The name of the [limits.<name>] its jobs run under (docs/flow-control.md). "
        "Set per job type, not in [defaults].",
    )

    @model_validator(mode="after")
    def _inner_timeouts_fit(self) -> JobRetryConfig:
        """Inner timeouts fire before outer ones (docs/contracts.md, "Timeouts")."""
        if self.step_timeout_seconds is not None and self.step_timeout_seconds > (
            self.job_timeout_seconds
        ):
            raise ValueError(
                f"step_timeout_seconds ({self.step_timeout_seconds}) must be <= "
                f"job_timeout_seconds ({self.job_timeout_seconds}): an inner timeout has to "
                "fire first"
            )
        if self.connect_timeout_ms > self.call_timeout_ms:
            raise ValueError(
                f"connect_timeout_ms ({self.connect_timeout_ms}) must be <= "
                f"call_timeout_ms ({self.call_timeout_ms})"
            )
        if self.inter_chunk_timeout_ms is not None and (
            self.inter_chunk_timeout_ms > self.call_timeout_ms
        ):
            raise ValueError(
                f"inter_chunk_timeout_ms ({self.inter_chunk_timeout_ms}) must be <= "
                f"call_timeout_ms ({self.call_timeout_ms})"
            )
        step_ms = self.step_timeout() * 1_000
        for name, limit in {
            "call_timeout_ms": self.call_timeout_ms,
            **{f"tool_timeouts_ms.{tool}": ms for tool, ms in self.tool_timeouts_ms.items()},
        }.items():
            if limit > step_ms:
                raise ValueError(
                    f"{name} ({limit}) must be <= the step timeout ({step_ms:g} ms): an inner "
                    "timeout has to fire first"
                )
        return self

    def step_timeout(self, job_timeout_seconds: float | None = None) -> float:
        """Seconds one step may take in a job whose timeout is ``job_timeout_seconds`` (the
        type's unless a submit overrode it): never longer than the job itself."""
        job = job_timeout_seconds or self.job_timeout_seconds
        return min(self.step_timeout_seconds or DEFAULT_STEP_TIMEOUT_SECONDS, job)

    def inter_chunk_timeout(self) -> float | None:
        """Seconds a stream may stay silent, or None for no limit but the call's."""
        return None if self.inter_chunk_timeout_ms is None else self.inter_chunk_timeout_ms / 1_000

    def call_timeout(self, tool: str | None = None) -> float:
        """Seconds one call may take: the tool's own limit if it has one."""
        return self.tool_timeouts_ms.get(tool or "", self.call_timeout_ms) / 1_000
