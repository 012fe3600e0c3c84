"""Logs: ``ORCHESTRATOR_LOG_FORMAT=json`` makes a worker write one JSON object per line, and
every record logged inside an attempt (the task's own loggers, a task it starts, a thread it
starts) carries the attempt's fields; a known secret is redacted from the message, the
exception and the extra fields. Real worker processes, real peers, the job of
tests/support/observed_app.py."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import psycopg
import pytest

from orchestrator import Orchestrator, Status
from orchestrator.interfaces import cli
from orchestrator.interfaces.api import access
from orchestrator.runtime import logs
from tests.support import http_peers, observed_app
from tests.support.harness import BASE_CONFIG, ROOT, finished
from tests.support.workers import WorkerProcess

VALUE = "observed-secret-0123456789"
REDACTED = f"[REDACTED:{observed_app.SECRET}]"


@pytest.fixture
def peers() -> Iterator[http_peers.Peers]:
    with http_peers.serve() as p:
        yield p


def json_lines(output: str) -> list[dict[str, Any]]:
    """Each line of ``output`` as a JSON object (a line that is not one fails the test)."""
    return [json.loads(line) for line in output.splitlines() if line.strip()]


async def attempt_fields(orc: Orchestrator, job_id: Any) -> dict[str, Any]:
    """What every record of the job's first attempt must carry, read from the job itself."""
    job = await orc.get_job(job_id)
    [running] = [e for e in await orc.job_events(job_id) if e.kind == "job.running"]
    return {
        "job_id": str(job_id),
        "job_type": "observed",
        "attempt": 1,
        "tenant": "acme",
        "trace_id": job.trace_id,
        "worker": running.payload["worker"],
    }


@pytest.mark.logs_errors(r'"level": "ERROR", "logger": "myapp", "message": "a handled error"')
async def test_a_worker_writes_json_lines_with_the_attempt_fields_and_no_secret(
    dsn: str, make_orc: Callable[..., Orchestrator], peers: http_peers.Peers
) -> None:
    orc = make_orc()
    observed_app.register(orc)
    await orc.open()
    job_id = await orc.submit("observed", {"url": peers.url}, tenant_id="acme")
    with WorkerProcess(
        dsn, app="tests.support.observed_app:orc", ORCHESTRATOR_LOG_FORMAT="json",
        ORCHESTRATOR_RETRY_CONFIG=BASE_CONFIG, **{observed_app.SECRET: VALUE},
    ) as worker:  # fmt: skip
        job = await finished(orc, job_id)
        worker.signal(signal.SIGTERM)
        assert await asyncio.to_thread(worker.wait) == 0
        output = worker.output()
    assert job.status is Status.COMPLETED, output
    assert VALUE not in output
    records = json_lines(output)
    assert all({"time", "level", "logger", "message"} <= r.keys() for r in records)
    fields = await attempt_fields(orc, job_id)

    def logged(message: str) -> dict[str, Any]:
        [record] = [r for r in records if r["message"] == message]
        return record

    started = next(r for r in records if r["message"].startswith("worker orchestrator"))
    assert "job_id" not in started  # outside any attempt
    calling = logged(f"calling with key {REDACTED}")
    assert calling["logger"] == "myapp" and calling["level"] == "INFO"
    assert (calling["token"], calling["step_count"]) == (REDACTED, 2)  # the code's own extra
    handled = logged("a handled error")
    assert handled["level"] == "ERROR"
    assert f"RuntimeError: the key {REDACTED} was refused" in handled["exception"]
    attempt_records = [
        calling,
        handled,
        logged("from a task the job started"),
        logged("from a thread"),
        logged("step 1"),  # ctx.log
        logged("step 2"),
        logged(f"job {job_id} (observed) attempt 1: completed"),
    ]
    for record in attempt_records:
        assert {name: record.get(name) for name in fields} == fields, record


async def test_run_worker_without_logging_set_up_writes_json_to_stderr(
    dsn: str, db: psycopg.AsyncConnection[Any], peers: http_peers.Peers
) -> None:
    """An application that configured no logging: the orchestrator's own records (ctx.log's
    among them) go to stderr, in the format asked for."""
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "tests.support.solo_worker", peers.url],
        cwd=ROOT, capture_output=True, text=True, check=False, timeout=120,
        env={**os.environ, "DATABASE_URL": dsn, "ORCHESTRATOR_HEALTH_PORT": "0",
             "ORCHESTRATOR_RETRY_CONFIG": str(BASE_CONFIG), "ORCHESTRATOR_LOG_FORMAT": "json",
             observed_app.SECRET: VALUE},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    job_id = json.loads(done.stdout)["job_id"]
    # The task's own logger ("myapp") has no handler here: Python's last resort prints its
    # warnings and errors as they are. The orchestrator's records are JSON.
    ours = [line for line in done.stderr.splitlines() if line.startswith("{")]
    records = json_lines("\n".join(ours))
    assert {r["logger"].split(".")[0] for r in records} == {"orchestrator"}
    steps = [r for r in records if r["logger"] == "orchestrator.job.observed"]
    assert [r["message"] for r in steps] == ["step 1", "step 2"]
    assert all(r["job_id"] == job_id and r["attempt"] == 1 for r in steps)
    assert any(r["message"].endswith("attempt 1: completed") for r in records)


def test_a_line_repeated_through_an_outage_passes_once_a_minute_with_a_count() -> None:
    # psycopg_pool says "error connecting ..." per attempt, about every second, while the
    # database is away: the handler writes the first, then one a minute with a count.
    handler = logs.OrchestratorHandler("text")
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.setStream(written := io.StringIO())

    def log(name: str, message: str, at: float, *args: object) -> None:
        record = logging.makeLogRecord({"name": name, "msg": message, "args": args})
        record.created = at
        handler.handle(record)

    for t in range(130):
        log("psycopg.pool", "error connecting in %r: %s", t, "p", t)
    log("psycopg.pool", "pool %r is ready", 5, "p")  # another line
    for t in (5, 6):
        log("orchestrator.worker", "job %s done", t, t)  # a worker's own: never held back
    assert written.getvalue().splitlines() == [
        "error connecting in 'p': 0",
        "error connecting in 'p': 60 [59 more like it in the last 60 s]",
        "error connecting in 'p': 120 [59 more like it in the last 60 s]",
        "pool 'p' is ready",
        "job 5 done",
        "job 6 done",
    ]


def test_the_count_of_lines_held_back_is_the_orchestrator_handler_s_alone() -> None:
    # The application's own handlers (a log collector's, pytest's) see each record as it was
    # logged, before and after the orchestrator's handler wrote it with its count.
    logger = logging.getLogger("psycopg.pool")
    ours, theirs = logs.OrchestratorHandler("text"), LogList()
    ours.setStream(written := io.StringIO())
    for handler in (ours, theirs):
        logger.addHandler(handler)
    try:
        for _ in range(3):
            logger.warning("error connecting in %r", "p")
        ours.repeats.every = 0  # the minute has passed
        logger.warning("error connecting in %r", "p")
    finally:
        for handler in (ours, theirs):
            logger.removeHandler(handler)
    assert (
        written.getvalue()
        .splitlines()[-1]
        .endswith("error connecting in 'p' [2 more like it in the last 0 s]")
    )
    assert [r.getMessage() for r in theirs.records] == ["error connecting in 'p'"] * 4


def test_the_cli_leaves_handlers_it_did_not_make_as_they_were(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # An application (or pytest) that set up logging before calling the CLI keeps its
    # handlers: the CLI neither filters nor reformats them.
    root = logging.getLogger()
    theirs = LogList()
    root.addHandler(theirs)
    try:
        # (an application that is not there: the CLI's logging is set up before it is looked for)
        assert cli.main(["--app", "tests.support.absent_app:orc", "config", "validate"]) == 2
    finally:
        root.removeHandler(theirs)
    assert (theirs.filters, theirs.formatter) == ([], None)
    assert not any(isinstance(h, logs.OrchestratorHandler) for h in root.handlers)
    assert "absent_app" in capsys.readouterr().err


class LogList(logging.Handler):
    """A handler that keeps what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def test_an_access_line_in_json_has_its_fields_and_no_secret(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # serve's access log (interfaces.api.access) in ORCHESTRATOR_LOG_FORMAT=json: the request's
    # fields, a token in the query redacted (the text format's test: test_ui_outage).
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    transport = httpx.ASGITransport(app=access.AccessLog(app), client=("10.0.0.7", 51234))
    secret = "orc_" + "0" * 32 + "_" + "s" * 43
    with caplog.at_level(logging.INFO, logger="orchestrator.api.access"):
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            await client.get(f"/api/v1/jobs?limit=5&token={secret}",
                             headers={"Authorization": f"Bearer {secret}"})  # fmt: skip
    [record] = [r for r in caplog.records if r.name == "orchestrator.api.access"]
    line = json.loads(logs.JsonFormatter().format(record))
    assert line["message"] == (
        '10.0.0.7:51234 "GET /api/v1/jobs?limit=5&token=%5Bredacted%5D" 204 0 B '
        f"{line['duration_ms']:.1f} ms"
    )
    assert {k: line[k] for k in ("client", "method", "path", "query", "status", "bytes")} == {
        "client": "10.0.0.7:51234", "method": "GET", "path": "/api/v1/jobs",
        "query": "limit=5&token=%5Bredacted%5D", "status": 204, "bytes": 0,
    }  # fmt: skip
    assert line["principal"] is None and "s" * 43 not in json.dumps(line)
