"""Deployment settings, read from the environment (``ORCHESTRATOR_*``, plus ``DATABASE_URL``).

Per-job-type behaviour lives in the retry config file, not here; this is what differs between
a laptop, CI and a Kubernetes Deployment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import psycopg
from croniter import croniter
from psycopg.conninfo import conninfo_to_dict
from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DATA_DIR = ".orchestrator"


def nearest_data_dir(start: Path) -> Path:
    """The nearest ``.orchestrator`` holding an embedded cluster (``pgdata``), in ``start`` or
    a folder above it: a command run from a project's subfolder uses the project's database
    rather than a new, empty one; ``start/.orchestrator`` when there is none."""
    for folder in (start, *start.parents):
        if (folder / DATA_DIR / "pgdata").is_dir():
            return folder / DATA_DIR
    return start / DATA_DIR


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ORCHESTRATOR_", extra="ignore")

    application: str = Field(
        "default",
        pattern=r"^[a-z][a-z0-9_.-]{0,62}$",
        description="The name of the application this process belongs to, when several share"
        " one database (docs/applications.md): its job types, limits and schedules are recorded"
        " as its own, and a sync (worker or `serve` start, a reload, `migrate`) changes only"
        " them. Lower-case letters, digits, '_', '.' and '-', starting with a letter.",
    )
    database_url: str | None = Field(
        None,
        validation_alias=AliasChoices("DATABASE_URL", "ORCHESTRATOR_DATABASE_URL"),
        description="PostgreSQL URL; unset starts the embedded server under data_dir.",
    )
    data_dir: Path = Field(
        default_factory=lambda: nearest_data_dir(Path.cwd()),
        description="Embedded PostgreSQL lives in <data_dir>/pgdata; unset: the nearest"
        " .orchestrator holding one, in the current directory or a folder above it (as git"
        " finds .git), else ./.orchestrator.",
    )
    embedded_database: str = Field("orchestrator", description="Database used on that server.")
    connect_timeout: int = Field(
        5,
        ge=2,
        le=300,
        description="Seconds a connection attempt may take before it fails with its reason"
        " (libpq's connect_timeout; a DATABASE_URL that sets its own keeps it).",
    )
    retry_config: Path | None = Field(
        None, description="Retry config file (TOML); unset uses retry_config/default.toml."
    )
    retry_config_poll_seconds: float = Field(
        5.0, ge=0, le=3600,
        description="How often a worker and `orchestrator serve` read their retry config file"
        " for a new version, applied without a restart once valid (docs/configuration.md,"
        ' "Reloading"); 0: read at start-up only.',
    )  # fmt: skip
    secrets_dir: Path = Field(
        Path("/var/run/secrets/orchestrator"),
        description="Where secrets not set in the environment are read from, one file per"
        " secret (a mounted Kubernetes Secret).",
    )
    escalation_target: dict[str, Any] | None = Field(
        None,
        description="Where a failed job's human notification goes: the payload of an"
        ' escalation_job_type job, e.g. {"channel": "webhook", "url": "https://..."} (JSON);'
        " unset: failures are logged and recorded (job.degraded), nobody is notified.",
    )
    escalation_job_type: str = Field(
        "send_notification", description="The job type that carries human notifications."
    )
    approval_target: dict[str, Any] | None = Field(
        None,
        description="Where a waiting approval is announced: the target of an approval_job_type"
        ' job, e.g. {"channel": "telegram", "chat_id": 42} (JSON); unset: escalation_target;'
        " both unset: approvals are only listed (orchestrator approvals list).",
    )
    approval_job_type: str = Field(
        "approval_notify", description="The job type that tells a person an approval waits."
    )
    max_payload_bytes: int = Field(
        1_048_576,
        ge=1,
        le=256 * 1_048_576,
        description="A job's payload may be this large at most, as JSON (UTF-8); a larger one is"
        " refused at submit (InvalidPayload).",
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description="How a worker logs: text lines for a terminal, or json, one object per line"
        " with the attempt's fields (job_id, job_type, attempt, trace_id, worker).",
    )
    tracing: Literal["off", "otel"] = Field(
        "off",
        description="otel: OpenTelemetry spans for submits, attempts, steps and calls, through"
        " the global tracer provider (the otel extra); off: opentelemetry is never imported.",
    )
    pool_min_size: int = Field(2, ge=1, description="Connections the pool keeps open.")
    pool_max_size: int = Field(
        10, ge=1, description="Connections the pool may open (the worker's default concurrency)."
    )
    pool_timeout: float = Field(
        30.0, gt=0,
        description="Longest a statement waits for a pooled connection (all busy, or none can"
        " be made: the database is away) before it fails as DATABASE_UNAVAILABLE.",
    )  # fmt: skip

    worker_concurrency: int = Field(10, ge=1, description="Jobs a worker runs at once.")
    fetch_polling_interval: float = Field(
        5.0,
        gt=0,
        description="Seconds between a worker's fetches when nothing wakes it (a notification,"
        " a due time, a freed slot); also how often it re-reads the soonest due time.",
    )
    safety_net_cron: str = Field(
        "* * * * *", description="When the retry safety net looks for lost dispatches."
    )
    safety_net_batch_size: int = Field(500, ge=1, description="Jobs per batch of one run.")
    safety_net_grace_seconds: float = Field(
        10.0, ge=0, description="How long past due a waiting job may go without a dispatch."
    )
    drain_seconds: float = Field(
        45.0,
        ge=0,
        description="After SIGTERM, how long running jobs may go on before they are"
        " handed back (45 s, inside a 65 s grace period with a 5 s preStop: docs/contracts.md).",
    )
    metrics: bool = Field(
        True,
        description="Count the workers' metrics and serve them at /metrics on the health port;"
        " off, nothing is counted (bench/throughput.py measures the difference).",
    )
    exporter_port: int = Field(
        9464, ge=1, le=65535,
        description="Port of `orchestrator exporter`'s /metrics (the fleet's metrics, from the"
        " database), /healthz and /readyz.",
    )  # fmt: skip
    exporter_min_interval: float = Field(
        5.0, ge=0,
        description="Seconds a fleet scrape is reused for: more scrapers (Prometheus replicas)"
        " within it cost the database nothing more.",
    )  # fmt: skip
    metrics_max_tenants: int = Field(
        100, ge=1, le=10_000,
        description="Tenants named in the fleet metrics at most (the largest); the others are"
        " summed under the tenant _other.",
    )  # fmt: skip
    health_port: int = Field(
        8080, ge=0, le=65535, description="Port of /healthz and /readyz; 0 turns them off."
    )
    api_host: str = Field("127.0.0.1", description="Address `orchestrator serve` listens on.")
    api_port: int = Field(
        8000, ge=0, le=65535, description="Port of `orchestrator serve` (the HTTP API, /ui)."
    )
    api_max_body_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, le=1024**3,
        description="Largest request body the API reads; a larger one gets 413.",
    )  # fmt: skip
    api_open_metrics: bool = Field(
        True,
        description="Serve the API server's /metrics, /healthz and /readyz without a token"
        " (for probes and Prometheus on a private network); false: /metrics needs the read"
        " scope.",
    )
    api_replay_endpoints: bool = Field(
        False,
        description="Serve the internal replay endpoints (POST /api/v1/internal/jobs/{id}/run,"
        " admin scope; docs/api.md); off they answer 404.",
    )
    api_wait_max_seconds: float = Field(
        60.0, gt=0, le=3600,
        description="Longest a long-poll (an outcome's wait, an external worker's claim) may"
        " wait; longer requests wait this long.",
    )  # fmt: skip
    api_database_wait_seconds: float = Field(
        0.5, gt=0, le=60,
        description="Longest a request to `orchestrator serve` waits for a pooled connection"
        " before it checks that the database answers (one direct connection, at most 1 s):"
        " if not, it answers 503 DATABASE_UNAVAILABLE, and so does every request at once until"
        " the database answers again; if so (the pool is only busy), it waits on up to"
        " pool_timeout.",
    )  # fmt: skip
    api_stream_ping_seconds: float = Field(
        15.0, gt=0, le=3600,
        description="An idle event stream (a job's /stream, the dashboard's live pages) sends"
        " a `: ping` comment this often, so proxies and clients keep it open.",
    )  # fmt: skip
    heartbeat_interval: float = Field(
        30.0, gt=0, description="Seconds between a worker's heartbeats."
    )
    zombie_threshold: float = Field(
        300.0, gt=0, description="A RUNNING job silent this long is a zombie."
    )
    job_expiry_grace_seconds: float = Field(
        60.0,
        ge=0,
        description="The backstop: an attempt still RUNNING this long past its job timeout is"
        " a zombie even if it heartbeats (Graphile Worker's job_expiry = timeout + 60 s).",
    )
    sweep_cron: str = Field("* * * * *", description="When sweep_zombies runs (every minute).")
    sweep_limit: int = Field(
        1000,
        ge=1,
        description="Zombies recovered per sweep run at most: a mass recovery is spread over"
        " several runs (no stampede of recovered jobs after an outage).",
    )
    sweep_batch_size: int = Field(
        250, ge=1, description="Zombies handled per transaction within a run."
    )
    approvals_cron: str = Field(
        "* * * * *", description="When expire_approvals fails (or resumes) expired approvals."
    )
    approvals_batch_size: int = Field(100, ge=1, description="Approvals expired per batch.")
    checkpoint_retention_days: float = Field(
        7.0, ge=0, description="Checkpoints and ledger rows of finished jobs are kept this long."
    )
    prune_cron: str = Field("17 * * * *", description="When the retention prune runs.")
    prune_batch_size: int = Field(5000, ge=1, description="Rows deleted per batch of a prune.")
    # -- retention of finished jobs (prune_finished) --
    job_retention_days: float = Field(
        7.0, ge=0, le=36_500,
        description="COMPLETED and CANCELLED jobs are deleted this long after they finished, with"
        " their events, checkpoints, ledger rows and dispatches (per type: retention_days).",
    )  # fmt: skip
    failed_job_retention_days: float = Field(
        30.0, ge=0, le=36_500,
        description="FAILED jobs are deleted this long after they failed, never while their dead"
        " letter awaits review (per type: failed_retention_days).",
    )  # fmt: skip
    retention_cron: str = Field("* * * * *", description="When prune_finished runs.")
    retention_batch_size: int = Field(
        1000, ge=1, le=100_000, description="Finished jobs deleted per statement of a run."
    )
    retention_run_seconds: float = Field(
        30.0, ge=0, le=3600,
        description="A run of prune_finished goes on while its batches come back full for this"
        " long at most (0: one batch); one that stops so with jobs still due logs that retention"
        " fell behind, and the next run goes on.",
    )  # fmt: skip
    archive_dir: Path | None = Field(
        None,
        description="Where prune_finished writes what it deletes (a gzip JSON Lines file per"
        " run) before deleting it; unset: nothing is archived.",
    )
    rollup_cron: str = Field(
        "* * * * *",
        description="When rollup_jobs rolls up the closed minutes' finished jobs, samples the"
        " queue depth and deletes rollups past their retention.",
    )
    rollup_settle_seconds: float = Field(
        60.0, ge=0, le=3600,
        description="A minute is rolled up this long after it ended: a job's finish committed"
        " later than that after its finish time would be missed.",
    )  # fmt: skip
    rollup_batch_minutes: int = Field(
        10, ge=1, le=1440,
        description="Minutes rolled up per transaction (a run takes up to ten such batches: a"
        " history is caught up 100 minutes per run).",
    )  # fmt: skip
    rollup_retention_days: float = Field(
        35.0, ge=1,
        description="Per-minute rollups and queue depth samples are kept this long.",
    )  # fmt: skip
    rollup_hourly_retention_days: float = Field(
        400.0, ge=1, description="Hourly rollups are kept this long."
    )
    periodic_max_delay: float = Field(
        10.0, ge=0, description="A periodic task missed by more than this is skipped (no backfill)."
    )
    stalled_worker_seconds: float = Field(
        30.0, gt=0, description="A Procrastinate worker silent this long is considered dead."
    )

    # -- schedules (orchestrator.services.scheduler; docs/job-types.md, "Schedules") --
    crontab: Path | None = Field(
        None,
        description="A crontab file in Graphile Worker's format whose lines are schedules"
        " (docs/job-types.md); unset: none.",
    )
    schedule_grace_seconds: float = Field(
        60.0,
        ge=0,
        le=86_400,
        description="A tick missed by at most this long still runs, whatever the schedule's"
        " backfill (a process woken late, a restart); older ones run only within the"
        " schedule's backfill window.",
    )
    schedule_check_seconds: float = Field(
        60.0,
        gt=0,
        le=3_600,
        description="A scheduler sleeps until its next tick, and at most this long: how soon"
        " a pause, a resume or a definition changed elsewhere is seen.",
    )

    # -- Graphile Worker's producers (docs/graphile.md) --
    graphile_compat: bool = Field(
        False,
        description="`orchestrator migrate` installs Graphile Worker's SQL API for producers"
        " (add_job, add_jobs, remove_job, complete_jobs, permanently_fail_jobs, reschedule_jobs)"
        " in the schema graphile_worker; off: it removes it.",
    )
    graphile_tenant: str | None = Field(
        None,
        description="The tenant of the jobs added through Graphile Worker's API; unset: none"
        " (a tenant's name as a submit takes it: `migrate` refuses another).",
    )

    @field_validator(
        "safety_net_cron", "sweep_cron", "approvals_cron", "prune_cron", "retention_cron",
        "rollup_cron",
    )  # fmt: skip
    @classmethod
    def _cron(cls, value: str) -> str:
        """A schedule Procrastinate's periodic tasks can follow (croniter: five fields, or six
        with seconds last)."""
        if not croniter.is_valid(value):
            raise ValueError("not a cron schedule (five fields, or six with seconds last)")
        return value

    @field_validator("database_url")
    @classmethod
    def _connection_string(cls, value: str | None) -> str | None:
        """A URL or key=value string libpq can read: a malformed one is said at once, naming
        the setting, in one line that repeats none of it (libpq's own reason may quote a part
        of a password), rather than failing in the first connection's traceback."""
        if value is not None:
            try:
                conninfo_to_dict(value)
            except psycopg.ProgrammingError:
                raise ValueError(
                    "not a PostgreSQL URL (postgresql://user:password@host:port/database) nor a"
                    " key=value connection string"
                ) from None
        return value

    @model_validator(mode="after")
    def _heartbeats_fit_the_threshold(self) -> Settings:
        """A live job must not look dead: one late heartbeat may not reach the threshold."""
        if self.heartbeat_interval * 2 > self.zombie_threshold:
            raise ValueError(
                f"ORCHESTRATOR_HEARTBEAT_INTERVAL ({self.heartbeat_interval:g} s) must be at most"
                f" half of ORCHESTRATOR_ZOMBIE_THRESHOLD ({self.zombie_threshold:g} s): a running"
                " job whose heartbeat is late once would be swept as a zombie"
            )
        return self
