"""The retention of finished jobs: ``prune_finished`` deletes the jobs that finished longer ago
than their retention (orchestrator.domain.retention), each with every row of its own, and the
bookkeeping that aged out (River's job cleaner is the model).

A run deletes jobs in batches of ``batch_size``, each one statement in one transaction (the
``prune_finished_jobs`` query: which jobs may go is its ``candidates``), going on while a batch
comes back full, for ``run_seconds`` at most: so a run keeps pace with the fleet by itself (a
fixed number of batches a minute did not above 167 jobs/s), and each transaction stays as short
as one batch. A run whose time ran out with batches still full fell behind: its log line says
so, and the point retention has caught up to (recorded by a short batch, 0037) stays where it
was, so the fleet's ``orchestrator_retention_lag_seconds`` grows. Then, in bounded batches too,
the maintenance ticks' finished dispatches older than the shortest default retention, expired
dashboard sessions, lapsed event-listener claims, and API tokens revoked longer ago than the
longest retention. With an archive directory, each batch of jobs is written to the run's file
and fsynced before its transaction commits (orchestrator.services.archive).

``preview`` is the dry run (``orchestrator prune --dry-run``): the same statements, deleting
nothing, over as many rows as MAX_BATCHES_PER_RUN batches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import LiteralString

from orchestrator.domain.retention import Retention
from orchestrator.services.archive import RunArchive
from orchestrator.services.batches import MAX_BATCHES_PER_RUN, in_batches
from orchestrator.storage.retention import BOOKKEEPING, BOOKKEEPING_KINDS, PrunedJob
from orchestrator.storage.stores import Stores
from retry_config import LiveConfig


@dataclass
class RetentionResult:
    """What a run deleted (or, from ``preview``, would delete), by kind: the int fields are
    the run's rows in the maintenance metrics (``action`` label)."""

    jobs: int = 0
    events: int = 0
    checkpoints: int = 0
    side_effects: int = 0
    approvals: int = 0
    dead_letters: int = 0
    dispatches: int = 0
    dispatch_events: int = 0
    llm_usage: int = 0
    output_chunks: int = 0
    maintenance_dispatches: int = 0
    sessions: int = 0
    event_listeners: int = 0
    revoked_tokens: int = 0
    #: Jobs by (job type, status).
    by_type: dict[tuple[str, str], int] = field(default_factory=dict)
    #: Jobs per statement, in order (a run stops after a short one).
    batches: list[int] = field(default_factory=list)
    archive: Path | None = None
    #: Of a preview: the most jobs it counts (more may be due when it counted that many).
    limit: int | None = None
    #: Of a run: the seconds it may go on for, and whether they ran out with jobs still due.
    run_seconds: float = 0.0
    behind: bool = False

    @property
    def handled(self) -> int:
        return (self.jobs + self.maintenance_dispatches + self.sessions + self.event_listeners
                + self.revoked_tokens)  # fmt: skip

    def add(self, jobs: list[PrunedJob]) -> None:
        self.batches.append(len(jobs))
        self.jobs += len(jobs)
        for job in jobs:
            key = (job.job_type, job.status.value)
            self.by_type[key] = self.by_type.get(key, 0) + 1
            for kind, n in job.rows.items():
                setattr(self, kind, getattr(self, kind) + n)

    def sentence(self) -> str:
        bookkeeping = ", ".join(
            f"{getattr(self, kind)} {kind.replace('_', ' ')}"
            for kind in BOOKKEEPING_KINDS
            if getattr(self, kind)
        )
        return (
            f"finished jobs past their retention deleted: {self.jobs} ({self.events} events,"
            f" {self.checkpoints} checkpoints, {self.side_effects} ledger rows,"
            f" {self.output_chunks} output chunks, {self.dispatches} dispatches)"
            + (f"; aged out: {bookkeeping}" if bookkeeping else "")
            + (f"; archived to {self.archive}" if self.archive else "")
            + (
                f"; fell behind: jobs were still due when the run's {self.run_seconds:g} s ran"
                " out (ORCHESTRATOR_RETENTION_RUN_SECONDS), the next run goes on"
                if self.behind
                else ""
            )
        )


class FinishedPrune:
    name = "prune_finished"

    def __init__(
        self,
        *,
        stores: Stores,
        days: float,
        failed_days: float,
        config: LiveConfig,
        batch_size: int,
        run_seconds: float,
        archive_dir: Path | None,
    ) -> None:
        self.stores = stores
        self.days = days
        self.failed_days = failed_days
        self.config = config
        self.batch_size = batch_size
        self.run_seconds = run_seconds
        self.archive_dir = archive_dir

    @property
    def retention(self) -> Retention:
        """The policy of the retry config in effect (a reload changes it from the next batch)."""
        return Retention.of(
            days=self.days, failed_days=self.failed_days, config=self.config.current
        )

    async def run_once(self) -> RetentionResult:
        result = RetentionResult(run_seconds=self.run_seconds)
        archive = RunArchive(self.archive_dir) if self.archive_dir is not None else None
        try:
            await self._jobs(result, archive)
        finally:
            if archive is not None:
                archive.close()
        if archive is not None and archive.file is not None:
            result.archive = archive.path
        for query, kinds in BOOKKEEPING.items():
            totals = dict.fromkeys(kinds, 0)

            async def rows(
                n: int, query: LiteralString = query, totals: dict[str, int] = totals
            ) -> int:
                counts = await self._bookkeeping(query, n, dry_run=False)
                for kind, count in counts.items():
                    totals[kind] += count
                return max(counts.values())

            await in_batches(rows, size=self.batch_size)
            for kind, total in totals.items():
                setattr(result, kind, total)
        return result

    async def _jobs(self, result: RetentionResult, archive: RunArchive | None) -> None:
        """Batches while they come back full and the run's seconds last."""
        deadline = time.monotonic() + self.run_seconds
        while True:
            jobs = await self.prune_batch(self.batch_size, archive)
            result.add(jobs)
            if len(jobs) < self.batch_size:
                return
            if time.monotonic() >= deadline:
                result.behind = True
                return

    async def prune_batch(self, limit: int, archive: RunArchive | None) -> list[PrunedJob]:
        """One transaction: the statement that deletes at most ``limit`` jobs, and before its
        commit the archive of what it deleted, on disk."""
        async with self.stores.queries.transaction() as conn:
            jobs = await self.stores.retention.prune_jobs(
                self.retention, limit=limit, archive=archive is not None, dry_run=False,
                conn=conn,
            )  # fmt: skip
            if archive is not None and jobs:
                await archive.append(j.archived for j in jobs if j.archived is not None)
        return jobs

    async def preview(self) -> RetentionResult:
        """What a run would delete now, deleting nothing."""
        limit = self.batch_size * MAX_BATCHES_PER_RUN
        result = RetentionResult(limit=limit)
        async with self.stores.queries.transaction() as conn:
            result.add(
                await self.stores.retention.prune_jobs(
                    self.retention, limit=limit, archive=False, dry_run=True, conn=conn
                )
            )
        for query in BOOKKEEPING:
            for kind, count in (await self._bookkeeping(query, limit, dry_run=True)).items():
                setattr(result, kind, count)
        return result

    async def _bookkeeping(
        self, query: LiteralString, limit: int, *, dry_run: bool
    ) -> dict[str, int]:
        # Maintenance ticks are kept as long as the shortest default (the completed jobs');
        # revoked tokens as long as the longest retention of any job.
        older_than = (
            self.retention.longest()
            if query == "prune_revoked_tokens"
            else min(self.retention.default.values())
        )
        return await self.stores.retention.prune_bookkeeping(
            query, older_than=older_than, limit=limit, dry_run=dry_run
        )
