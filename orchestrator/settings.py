"""Deployment settings, read from the environment (``ORCHESTRATOR_*``, plus ``DATABASE_URL``).

Per-job-type behaviour lives in the retry config file, not here; this is what differs between
a laptop, CI and a Kubernetes Deployment.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ORCHESTRATOR_", extra="ignore")

    database_url: str | None = Field(
        None,
        validation_alias=AliasChoices("DATABASE_URL", "ORCHESTRATOR_DATABASE_URL"),
        description="PostgreSQL URL; unset starts the embedded server under data_dir.",
    )
    data_dir: Path = Field(
        Path(".orchestrator"), description="Embedded PostgreSQL lives in <data_dir>/pgdata."
    )
    embedded_database: str = Field("orchestrator", description="Database used on that server.")
    retry_config: Path | None = Field(
        None, description="Retry config file (TOML); unset uses retry_config/default.toml."
    )
    pool_min_size: int = Field(2, ge=1, description="Connections the pool keeps open.")
    pool_max_size: int = Field(
        10, ge=1, description="Connections the pool may open (the worker's default concurrency)."
    )

    worker_concurrency: int = Field(10, ge=1, description="Jobs a worker runs at once.")
    fetch_polling_interval: float = Field(
        5.0, gt=0, description="Seconds between Procrastinate polls when no NOTIFY arrives."
    )
    safety_net_cron: str = Field(
        "* * * * *", description="When the retry safety net looks for lost dispatches."
    )
    safety_net_batch_size: int = Field(500, ge=1, description="Jobs per batch of one run.")
    safety_net_grace_seconds: float = Field(
        10.0, ge=0, description="How long past due a waiting job may go without a dispatch."
    )
    periodic_max_delay: float = Field(
        10.0, ge=0, description="A periodic task missed by more than this is skipped (no backfill)."
    )
    stalled_worker_seconds: float = Field(
        30.0, gt=0, description="A Procrastinate worker silent this long is considered dead."
    )
