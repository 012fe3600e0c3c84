"""Which retry config version each live worker and API server runs (0028): written by each
process for itself, read by ``orchestrator config show --workers``."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from orchestrator.storage.migrate import release
from orchestrator.storage.runner import Queries
from retry_config import LiveConfig


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: int
    worker: str | None  # None with version: a process that records none (an older release)
    version: str | None
    applied_at: datetime | None
    last_heartbeat: datetime
    application: str | None = None  # None: a process of a release before applications


class ConfigVersionStore:
    def __init__(self, queries: Queries) -> None:
        self.queries = queries

    async def record(
        self,
        worker_id: int,
        *,
        worker: str,
        config: LiveConfig,
        application: str,
        runs: str,
        declares: str | None = None,
    ) -> None:
        """The application of the registered process ``worker_id`` and the version ``config``
        holds now: at its registration and with each registry heartbeat (an upsert every few
        seconds that writes only a change, and puts back a row that went missing); with it, the
        release this code is (0058: ``migrate --plan`` names the processes of an older one), and
        the fingerprint of what it declares (0060: a withdrawal waits for the peers that declare
        otherwise), and what it runs (0061: ``jobs``, a worker; ``external``, an API server, the
        external job types' dispatches)."""
        await self.queries.execute(
            "record_worker_config",
            {"worker_id": worker_id, "worker": worker, "version": config.current.version,
             "applied_at": config.applied_at, "application": application,
             "schema_version": release(), "declares": declares, "runs": runs},
        )  # fmt: skip

    async def live(self, *, seconds: float) -> list[WorkerConfig]:
        """The registry's processes whose heartbeat is younger than ``seconds``."""
        rows = await self.queries.rows("worker_configs", {"seconds": seconds})
        return [
            WorkerConfig(r["id"], r["worker"], r["config_version"], r["applied_at"],
                         r["last_heartbeat"], r["application"])
            for r in rows
        ]  # fmt: skip
