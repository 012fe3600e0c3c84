"""``db``: the embedded PostgreSQL, used when DATABASE_URL is unset: whether it runs and who uses
it (``status``), and stopping it (``stop``). Neither opens an application."""

from __future__ import annotations

import argparse

from orchestrator.interfaces import render
from orchestrator.interfaces.cli.shared import Commands, UsageError
from orchestrator.settings import Settings
from orchestrator.storage.database import describe_database
from orchestrator.storage.embedded import Embedded


def add_parsers(commands: Commands) -> None:
    db = commands.add_parser(
        "db", help="the embedded PostgreSQL (used when DATABASE_URL is unset)"
    ).add_subparsers(dest="db_command", required=True, metavar="ACTION")
    cmd = db.add_parser("status", help="whether it runs, where, and which processes use it")
    cmd.set_defaults(handler=cmd_db_status)
    cmd = db.add_parser("stop", help="stop it (refused while processes use it, unless --force)")
    cmd.add_argument(
        "--force", action="store_true", help="stop it even while processes use it (their"
        " connections close; a worker waits for the database to come back)",
    )  # fmt: skip
    cmd.set_defaults(handler=cmd_db_stop)


def cmd_db_status(args: argparse.Namespace) -> int:
    """Exits 0 when the server runs, 3 when it does not (as ``pg_ctl status``)."""
    settings = Settings()
    embedded = Embedded(settings.data_dir)
    if settings.database_url:
        where = describe_database(settings.database_url)
        print(f"DATABASE_URL is set: commands use {where}, not the embedded server")
    server = embedded.running()
    if server is None:
        print(f"embedded PostgreSQL: not running (data {embedded.pgdata})")
        return 3
    print(f"embedded PostgreSQL: running (pid {server.pid})")
    print(f"  data:     {embedded.pgdata}")
    print(f"  socket:   {server.socket_dir}, port {server.port}")
    users = embedded.users()
    print(f"  used by:  {len(users)} process(es)" + ("" if users else ": stops within seconds"))
    for user in users:
        print(f"    {user.pid}  {render.clip(user.command, 100)}")
    watchdog = embedded.watchdog()
    if watchdog is None:
        print("  watchdog: not running: the server stops only with `orchestrator db stop`")
    else:
        print(f"  watchdog: pid {watchdog.pid}: stops the server once no process uses it")
    return 0


def cmd_db_stop(args: argparse.Namespace) -> int:
    embedded = Embedded(Settings().data_dir)
    postmaster = embedded.postmaster()
    if postmaster is not None:
        with embedded.locked():
            postmaster = embedded.postmaster()
            users = embedded.users()
            if postmaster is not None and users and not args.force:
                pids = ", ".join(str(user.pid) for user in users)
                raise UsageError(
                    f"the embedded PostgreSQL is in use by process(es) {pids} "
                    "(orchestrator db status); stop them first, or use --force"
                )
            if postmaster is not None:
                embedded.stop(postmaster)
    print(
        "embedded PostgreSQL: "
        + ("not running" if postmaster is None else f"stopped (pid {postmaster})")
    )
    return 0
