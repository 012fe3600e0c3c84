"""Dead letters planted as a terminal failure writes them (their tenant from their job's), for
the dead-letter review tests: many, of chosen types, tenants and errors, at once."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from orchestrator import Orchestrator


def error_of(code: str, message: str, classification: str) -> str:
    """A failure's payload (docs/contracts.md, "Failures"), as JSON."""
    return json.dumps({
        "ts": "2026-11-21T00:00:00Z", "message": message, "code": code,
        "classification": classification, "attempt": 1, "max_attempts": 1, "terminal": True,
    })  # fmt: skip


async def plant(
    orc: Orchestrator, db: psycopg.AsyncConnection[Any], tenant: str, job_type: str,
    error: str, payload: Any = None,
) -> str:  # fmt: skip
    """A dead letter of a new job of ``tenant`` (never run: due in a year); its id."""
    far = datetime.now(UTC) + timedelta(days=365)
    job_id = await orc.submit(job_type, payload, tenant_id=tenant, run_at=far)
    cur = await db.execute(
        "INSERT INTO orc_dead_letters (id, job_id, job_type, payload, error)"
        " VALUES (gen_random_uuid(), %s, %s, %s, %s) RETURNING id",
        (job_id, job_type, json.dumps(payload), error),
    )
    row = await cur.fetchone()
    assert row is not None
    return str(row[0])
