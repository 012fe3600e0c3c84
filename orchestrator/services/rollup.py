"""History that outlives the jobs: each run rolls up the closed minutes past the watermark (a
span of ``batch_minutes`` per transaction, going on while a span came back full: a history of
days catches up a few hours per run), samples this minute's queue depth, and deletes rollups
past their retention. Never on a job's own path: a job's finish costs nothing more.

Idempotent: a span rolled up twice writes the same rows (storage/rollups.sql,
``roll_up_minutes``), so a run that died after its commit, or two runs at once (they take
turns on the watermark's row), count every job once.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.services.batches import MAX_BATCHES_PER_RUN
from orchestrator.storage.rollups import RollupStore


@dataclass(frozen=True)
class RollupResult:
    minutes: int  # closed minutes rolled up
    jobs: int  # jobs that finished in them
    depth_rows: int  # queue depth rows sampled (one per queue and tenant with jobs)
    pruned: int  # rollup and sample rows past their retention, deleted
    behind: bool  # more than one batch of minutes was waiting: a first run, or after downtime

    @property
    def handled(self) -> int:
        """Worth a log line only when it caught up: every run rolls up, samples and prunes."""
        return self.minutes if self.behind else 0

    def sentence(self) -> str:
        return (f"caught up {self.minutes} minutes ({self.jobs} jobs) of finished jobs, "
                f"{self.pruned} rows past their retention deleted")  # fmt: skip


class JobRollup:
    name = "rollup_jobs"

    def __init__(
        self,
        *,
        rollups: RollupStore,
        batch_minutes: int,
        settle_seconds: float,
        retention_days: float,
        hourly_retention_days: float,
        prune_batch_size: int,
    ) -> None:
        self.rollups = rollups
        self.batch_minutes = batch_minutes
        self.settle_seconds = settle_seconds
        self.retention_days = retention_days
        self.hourly_retention_days = hourly_retention_days
        self.prune_batch_size = prune_batch_size

    async def run_once(self) -> RollupResult:
        minutes = jobs = 0
        for _ in range(MAX_BATCHES_PER_RUN):
            done = await self.rollups.roll_up(
                minutes=self.batch_minutes, settle_seconds=self.settle_seconds
            )
            minutes += done.minutes
            jobs += done.jobs
            if done.minutes < self.batch_minutes:
                break
        depth = await self.rollups.sample_queue_depth()
        pruned = await self.rollups.prune(
            minute_days=self.retention_days, hour_days=self.hourly_retention_days,
            limit=self.prune_batch_size,
        )  # fmt: skip
        return RollupResult(minutes=minutes, jobs=jobs, depth_rows=depth, pruned=pruned,
                            behind=minutes > self.batch_minutes)  # fmt: skip
