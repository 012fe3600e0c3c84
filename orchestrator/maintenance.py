"""Background services, as Procrastinate periodic tasks on the ``maintenance`` queue.

Each run works in bounded batches, loops only while a batch came back full (up to a fixed
number of batches), and logs one line with what it did.

- ``retry_safety_net``: a waiting job (PENDING, or RETRY past due) must have a live
  Procrastinate job. One can be lost: a worker killed between recording an infrastructure retry
  and Procrastinate rescheduling it, a Procrastinate job deleted by hand. The net settles a dead
  worker's leftover ``doing`` job and dispatches the job again (``job.redispatched``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from orchestrator.retry_strategy import GraphileRetryStrategy

if TYPE_CHECKING:
    from orchestrator.app import Orchestrator

logger = logging.getLogger(__name__)

QUEUE = "maintenance"
MAX_BATCHES_PER_RUN = 10


def register(orc: Orchestrator) -> None:
    settings = orc.settings
    attempts = orc.retry_config.for_type("sweep_zombies").worker_max_attempts

    @orc.procrastinate.periodic(cron=settings.safety_net_cron, periodic_id="retry_safety_net")
    @orc.procrastinate.task(
        name="orchestrator.retry_safety_net",
        queue=QUEUE,
        retry=GraphileRetryStrategy(attempts),
    )
    async def retry_safety_net(timestamp: int) -> int:
        return await run_safety_net(orc)


async def run_safety_net(orc: Orchestrator) -> int:
    """One run of the safety net; returns how many jobs it dispatched again."""
    settings = orc.settings
    total = 0
    for _ in range(MAX_BATCHES_PER_RUN):
        batch = await orc.store.redispatch_lost(
            grace_seconds=settings.safety_net_grace_seconds,
            stalled_seconds=settings.stalled_worker_seconds,
            limit=settings.safety_net_batch_size,
        )
        total += len(batch)
        if len(batch) < settings.safety_net_batch_size:
            break
    if total:
        logger.warning("retry safety net: dispatched %d job(s) whose dispatch was lost", total)
    return total
