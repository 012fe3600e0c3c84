"""Retention of checkpoints: the checkpoints and ledger rows of jobs finished longer ago than
the retention are deleted, a batch per statement (the jobs, their events and dead letters
stay)."""

from __future__ import annotations

from dataclasses import dataclass

from checkpoints import CheckpointStore
from orchestrator.services.batches import in_batches


@dataclass(frozen=True)
class PruneResult:
    deleted: int

    @property
    def handled(self) -> int:
        return self.deleted

    def sentence(self) -> str:
        return f"checkpoint and ledger rows of long-finished jobs deleted: {self.deleted}"


class CheckpointPrune:
    name = "prune_checkpoints"

    def __init__(
        self, *, checkpoints: CheckpointStore, retention_days: float, batch_size: int
    ) -> None:
        self.checkpoints = checkpoints
        self.retention_seconds = retention_days * 86_400
        self.batch_size = batch_size

    async def run_once(self) -> PruneResult:
        return PruneResult(await in_batches(self.prune_batch, size=self.batch_size))

    async def prune_batch(self, limit: int) -> int:
        return await self.checkpoints.prune(older_than_seconds=self.retention_seconds, limit=limit)
