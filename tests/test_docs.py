"""The configuration reference names every setting and every retry config field there is."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator import Settings
from retry_config import BackoffConfig, JobRetryConfig

REFERENCE = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()


@pytest.mark.parametrize("name", sorted(Settings.model_fields))
def test_every_setting_is_documented(name: str) -> None:
    variable = "DATABASE_URL" if name == "database_url" else f"ORCHESTRATOR_{name.upper()}"
    if name in ("pool_min_size", "pool_max_size"):
        variable = "ORCHESTRATOR_POOL_MIN_SIZE"  # documented together with _MAX_SIZE
    assert f"`{variable}" in REFERENCE


@pytest.mark.parametrize(
    "field",
    sorted(JobRetryConfig.model_fields.keys() - {"backoff"})
    + [f"backoff.{name}" for name in sorted(BackoffConfig.model_fields)],
)
def test_every_retry_config_field_is_documented(field: str) -> None:
    assert f"| `{field}` |" in REFERENCE
