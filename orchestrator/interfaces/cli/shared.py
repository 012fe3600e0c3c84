"""What every command shares, defined once: how a mistake becomes one ``error:`` line and an exit
code, how a command opens its application, how it prints, who it records as acting, and the
types its arguments are read with."""

from __future__ import annotations

import argparse
import asyncio
import functools
import getpass
import importlib
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, NoReturn, Protocol, TypeVar

import psycopg
from pydantic import ValidationError

import retry_config
from orchestrator.app import Orchestrator
from orchestrator.domain.errors import DatabaseUnavailable, OrchestratorError
from orchestrator.domain.principals import name_of
from retry_config.names import tenant_refusal

MAX_LIMIT = 100_000  # rows a list command prints at most
SECONDS_PER_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}
T = TypeVar("T")


class UsageError(Exception):
    """A mistake in what the user typed."""


class Commands(Protocol):
    """What a group adds its commands to: the sub-parsers of ``orchestrator`` (argparse's)."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...


class Parser(argparse.ArgumentParser):
    """argparse, with its usage errors on one line like every other mistake."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {one_line(message)} (see {self.prog} --help)\n")


def reported(command: Callable[[], int]) -> int:
    """``command()``'s exit code; what went wrong said in ``error:`` lines, never a traceback:
    2 for a mistake, 1 for an unreachable database, 141 for a reader gone, 130 for Ctrl-C."""
    try:
        result = command()
        sys.stdout.flush()  # a reader that went away shows here, not at the interpreter's exit
        return result
    except DatabaseUnavailable as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 1
    except ValidationError as exc:
        for problem in _invalid(exc):
            print(f"error: {problem}", file=sys.stderr)
        return 2
    except (UsageError, OrchestratorError, retry_config.ConfigError) as exc:
        for problem in str(exc).splitlines() or [type(exc).__name__]:  # one problem per line
            print(f"error: {one_line(problem)}", file=sys.stderr)
        return 2
    except psycopg.OperationalError as exc:
        print(f"error: cannot reach the database: {one_line(exc)}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # What is still buffered goes nowhere, so the interpreter's exit cannot fail on it.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        return 130


def _invalid(exc: ValidationError) -> list[str]:
    """One line per problem; a setting is named as it is set, ``ORCHESTRATOR_...``."""
    problems = []
    for error in exc.errors(include_url=False):
        message = one_line(error["msg"]).removeprefix("Value error, ")
        if not error["loc"]:  # the model as a whole: its message names the fields
            problems.append(f"{exc.title}: {message}")
            continue
        where = ".".join(str(part) for part in error["loc"])
        if exc.title == "Settings" and where.lower() == "database_url":  # no password shown
            problems.append(f"DATABASE_URL: {message}")
            continue
        if exc.title == "Settings":
            where = f"ORCHESTRATOR_{where.upper()}"
        problems.append(f"{where}: {message} (got {error['input']!r})")
    return problems


def is_utf8(argument: str) -> bool:
    """False for an argument holding bytes that are not UTF-8 (Python keeps them as lone
    surrogates, which nothing downstream could print or store)."""
    try:
        argument.encode()
    except UnicodeEncodeError:
        return False
    return True


def one_line(what: object) -> str:
    return " ".join(str(what).split()) or type(what).__name__


def load_app(path: str) -> Orchestrator:
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise UsageError(f"--app must look like module:attribute, got {path!r}")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise UsageError(f"cannot import {module_name!r} for --app: {exc}") from None
    app = getattr(module, attribute, None)
    if not isinstance(app, Orchestrator):
        raise UsageError(f"{path} is not an Orchestrator")
    return app


def on_app(
    handler: Callable[[argparse.Namespace, Orchestrator], Awaitable[int]],
) -> Callable[[argparse.Namespace], int]:
    """A command that works on the application ``--app`` names: ``handler(args, orc)`` with
    ``orc`` open."""

    @functools.wraps(handler)
    def command(args: argparse.Namespace) -> int:
        return opened(load_app(args.app), lambda orc: handler(args, orc))

    return command


def opened(orc: Orchestrator, body: Callable[[Orchestrator], Awaitable[T]]) -> T:
    """``body(orc)`` with ``orc`` open."""

    async def go() -> T:
        async with orc:
            return await body(orc)

    return asyncio.run(go())


def print_list(rows: Sequence[T], line: Callable[[T], str], empty: str) -> None:
    """Each row on a line of its own; no row, ``empty`` said as ``nothing`` says it."""
    for row in rows:
        print(line(row))
    if not rows:
        nothing(empty)


def nothing(line: str) -> None:
    """An empty list says so, on stderr: a script reading stdout sees no rows."""
    print(line, file=sys.stderr)


def of_tenant(tenant: str | None) -> str:
    return f" for tenant {tenant}" if tenant is not None else ""


def cli_actor(by: str) -> str:
    """Who acted from the command line, as records name it: the name given with ``--by``, in
    normal form (principals.name_of: the person a token of that name is too), and the
    operating-system user who ran the command. The command line acts with the database's own
    rights: it is trusted (the API is where principals are enforced)."""
    return f"{name_of(by)} (cli:{getpass.getuser()})"


def whole(low: int, high: int) -> Callable[[str], int]:
    def whole(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = low - 1
        if not low <= number <= high:
            raise argparse.ArgumentTypeError(
                f"must be a whole number from {low} to {high}, got {_clip_arg(value)}"
            )
        return number

    return whole


def _clip_arg(value: str) -> str:
    return repr(value) if len(value) <= 40 else repr(value[:40]) + "..."


def tenant(value: str) -> str:
    """A ``--tenant``: one that names a tenant, never empty or blank (an unset shell variable
    gives ``--tenant ""``; retry_config.names)."""
    reason = tenant_refusal(value)
    if reason is not None:
        raise argparse.ArgumentTypeError(reason)
    return value


def csv_list(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def iso_time(value: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {value!r}") from None
    if parsed.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{value!r} has no timezone (add Z or +00:00)")
    return parsed
