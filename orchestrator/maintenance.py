"""Background services, as Procrastinate periodic tasks on the ``maintenance`` queue.

Each run works in bounded batches, loops only while a batch came back full (up to a fixed
number of batches), and logs one line with what it did. Every worker defers them; a unique row
per (task, tick) makes each tick run once, and a tick missed by more than
``periodic_max_delay`` is skipped (no backfill).

- ``sweep_zombies`` (seed 004): RUNNING jobs whose heartbeat is older than the zombie threshold
  go to RETRY or FAILED (see sweeper.py), at most ``sweep_limit`` per run.
- ``retry_safety_net``: a waiting job (PENDING, or RETRY past due) must have a live
  Procrastinate job. One can be lost: a worker killed between recording an infrastructure retry
  and Procrastinate rescheduling it, a Procrastinate job deleted by hand. The net settles a dead
  worker's leftover ``doing`` job and dispatches the job again (``job.redispatched``).
- ``expire_approvals`` (seed 004): approvals past their expiry are decided as expired.
- ``prune_checkpoints``: checkpoints and ledger rows of jobs finished longer ago than the
  retention are deleted (the jobs, their events and dead letters stay).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from orchestrator import approvals, sweeper
from orchestrator.retry_strategy import GraphileRetryStrategy

if TYPE_CHECKING:
    from orchestrator.app import Orchestrator

logger = logging.getLogger(__name__)

QUEUE = "maintenance"
MAX_BATCHES_PER_RUN = 10


def register(orc: Orchestrator) -> None:
    settings = orc.settings
    _periodic(orc, "sweep_zombies", settings.sweep_cron, "sweep_zombies", run_sweep)
    _periodic(orc, "retry_safety_net", settings.safety_net_cron, "sweep_zombies", run_safety_net)
    _periodic(
        orc, "expire_approvals", settings.approvals_cron, "expire_approvals", run_approval_expiry
    )
    _periodic(orc, "prune_checkpoints", settings.prune_cron, "sweep_zombies", run_prune)


def _periodic(
    orc: Orchestrator,
    name: str,
    cron: str,
    config_type: str,
    body: Callable[[Orchestrator], Awaitable[int]],
) -> None:
    attempts = orc.retry_config.for_type(config_type).worker_max_attempts

    @orc.procrastinate.periodic(cron=cron, periodic_id=name)
    @orc.procrastinate.task(
        name=f"orchestrator.{name}", queue=QUEUE, retry=GraphileRetryStrategy(attempts)
    )
    async def service(timestamp: int) -> int:
        return await body(orc)


async def _batches(
    name: str,
    batch: Callable[[int], Awaitable[int]],
    size: int,
    limit: int | None = None,
) -> int:
    """Run ``batch(n)`` (which handles at most ``n`` rows) until a batch comes back short,
    ``limit`` rows are done, or MAX_BATCHES_PER_RUN batches have run."""
    total = 0
    for _ in range(MAX_BATCHES_PER_RUN):
        n = size if limit is None else min(size, limit - total)
        if n <= 0:
            break
        done = await batch(n)
        total += done
        if done < n:
            break
    if total:
        logger.warning("%s: %d", name, total)
    return total


async def run_sweep(orc: Orchestrator) -> int:
    """One run of the zombie sweep (see sweeper.py); returns how many zombies it handled."""
    s = orc.settings

    async def batch(n: int) -> int:
        result = await sweeper.sweep_once(
            orc.store,
            orc.retry_config,
            threshold=s.zombie_threshold,
            expiry_grace=s.job_expiry_grace_seconds,
            limit=n,
            degrade=orc.degrader,
        )
        return result.total

    return await _batches(
        "sweep_zombies: zombie jobs recovered", batch, s.sweep_batch_size, s.sweep_limit
    )


async def run_safety_net(orc: Orchestrator) -> int:
    """One run of the safety net; returns how many jobs it dispatched again."""
    s = orc.settings

    async def batch(n: int) -> int:
        lost = await orc.store.redispatch_lost(
            grace_seconds=s.safety_net_grace_seconds,
            stalled_seconds=s.stalled_worker_seconds,
            limit=n,
        )
        return len(lost)

    return await _batches(
        "retry safety net: jobs whose dispatch was lost, dispatched again",
        batch,
        s.safety_net_batch_size,
    )


async def run_approval_expiry(orc: Orchestrator) -> int:
    size = orc.settings.approvals_batch_size
    return await _batches(
        "expire_approvals: approvals expired",
        lambda n: approvals.expire_due(orc.store, limit=n),
        size,
    )


async def run_prune(orc: Orchestrator) -> int:
    s = orc.settings
    older_than = s.checkpoint_retention_days * 86_400

    async def batch(n: int) -> int:
        return await orc.store.prune_checkpoints(older_than_seconds=older_than, limit=n)

    return await _batches(
        "prune_checkpoints: checkpoint and ledger rows of finished jobs deleted",
        batch,
        s.prune_batch_size,
    )
