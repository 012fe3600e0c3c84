"""A background error fails its test: a pytest plugin (tests/conftest.py loads it) that fails a
test during which an ERROR, or any record with a traceback, was logged — in this process (a
handler on the root logger, from the test's setup to the end of its teardown) or by a process
started through tests/support/workers.py or api_server.py (their log files, read as they grow).

A test that provokes errors on purpose says which, with regular expressions searched in each
error's text (its log line and traceback): ``@pytest.mark.logs_errors("pattern", ...)`` on the
test, its class, or its module (``pytestmark``); every mark that applies counts. The failure is
reported at the test's teardown, with each unexpected error's text."""

from __future__ import annotations

import json
import logging
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

MARKER = "logs_errors"
TRACEBACK = "Traceback (most recent call last)"
LEVELS = "DEBUG|INFO|WARNING|ERROR|CRITICAL"
#: A record's first line in the text format the CLI writes (orchestrator.runtime.logs.FORMAT),
#: or in logging's default one (a process that configured no format).
TEXT_RECORD = re.compile(
    rf"^(\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d{{3}} (?P<level>{LEVELS}) |(?P<basic>{LEVELS}):[\w.]*:)"
)
ERROR_LEVELS = frozenset({"ERROR", "CRITICAL"})
SHOWN = 40  # lines of one error's text in a failure message


def errors_in_log(text: str) -> list[str]:
    """The errors in a process's log: each record at ERROR or above, or carrying a traceback
    (its continuation lines), in the text or the JSON format; and a traceback printed outside
    any record (an uncaught exception)."""
    found: list[str] = []
    for entry in _entries(text):
        first = entry[0]
        level = _level(first)
        body = "\n".join(entry)
        if level in ERROR_LEVELS or TRACEBACK in body or _json_exception(first):
            found.append(body)
    return found


def _entries(text: str) -> Iterator[list[str]]:
    """The log's records, each with the lines that follow it up to the next record; lines
    before the first record are an entry of their own."""
    entry: list[str] = []
    for line in text.splitlines():
        if _level(line) is not None and entry:
            yield entry
            entry = []
        entry.append(line)
    if entry:
        yield entry


def _level(line: str) -> str | None:
    """The level of a record's first line, or None for any other line."""
    matched = TEXT_RECORD.match(line)
    if matched:
        return matched.group("level") or matched.group("basic")
    record = _json(line)
    level = record.get("level") if record else None
    return level if isinstance(level, str) else None


def _json(line: str) -> dict[str, object] | None:
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _json_exception(line: str) -> bool:
    record = _json(line)
    return bool(record and record.get("exception"))


def fails_jobs(*codes: str) -> pytest.MarkDecorator:
    """The mark of a test that fails jobs on purpose with these failure codes: a job that fails
    with no escalation target is logged at ERROR (orchestrator.domain.degradation)."""
    return pytest.mark.logs_errors(
        *(rf"\) failed; no escalation target, nobody notified: {code}: " for code in codes)
    )


#: The mark of a test whose attempts crash on purpose (checkpoints.SimulatedCrash).
crashes = pytest.mark.logs_errors(
    r"orchestrator\.worker: attempt \d+ of job \S+ crashed \(SimulatedCrash"
)


def allowed(patterns: list[str], error: str) -> bool:
    return any(re.search(pattern, error) for pattern in patterns)


@dataclass
class _Watched:
    """A process's log file, read from where the last check stopped (a whole line at a time):
    the handle stays readable after the helper deletes the file."""

    name: str
    process: subprocess.Popen[bytes] | subprocess.Popen[str]
    handle: IO[bytes]

    def new_errors(self) -> list[str]:
        chunk = self.handle.read()
        complete = chunk.rfind(b"\n") + 1
        if complete < len(chunk) and self.process.poll() is None:  # the rest is being written
            self.handle.seek(complete - len(chunk), 1)
            chunk = chunk[:complete]
        text = chunk.decode(errors="replace")
        return [f"[{self.name}, pid {self.process.pid}]\n{error}" for error in errors_in_log(text)]

    @property
    def done(self) -> bool:
        return self.process.poll() is not None


_watched: list[_Watched] = []


def watch(name: str, process: subprocess.Popen[bytes] | subprocess.Popen[str], log: str) -> None:
    """Check the log file ``log`` of ``process`` (its stdout and stderr) from now on, at the end
    of each test while the process runs, and once more after it ended."""
    _watched.append(_Watched(name, process, Path(log).open("rb")))  # noqa: SIM115 - kept open


def _process_errors() -> list[str]:
    found: list[str] = []
    for watched in list(_watched):
        done = watched.done  # before reading: whatever it wrote before ending is read now
        found.extend(watched.new_errors())
        if done:
            watched.handle.close()
            _watched.remove(watched)
    return found


class _Recorder(logging.Handler):
    """Every record of this process at ERROR or above, or with a traceback, as text."""

    def __init__(self) -> None:
        super().__init__(level=logging.NOTSET)
        self.errors: list[str] = []
        self.text = logging.Formatter("%(levelname)s %(name)s: %(message)s")

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.ERROR and not record.exc_info and not record.exc_text:
            return
        try:
            self.errors.append(f"[this process]\n{self.text.format(record)}")
        except Exception:  # a record that cannot be formatted is an error all the same
            self.errors.append(f"[this process]\n{record.levelname} {record.name}: {record.msg!r}")


_recorder: _Recorder | None = None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(*patterns): errors this test logs on purpose (regular expressions searched in "
        "each error's text); any other ERROR or traceback logged during the test fails it",
    )


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    global _recorder
    _recorder = _Recorder()
    logging.getLogger().addHandler(_recorder)
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    global _recorder
    try:
        yield  # the test's fixtures end first: a server stopped there is read to its end
    finally:
        recorder, _recorder = _recorder, None
        errors = [] if recorder is None else recorder.errors
        if recorder is not None:
            logging.getLogger().removeHandler(recorder)
        errors += _process_errors()
    patterns = [p for mark in item.iter_markers(MARKER) for p in mark.args]
    unexpected = [error for error in errors if not allowed(patterns, error)]
    if unexpected:
        shown = "\n\n".join("\n".join(error.splitlines()[:SHOWN]) for error in unexpected)
        pytest.fail(
            f"{len(unexpected)} error(s) logged during this test that it does not expect "
            f"(if it provokes them on purpose: @pytest.mark.{MARKER}(pattern, ...)):\n\n{shown}",
            pytrace=False,
        )
