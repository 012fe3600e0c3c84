"""The zombie sweep (seed 004, Question 6; seed 001's lease reaper).

A zombie is a RUNNING job whose heartbeat is older than the threshold: its worker died (OOM,
SIGKILL, a node lost), froze, or lost the database; or its attempt is still running
``expiry_grace`` seconds past its job timeout, the backstop (the heartbeat stops advancing
then, see the ``heartbeat`` query). One sweep pass, in one
transaction, over at most ``limit`` zombies locked with SKIP LOCKED (so sweepers running at once
never share one):

    budget left   -> RETRY with the type's backoff, retry_count + 1 (attempt is bumped at the
                     next claim), a new dispatch;            events: job.zombie_detected, ...
    budget spent  -> dead letter, FAILED, and its degradation (orchestrator.degradation);
                                                             events: job.zombie_detected, ...
    either way    -> the lease is superseded (the old attempt's writes are refused, and its
                     worker cancels it at its next heartbeat), and the Procrastinate job the dead
                     worker left in ``doing`` is finished as failed.

The decision is the same pure policy as an attempt's (a TRANSIENT_APP failure, code ZOMBIE).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from orchestrator.classification import Classified, ErrorClass
from orchestrator.degradation import Degrader
from orchestrator.policy import Budget, Fail, decide
from orchestrator.store import JobStore
from retry_config import RetryConfig


@dataclass(frozen=True)
class SweepResult:
    retried: int
    failed: int

    @property
    def total(self) -> int:
        return self.retried + self.failed


async def sweep_once(
    store: JobStore,
    config: RetryConfig,
    *,
    threshold: float,
    expiry_grace: float,
    limit: int,
    degrade: Degrader,
    rng: random.Random | None = None,
) -> SweepResult:
    async with store.pool.connection() as conn, conn.transaction():
        zombies = await store.zombies(conn, threshold=threshold, limit=limit)
        now = datetime.now(UTC)
        retry: list[dict[str, Any]] = []
        fail: list[dict[str, Any]] = []
        submit: dict[str, list[dict[str, Any]]] = {}  # the human notifications of failed ones
        for z in zombies:
            overran = (
                z["deadline_at"] is not None
                and z["deadline_at"] + timedelta(seconds=expiry_grace) <= now
            )
            classified = Classified(
                ErrorClass.TRANSIENT_APP, "ZOMBIE_DEADLINE" if overran else "ZOMBIE"
            )
            budget = Budget(
                retry_count=z["retry_count"],
                max_retries=z["max_retries"],
                run=z["dispatch_attempt"],
                max_attempts=z["max_attempts"],
            )
            decision = decide(classified, budget, config.for_type(z["job_type"]).backoff, rng)
            message = _message(z, threshold, overran)
            zombie = {
                "attempt": z["attempt"],
                "worker": z["locked_by"],
                "last_heartbeat": z["heartbeat_at"].isoformat(),
                "threshold_seconds": threshold,
                "reason": "deadline" if overran else "heartbeat",
            }
            error = {
                "ts": now.isoformat(),
                "message": message,
                "code": classified.code,
                "classification": classified.error_class.value,
                "attempt": z["attempt"],
                "max_attempts": z["max_attempts"],
                "run": z["dispatch_attempt"],
                "retry_count": z["retry_count"],
                "max_retries": z["max_retries"],
                "terminal": isinstance(decision, Fail),
            }
            summary = {
                "message": message,
                "code": classified.code,
                "classification": classified.error_class.value,
            }
            if isinstance(decision, Fail):
                failed = {"terminal": True, "attempt": z["attempt"], "error": summary}
                degraded = degrade(
                    job_id=z["id"], job_type=z["job_type"], payload=z["payload"],
                    error_class=classified.error_class, error=error,
                )  # fmt: skip
                submit[str(z["id"])] = degraded.submit
                fail.append(
                    {**_key(z), "error": error, "zombie": zombie, "failed": failed,
                     "degraded": degraded.event}
                )  # fmt: skip
            else:
                at = now + timedelta(milliseconds=decision.delay_ms)
                error |= {"backoff_ms": decision.delay_ms, "next_available_at": at.isoformat()}
                retry.append(
                    {
                        **_key(z),
                        "next_retry_at": at.isoformat(),
                        "error": error,
                        "zombie": zombie,
                        "retry": {"layer": "app", "backoff_ms": round(decision.delay_ms, 3)},
                    }
                )
        retried, failed_ids = await store.sweep(conn, retry=retry, fail=fail, submit=submit)
        await store.settle_dispatches(
            [z["procrastinate_job_id"] for z in zombies if z["procrastinate_job_id"]], conn
        )
    return SweepResult(retried=len(retried), failed=len(failed_ids))


def _key(zombie: dict[str, Any]) -> dict[str, Any]:
    return {"id": str(zombie["id"]), "lease_token": str(zombie["lease_token"])}


def _message(zombie: dict[str, Any], threshold: float, overran: bool) -> str:
    if overran:
        return f"Zombie job detected: attempt {zombie['attempt']} overran its deadline"
    return (
        f"Zombie job detected: no heartbeat since {zombie['heartbeat_at'].isoformat()} "
        f"(threshold {threshold:g} s)"
    )
