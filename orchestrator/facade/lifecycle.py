"""An Orchestrator's database, opened and closed: where it is, the pool of each opening, and
what is built on that pool while it is open."""

from __future__ import annotations

import asyncio
import contextlib

import procrastinate
import psycopg

from checkpoints import ApprovalGate, CheckpointStore
from orchestrator.domain.errors import OrchestratorError
from orchestrator.domain.failures import Failures
from orchestrator.domain.notices import Notifier
from orchestrator.runtime import startup
from orchestrator.runtime.metrics import Metrics
from orchestrator.services.approvals import ApprovalDecisions
from orchestrator.services.maintenance import Maintenance
from orchestrator.settings import Settings
from orchestrator.storage import database
from orchestrator.storage.applications import application_of
from orchestrator.storage.database import Pool
from orchestrator.storage.migrate import MigrationReport, Plan, migrate, plan
from orchestrator.storage.producers import Producers
from orchestrator.storage.runner import OnRefused
from orchestrator.storage.stores import Stores
from retry_config import LiveConfig


class Opened:
    """What an open Orchestrator holds: its stores on one pool, and what is built on them."""

    def __init__(
        self,
        stores: Stores,
        checkpoints: CheckpointStore,
        gate: ApprovalGate,
        decisions: ApprovalDecisions,
        maintenance: Maintenance,
    ) -> None:
        self.stores = stores
        self.checkpoints = checkpoints
        self.gate = gate
        self.decisions = decisions
        self.maintenance = maintenance


class Lifecycle:
    """Opens and closes the pool; the other concerns ask it for the stores at the moment they
    need them, so a call checks its arguments before it finds the Orchestrator closed."""

    def __init__(
        self,
        *,
        settings: Settings,
        dsn: str | None,
        procrastinate_app: procrastinate.App,
        failures: Failures,
        notifier: Notifier,
        config: LiveConfig,
        metrics: Metrics,
        on_refused: OnRefused,
    ) -> None:
        self._settings = settings
        self._dsn = dsn
        self._procrastinate = procrastinate_app
        self._failures = failures
        self._notifier = notifier
        self._config = config
        self._metrics = metrics
        self._on_refused = on_refused
        self._opened: Opened | None = None
        #: Undoes the connector swap of the current opening (App.replace_connector's context).
        self._connector_swap = contextlib.ExitStack()

    @property
    def dsn(self) -> str:
        if self._dsn is None:
            self._dsn = database.resolve_dsn(self._settings)
        return database.with_connect_timeout(self._dsn, self._settings.connect_timeout)

    async def wait_for_database(
        self, *, probe_port: int, probe_host: str, probe_setting: str
    ) -> None:
        dsn = await asyncio.to_thread(lambda: self.dsn)
        await startup.wait_for_database(
            dsn, probe_port=probe_port, probe_host=probe_host, probe_setting=probe_setting
        )

    async def open(self) -> None:
        if self._opened is not None:
            return
        dsn = await asyncio.to_thread(lambda: self.dsn)
        await database.check_database(dsn)
        pool = database.create_pool(
            dsn, min_size=self._settings.pool_min_size, max_size=self._settings.pool_max_size,
            timeout=self._settings.pool_timeout,
        )  # fmt: skip
        await pool.open()  # connects in the background; check_database already did once
        # A connector given an external pool keeps it even after close_async, so each opening
        # gets a fresh one, swapped in by App.replace_connector until close(). Procrastinate's
        # own writes (the periodic deferrer's) go through it.
        connector = procrastinate.PsycopgConnector()
        self._connector_swap.enter_context(self._procrastinate.replace_connector(connector))
        await connector.open_async(pool)
        self._opened = self._build(pool)

    def _build(self, pool: Pool) -> Opened:
        stores = Stores.on(pool, on_refused=self._on_refused)
        checkpoints = CheckpointStore(stores.queries)
        decisions = ApprovalDecisions(stores=stores, failures=self._failures)
        return Opened(
            stores=stores,
            checkpoints=checkpoints,
            gate=ApprovalGate(stores.approvals, self._notifier),
            decisions=decisions,
            maintenance=Maintenance.build(
                stores=stores, checkpoints=checkpoints, failures=self._failures,
                decisions=decisions, config=self._config, settings=self._settings,
                on_run=self._metrics.maintenance_run,
            ),
        )  # fmt: skip

    async def close(self) -> None:
        if self._opened is None:
            return
        await self._procrastinate.close_async()
        await self._opened.stores.queries.pool.close()
        self._connector_swap.close()
        self._opened = None

    @property
    def opened(self) -> Opened:
        if self._opened is None:
            raise OrchestratorError("the orchestrator is not open: use `async with orc:`")
        return self._opened

    @property
    def stores(self) -> Stores:
        return self.opened.stores

    async def apply_flow_limits(self, declares: str | None = None) -> None:
        """Write the flow limits of the config in effect, which the whole fleet shares (once
        per version; nothing while closed: a worker or ``serve`` writes them as it starts)."""
        if self._opened is not None:
            await self._opened.stores.flow.apply(
                self._config, application_of(self._settings), declares
            )

    async def migrate(self, producers: Producers) -> MigrationReport:
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            return await migrate(conn, producers=producers)

    async def plan_migrate(self, producers: Producers) -> Plan:
        """What :meth:`migrate` would do, changing nothing; the live workers are those whose
        heartbeat is younger than ``stalled_worker_seconds``."""
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            return await plan(
                conn, producers=producers, stale_after=self._settings.stalled_worker_seconds
            )
