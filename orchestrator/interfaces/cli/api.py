"""The HTTP API from the command line: ``serve`` runs it, ``openapi`` prints its document."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import socket
from typing import TYPE_CHECKING

from orchestrator.domain.errors import DatabaseUnavailable
from orchestrator.interfaces.cli.shared import Commands, load_app, whole
from orchestrator.storage.database import check_database

if TYPE_CHECKING:
    import uvicorn

logger = logging.getLogger("orchestrator.api")


def add_parsers(commands: Commands) -> None:
    cmd = commands.add_parser(
        "serve", help="serve the HTTP API (/api/v1) until SIGTERM/SIGINT (docs/api.md)"
    )
    cmd.add_argument("--host", help="default: ORCHESTRATOR_API_HOST")
    cmd.add_argument("--port", type=whole(0, 65535), help="default: ORCHESTRATOR_API_PORT")
    cmd.set_defaults(handler=cmd_serve)

    cmd = commands.add_parser(
        "openapi", help="print the API's OpenAPI document (docs/openapi.json holds it)"
    )
    cmd.set_defaults(handler=cmd_openapi)


def cmd_serve(args: argparse.Namespace) -> int:
    """Until SIGTERM/SIGINT: uvicorn finishes the requests under way, then it ends with 0."""
    import uvicorn

    from orchestrator.interfaces.server import create_app

    orc = load_app(args.app)
    settings = orc.settings
    host = args.host or settings.api_host
    port = settings.api_port if args.port is None else args.port
    # Its probes answer on its own port while it waits (none on port 0: nobody probes that).
    asyncio.run(
        orc.wait_for_database(
            probe_port=port, probe_host=host, probe_setting="ORCHESTRATOR_API_PORT"
        )
    )
    asyncio.run(_refuse_a_schema_it_cannot_serve(orc.dsn))  # once it answers
    config = uvicorn.Config(
        create_app(orc), host=host, port=port, log_config=None, lifespan="on",
        server_header=False, proxy_headers=True, access_log=False,  # api.access logs each
    )  # fmt: skip
    server = _server(config)
    # uvicorn takes SIGTERM/SIGINT over as it starts, shuts down gracefully on one, then raises
    # it again for the handler it found (interfaces.start), which ends the process with 0.
    asyncio.run(server.serve())
    return 0 if server.started else 1


def _server(config: uvicorn.Config) -> uvicorn.Server:
    """uvicorn's server, saying where it listens once it does (the port bound, also for 0)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            for server in self.servers:
                for bound in server.sockets:
                    host, port = bound.getsockname()[:2]
                    logger.info(
                        "serving the API on http://%s:%d (/api/v1, the dashboard /ui, /healthz,"
                        " /readyz, /metrics)", f"[{host}]" if ":" in host else host, port,
                    )  # fmt: skip

    return Server(config)


async def _refuse_a_schema_it_cannot_serve(dsn: str) -> None:
    """A database migrated for another version is refused here, in one line (SchemaOutdated,
    SchemaTooNew), where uvicorn would print the start-up's traceback; a database lost again
    since the wait is left to the server's own start."""
    with contextlib.suppress(DatabaseUnavailable):
        await check_database(dsn)


def cmd_openapi(args: argparse.Namespace) -> int:
    from orchestrator.interfaces.server import create_app

    print(json.dumps(create_app(load_app(args.app)).openapi(), indent=2))
    return 0
