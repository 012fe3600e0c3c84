"""The fleet's metrics exporter (orchestrator.services.fleet): one per fleet, since every
scrape reads the database."""

from __future__ import annotations

import asyncio
import signal

from orchestrator.runtime.health import HealthServer
from orchestrator.services.fleet import FleetMetrics
from orchestrator.settings import Settings
from orchestrator.storage.stores import Stores


async def serve(stores: Stores, settings: Settings, *, port: int | None) -> None:
    """Serve until cancelled or stopped by SIGTERM/SIGINT."""
    fleet = FleetMetrics(
        stores.fleet, zombie_threshold=settings.zombie_threshold,
        max_tenants=settings.metrics_max_tenants,
        min_interval=settings.exporter_min_interval,
        live_seconds=settings.stalled_worker_seconds,
    )  # fmt: skip
    server = HealthServer(
        port=port or settings.exporter_port, ready=lambda: True,
        database_ok=stores.liveness.ping, metrics=fleet.exposition,
    )  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await server.close()
