"""The guard that fails a test on a background error (tests/support/log_guard.py): which log
lines are errors, in the formats the CLI writes, and what a test run with the guard reports —
run for real, as an inner pytest session on tests that log on purpose."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

from orchestrator.runtime.logs import FORMAT, JsonFormatter
from tests.support.log_guard import allowed, errors_in_log

ROOT = Path(__file__).resolve().parent.parent


def formatted(formatter: logging.Formatter, level: int, message: str, raised: bool) -> str:
    exc_info = None
    if raised:
        try:
            raise ValueError("the cause")
        except ValueError:
            exc_info = sys.exc_info()
    record = logging.LogRecord("orchestrator.x", level, __file__, 1, message, None, exc_info)
    return formatter.format(record)


def test_errors_in_a_text_log() -> None:
    text = logging.Formatter(FORMAT)
    log = "\n".join([
        "Starting ...",
        formatted(text, logging.INFO, "started", raised=False),
        formatted(text, logging.ERROR, "an error", raised=False),
        formatted(text, logging.WARNING, "a warning with its traceback", raised=True),
        formatted(text, logging.WARNING, "a plain warning", raised=False),
        formatted(text, logging.CRITICAL, "critical", raised=False),
        formatted(logging.Formatter(logging.BASIC_FORMAT), logging.ERROR, "basic", raised=False),
        formatted(logging.Formatter(logging.BASIC_FORMAT), logging.INFO, "basic", raised=False),
        formatted(text, logging.INFO, "stopped", raised=False),
    ])  # fmt: skip
    found = errors_in_log(log)
    assert [error.splitlines()[0].split(" ", 2)[2] for error in found[:3]] == [
        "ERROR orchestrator.x: an error",
        "WARNING orchestrator.x: a warning with its traceback",
        "CRITICAL orchestrator.x: critical",
    ]
    assert found[3] == "ERROR:orchestrator.x:basic"  # logging's default format
    assert "ValueError: the cause" in found[1]  # the traceback belongs to its record
    assert "a plain warning" not in found[1]


def test_errors_in_a_json_log() -> None:
    log = "\n".join(
        formatted(JsonFormatter(), level, message, raised)
        for level, message, raised in [
            (logging.INFO, "started", False),
            (logging.ERROR, "an error", False),
            (logging.WARNING, "a warning with its traceback", True),
            (logging.WARNING, "a plain warning", False),
        ]
    )
    found = [json.loads(error)["message"] for error in errors_in_log(log)]
    assert found == ["an error", "a warning with its traceback"]


def test_a_traceback_outside_any_record_is_an_error() -> None:
    uncaught = subprocess.run(
        [sys.executable, "-c", "print('starting'); raise SystemError('uncaught')"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    (error,) = errors_in_log(uncaught.stdout + uncaught.stderr)
    assert error.startswith("starting\nTraceback (most recent call last)")
    assert error.endswith("SystemError: uncaught")


def test_allowed_is_a_search_by_any_pattern() -> None:
    assert allowed(["boom", r"refused \d+"], "ERROR x: connection refused 42 times")
    assert not allowed(["boom"], "ERROR x: connection refused")
    assert not allowed([], "ERROR x: anything")


INNER = """
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import log_guard
from tests.support.api_server import ApiServer
from tests.support.workers import FAST, WorkerProcess, wait_until

pytestmark = pytest.mark.logs_errors("allowed in the whole module")
APP = str(Path(__file__).parent)
CHILD = "import logging, sys; logging.basicConfig(format=sys.argv[1]); logging.error(sys.argv[2])"


def child(tmp_path, message, *, delete):
    log = tmp_path / "child.log"
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-c", CHILD, FORMAT, message], stdout=out,
                                   stderr=subprocess.STDOUT)
        log_guard.watch("child", process, str(log))
        process.wait()
    if delete:
        log.unlink()  # as the helpers do at their exit, before the test ends


def test_an_error_in_a_worker():
    with WorkerProcess(os.environ["GUARD_DSN"], app="guard_app:orc", PYTHONPATH=APP) as worker:
        wait_until(lambda: "app boom" in worker.output())


def test_an_error_in_a_server():
    config = FAST["ORCHESTRATOR_RETRY_CONFIG"]
    with ApiServer(os.environ["GUARD_DSN"], app="guard_app:orc", PYTHONPATH=APP,
                   ORCHESTRATOR_RETRY_CONFIG=config):
        pass


def test_an_error(): logging.getLogger("inner").error("unexpected boom")
def test_a_warning_with_a_traceback():
    try:
        raise KeyError("inner")
    except KeyError:
        logging.getLogger("inner").warning("caught", exc_info=True)
def test_a_warning(): logging.getLogger("inner").warning("only a warning")
@pytest.mark.logs_errors("expected boom")
def test_an_allowed_error(): logging.getLogger("inner").error("an expected boom")
@pytest.mark.logs_errors("expected boom")
def test_another_error_beside_an_allowed_one():
    logging.getLogger("inner").error("an expected boom")
    logging.getLogger("inner").error("something else")
def test_an_error_allowed_by_the_module(): logging.getLogger("inner").error("allowed in the whole module")
def test_an_error_in_a_child_process(tmp_path): child(tmp_path, "child boom", delete=False)
def test_an_error_in_a_deleted_log(tmp_path): child(tmp_path, "child boom", delete=True)
@pytest.mark.logs_errors("child boom")
def test_an_allowed_error_in_a_child_process(tmp_path): child(tmp_path, "child boom", delete=True)
def test_a_failure_of_its_own():
    logging.getLogger("inner").error("boom before the failure")
    assert False
"""


GUARD_APP = """
import logging

from tests.support.agent_app import orc

logging.getLogger("orchestrator.guard").error("app boom at import")
"""


def test_a_run_fails_each_test_that_logged_an_error_it_does_not_allow(
    tmp_path: Path, dsn: str
) -> None:
    (tmp_path / "test_inner.py").write_text(
        INNER.replace("FORMAT, message", f"{FORMAT!r}, message")
    )
    (tmp_path / "guard_app.py").write_text(GUARD_APP)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.support.log_guard", "-p", "no:cacheprovider",
         "-rA", "-c", str(tmp_path / "pytest.ini"), str(tmp_path / "test_inner.py")],
        cwd=ROOT, env={**os.environ, "GUARD_DSN": dsn}, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    outcomes = re.findall(r"^(PASSED|FAILED|ERROR) \S*test_inner\.py::(\w+)", run.stdout, re.M)
    errored = {name for outcome, name in outcomes if outcome == "ERROR"}
    assert errored == {
        "test_an_error_in_a_worker",
        "test_an_error_in_a_server",
        "test_an_error",
        "test_a_warning_with_a_traceback",
        "test_another_error_beside_an_allowed_one",
        "test_an_error_in_a_child_process",
        "test_an_error_in_a_deleted_log",
        "test_a_failure_of_its_own",
    }, run.stdout
    assert ("FAILED", "test_a_failure_of_its_own") in outcomes  # its own failure stays
    assert run.returncode == 1
    report = run.stdout
    assert "ERROR inner: unexpected boom" in report and "KeyError: 'inner'" in report
    assert "[child, pid " in report and "ERROR root: child boom" in report
    assert "[worker guard_app:orc, pid " in report and "[serve guard_app:orc, pid " in report
    assert "ERROR orchestrator.guard: app boom at import" in report
    beside = report.split("ERROR at teardown of test_another_error_beside_an_allowed_one")[1]
    assert "1 error(s) logged" in beside.split("Captured log")[0]  # the allowed one is not
    assert "@pytest.mark.logs_errors(pattern, ...)" in report
