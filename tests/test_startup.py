"""Start-up while the database is away: a real worker process and a real ``orchestrator serve``
started while their server (one of the test's own) is stopped wait for it, answer not ready on
their probe, log one line per attempt, and start once it is back; a wrong DATABASE_URL (bad
password, unknown database, a host name that does not exist) still fails at once with the
server's reason. The classification of a failed connection is a pure function, tested over
libpq's real messages and generated ones."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator import Orchestrator, Status
from orchestrator.domain.connect_failures import (
    CREDENTIALS_TEXTS,
    NOT_ACCEPTING_TEXTS,
    ConnectFailure,
    connect_failure,
)
from orchestrator.domain.principals import Scope
from orchestrator.runtime.health import HealthServer
from orchestrator.runtime.startup import MAX_DELAY, WAITING
from orchestrator.storage.migrate import migrate
from tests.support import agent_app
from tests.support.api_server import ApiServer, token
from tests.support.cluster import Cluster
from tests.support.harness import config_with, free_port, settings_for_tests
from tests.support.workers import FAST, ROOT, WorkerProcess, until_it_handles_sigterm

# -- the classification, pure ---------------------------------------------------------------

TCP = 'connection failed: connection to server at "10.0.0.5", port 5432 failed: '
SOCKET = 'connection failed: connection to server on socket "/run/pg/.s.PGSQL.5432" failed: '

#: libpq's and the server's own words, as psycopg reports them, and what each is.
MESSAGES = {
    TCP + "Connection refused\n\tIs the server running on that host and accepting TCP/IP "
    "connections?": ConnectFailure.NO_ANSWER,
    SOCKET + "No such file or directory\n\tIs the server running locally and accepting "
    "connections on that socket?": ConnectFailure.NO_ANSWER,
    TCP + "timeout expired": ConnectFailure.NO_ANSWER,
    TCP + "server closed the connection unexpectedly\n\tThis probably means the server "
    "terminated abnormally": ConnectFailure.NO_ANSWER,
    TCP + "Network is unreachable": ConnectFailure.NO_ANSWER,
    TCP + "No route to host": ConnectFailure.NO_ANSWER,
    TCP + "FATAL:  the database system is starting up": ConnectFailure.NOT_ACCEPTING,
    TCP + "FATAL:  the database system is shutting down": ConnectFailure.NOT_ACCEPTING,
    TCP + "FATAL:  the database system is in recovery mode": ConnectFailure.NOT_ACCEPTING,
    TCP + "FATAL:  the database system is not yet accepting connections\nDETAIL:  Consistent "
    "recovery state has not been yet reached.": ConnectFailure.NOT_ACCEPTING,
    TCP + "FATAL:  sorry, too many clients already": ConnectFailure.NOT_ACCEPTING,
    TCP + "FATAL:  remaining connection slots are reserved for roles with the SUPERUSER "
    "attribute": ConnectFailure.NOT_ACCEPTING,
    TCP + "FATAL:  terminating connection due to administrator command":
        ConnectFailure.NOT_ACCEPTING,
    TCP + 'FATAL:  password authentication failed for user "orc"': ConnectFailure.BAD_CREDENTIALS,
    TCP + 'FATAL:  role "orc" does not exist': ConnectFailure.BAD_CREDENTIALS,
    TCP + 'FATAL:  role "orc" is not permitted to log in': ConnectFailure.BAD_CREDENTIALS,
    TCP + 'FATAL:  no pg_hba.conf entry for host "10.0.0.9", user "orc", database "orc", no '
    "encryption": ConnectFailure.BAD_CREDENTIALS,
    TCP + 'FATAL:  pg_hba.conf rejects connection for host "10.0.0.9", user "orc"':
        ConnectFailure.BAD_CREDENTIALS,
    SOCKET + 'FATAL:  Peer authentication failed for user "orc"': ConnectFailure.BAD_CREDENTIALS,
    SOCKET + 'FATAL:  permission denied for database "orc"\nDETAIL:  User does not have '
    "CONNECT privilege.": ConnectFailure.BAD_CREDENTIALS,
    "connection failed: fe_sendauth: no password supplied": ConnectFailure.BAD_CREDENTIALS,
    TCP + 'FATAL:  database "orc" does not exist': ConnectFailure.UNKNOWN_DATABASE,
    TCP + 'FATAL:  3D000: database "orc" does not exist': ConnectFailure.UNKNOWN_DATABASE,
    TCP + "FATAL:  57P03: the database system is starting up": ConnectFailure.NOT_ACCEPTING,
    TCP + 'FATAL:  28P01: password authentication failed for user "orc"':
        ConnectFailure.BAD_CREDENTIALS,
    TCP + 'FATAL:  database "orc" is not currently accepting connections':
        ConnectFailure.REFUSED,
    TCP + 'FATAL:  too many connections for role "orc"': ConnectFailure.REFUSED,
    TCP + "FATAL:  unsupported frontend protocol 9.0": ConnectFailure.REFUSED,
    "failed to resolve host 'db.example.invalid': [Errno -2] Name or service not known":
        ConnectFailure.UNKNOWN_HOST,
    "failed to resolve host 'db': [Errno -5] No address associated with hostname":
        ConnectFailure.UNKNOWN_HOST,
    'could not translate host name "db" to address: Name or service not known':
        ConnectFailure.UNKNOWN_HOST,
    "failed to resolve host 'db': [Errno -3] Temporary failure in name resolution":
        ConnectFailure.LOOKUP_FAILED_FOR_NOW,
    # Several addresses tried: the last server's word decides.
    'connection failed: connection to server at "::1", port 5432 failed: Connection refused\n'
    '\tIs the server running?\nconnection to server at "127.0.0.1", port 5432 failed: FATAL:  '
    'password authentication failed for user "orc"': ConnectFailure.BAD_CREDENTIALS,
}  # fmt: skip

WAITS = {ConnectFailure.NO_ANSWER, ConnectFailure.NOT_ACCEPTING,
         ConnectFailure.LOOKUP_FAILED_FOR_NOW}  # fmt: skip


@pytest.mark.parametrize(("message", "kind"), MESSAGES.items())
def test_each_real_message_is_classified(message: str, kind: ConnectFailure) -> None:
    assert connect_failure(message) is kind


def test_only_what_a_wait_can_fix_is_transient() -> None:
    assert {kind for kind in ConnectFailure if kind.transient} == WAITS


SQLSTATES = st.from_regex(r"[0-9A-Z]{5}", fullmatch=True)


@given(SQLSTATES)
def test_every_sqlstate_has_one_kind_by_its_class(sqlstate: str) -> None:
    kind = connect_failure("whatever the text says", sqlstate)
    if sqlstate[:2] == "08":
        assert kind is ConnectFailure.NO_ANSWER
    elif sqlstate[:2] == "53" or sqlstate in ("57P01", "57P02", "57P03"):
        assert kind is ConnectFailure.NOT_ACCEPTING
    elif sqlstate[:2] == "28":
        assert kind is ConnectFailure.BAD_CREDENTIALS
    elif sqlstate == "3D000":
        assert kind is ConnectFailure.UNKNOWN_DATABASE
    else:
        assert kind is ConnectFailure.REFUSED
    # The verbose form of a server's error says the same as the SQLSTATE given apart.
    assert connect_failure(f"{TCP}FATAL:  {sqlstate}: whatever the text says") is kind


@given(st.sampled_from(sorted(MESSAGES)), st.sampled_from(["", TCP, SOCKET]))
def test_the_kind_does_not_depend_on_where_the_message_comes_from(
    message: str, prefix: str
) -> None:
    assert connect_failure(prefix + message.removeprefix(TCP)) is MESSAGES[message]


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=80)


@given(TEXT)
def test_any_other_server_refusal_fails_at_once(text: str) -> None:
    # A FATAL the server sends that is none of the waits is its last word: no wait fixes it.
    kind = connect_failure(f"{TCP}FATAL:  {text}")
    assert not kind.transient or text.strip().startswith(NOT_ACCEPTING_TEXTS)
    assert kind is not ConnectFailure.NO_ANSWER


@given(TEXT)
def test_a_failure_without_the_servers_word_is_waited_out(text: str) -> None:
    lowered = text.lower()
    words = ("fatal:", "error:", "panic:", "fe_sendauth:", "resolve host", "translate host")
    if not any(w in lowered for w in words):
        assert connect_failure(TCP + text) is ConnectFailure.NO_ANSWER


@given(st.sampled_from(NOT_ACCEPTING_TEXTS), TEXT)
def test_a_server_not_accepting_yet_is_waited_out(words: str, rest: str) -> None:
    assert connect_failure(f"{TCP}FATAL:  {words}{rest}") is ConnectFailure.NOT_ACCEPTING


def test_every_credentials_pattern_is_exercised() -> None:
    found = {p.pattern for p in CREDENTIALS_TEXTS for m in MESSAGES if p.search(m)}
    assert found == {p.pattern for p in CREDENTIALS_TEXTS}


# -- real processes, a real server stopped and started ----------------------------------------


@pytest.fixture
def stopped(tmp_path: Path) -> Iterator[tuple[Cluster, str]]:
    """A migrated database on a server of the test's own, stopped."""
    server = Cluster(tmp_path)
    dsn = server.start()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE DATABASE startup")
    dsn = dsn.replace("/postgres?", "/startup?")
    asyncio.run(_migrate(dsn))
    server.stop()
    try:
        yield server, dsn
    finally:
        server.stop()


async def _migrate(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await migrate(conn)


async def readiness(port: int) -> tuple[int | None, str]:
    try:
        async with httpx.AsyncClient(timeout=2) as client:
            answer = await client.get(f"http://127.0.0.1:{port}/readyz")
            return answer.status_code, answer.text
    except httpx.TransportError:
        return None, ""


async def until(condition: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        result = condition()  # type: ignore[operator]
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.1)


def attempt_lines(log: str) -> list[int]:
    """The attempt numbers of the start-up's log lines, in order."""
    return [int(n) for n in re.findall(rf"{WAITING} \(.*\), attempt (\d+): ", log)]


async def wait_while_down(port: int, output: object, alive: object, seconds: float) -> str:
    """Watch a process that waits for its database for ``seconds``: not ready, alive."""
    await until(lambda: len(attempt_lines(output())) >= 2, 20, "two attempts logged")  # type: ignore[operator]
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        assert alive(), output()  # type: ignore[operator]
        assert await readiness(port) == (503, WAITING), output()  # type: ignore[operator]
        async with httpx.AsyncClient(timeout=2) as client:
            assert (await client.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200
        await asyncio.sleep(0.3)
    log: str = output()  # type: ignore[operator]
    return log


def assert_one_line_per_attempt(log: str) -> None:
    numbers = attempt_lines(log)
    assert numbers == list(range(1, len(numbers) + 1)), log
    assert "no server answered" in log and "Traceback" not in log, log
    delays = [float(d) for d in re.findall(r"next attempt in ([0-9.]+) s", log)]
    assert delays == sorted(delays) and max(delays) <= MAX_DELAY, log  # backing off, capped


async def test_a_worker_started_during_an_outage_waits_then_runs_jobs(
    stopped: tuple[Cluster, str],
) -> None:
    server, dsn = stopped
    port = free_port()
    with WorkerProcess(dsn, ORCHESTRATOR_HEALTH_PORT=port) as worker:
        log = await wait_while_down(
            port, worker.output, lambda: worker.process.poll() is None, seconds=3
        )
        assert_one_line_per_attempt(log)
        assert len(attempt_lines(log)) <= 5, log  # 0.5, 1, 2, 4 s apart: not a tight loop
        server.start()
        await until(lambda: _ready(port), 30, "the worker is ready")
        assert "the database answers after" in worker.output()
        orc = Orchestrator(
            settings=settings_for_tests(retry_config=config_with(agent_app.TABLE)), dsn=dsn
        )
        agent_app.register(orc)
        async with orc:
            job_id = await orc.submit(
                "agent", {"service": "http://unused", "steps": 1, "send_at": []}
            )

            async def completed() -> bool:
                return (await orc.get_job(job_id)).status is Status.COMPLETED

            await until(completed, 30, f"job run: {worker.output()[-3000:]}")
        worker.signal(signal.SIGTERM)
        code = await asyncio.to_thread(worker.wait)
        assert code == 0 and "Traceback" not in worker.output(), worker.output()[-3000:]


async def _ready(port: int) -> bool:
    return (await readiness(port))[0] == 200


async def test_serve_started_during_an_outage_waits_then_serves(
    stopped: tuple[Cluster, str],
) -> None:
    server, dsn = stopped
    with ApiServer(dsn, wait=False) as api:
        log = await wait_while_down(
            api.port, api.output, lambda: api.process.poll() is None, seconds=2
        )
        assert_one_line_per_attempt(log)
        server.start()
        await until(lambda: _ready(api.port), 30, f"serve is ready: {api.output()[-3000:]}")
        orc = Orchestrator(settings=settings_for_tests(), dsn=dsn)
        async with orc:
            secret = await token(orc.stores.tokens, "startup", Scope.SUBMIT, Scope.READ)
        headers = {"Authorization": f"Bearer {secret}"}
        async with httpx.AsyncClient(base_url=api.url, headers=headers, timeout=10) as client:
            created = await client.post(
                "/api/v1/jobs", json={"job_type": "scripted", "payload": {"script": ["ok"]}}
            )
            assert created.status_code == 201, created.text
            job = await client.get(f"/api/v1/jobs/{created.json()['job_id']}")
            assert job.status_code == 200 and job.json()["status"] == "PENDING"
        assert api.stop() == 0
        assert "Traceback" not in api.output(), api.output()


# -- a wrong DATABASE_URL fails at once --------------------------------------------------------


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A running server whose role ``alice`` logs in with a password only; its DSN (the
    ``postgres`` database, as the superuser)."""
    server = Cluster(tmp_path_factory.mktemp("guarded"))
    dsn = server.start()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE ROLE alice LOGIN PASSWORD 'right'")
        hba = server.pgdata / "pg_hba.conf"
        hba.write_text("local all alice scram-sha-256\n" + hba.read_text())
        conn.execute("SELECT pg_reload_conf()")
    time.sleep(0.5)  # the postmaster rereads pg_hba.conf on SIGHUP
    try:
        yield dsn
    finally:
        server.stop()


WRONG = {
    "bad password": (
        lambda dsn: dsn.replace("postgres:@", "alice:wrong@"),
        'password authentication failed for user "alice"',
    ),
    "unknown database": (
        lambda dsn: dsn.replace("/postgres?", "/no_such_database?"),
        'database "no_such_database" does not exist',
    ),
    "unresolvable host": (
        lambda dsn: "postgresql://postgres@db.no-such-host.invalid:5432/postgres",
        "failed to resolve host 'db.no-such-host.invalid'",
    ),
}


@pytest.mark.parametrize("command", ["worker", "serve"])
@pytest.mark.parametrize("wrong", sorted(WRONG))
def test_a_wrong_database_url_fails_at_once_with_the_reason(
    guarded: str, wrong: str, command: str
) -> None:
    make, reason = WRONG[wrong]
    env = {**os.environ, **FAST, "DATABASE_URL": make(guarded),
           "ORCHESTRATOR_HEALTH_PORT": str(free_port()),
           "ORCHESTRATOR_API_PORT": str(free_port())}  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "--app", "tests.support.agent_app:orc", command],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - started < 20  # no wait: an import, one connection
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("error: cannot reach the database: "), done.stderr
    assert reason in lines[-1], done.stderr
    assert "Traceback" not in done.stderr and WAITING not in done.stderr, done.stderr


@pytest.mark.parametrize("command", ["worker", "serve"])
def test_sigterm_while_waiting_for_the_database_exits_0(
    stopped: tuple[Cluster, str], command: str, tmp_path: Path
) -> None:
    # A rollout or a scale-down during the outage: nothing was claimed, nothing to drain.
    _, dsn = stopped
    log = tmp_path / "out.log"
    process = _command(command, dsn, log, free_port())
    try:
        deadline = time.monotonic() + 30
        while len(attempt_lines(log.read_text())) < 2:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=15)
    finally:
        process.kill()
    text = log.read_text()
    assert process.returncode == 0, text
    assert "Traceback" not in text, text


async def test_a_probe_left_open_as_the_process_exits_ends_without_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A probe's connection still open when the process exits: its handler is cancelled, as
    asyncio.run cancels what is left, before its first step or while it reads, and ends
    without an error logged. On Python 3.11 a stream handler cancelled before its first step
    made asyncio log one from its done-callback, which failed a serve test in CI."""

    async def ok() -> bool:
        return True

    loop = asyncio.get_running_loop()
    server = HealthServer(port=free_port(), ready=lambda: True, database_ok=ok, host="127.0.0.1")
    await server.start()
    handlers: list[asyncio.Task[object]] = []
    cancel_at_creation = asyncio.Event()

    def task_factory(
        loop: asyncio.AbstractEventLoop, coro: Coroutine[object, object, object]
    ) -> asyncio.Task[object]:
        task = asyncio.Task(coro, loop=loop)
        if "HealthServer._serve" in repr(coro):
            handlers.append(task)
            if cancel_at_creation.is_set():
                task.cancel()
        return task

    loop.set_task_factory(task_factory)  # type: ignore[arg-type]
    try:
        for before_first_step in (True, False):
            if before_first_step:
                cancel_at_creation.set()
            else:
                cancel_at_creation.clear()
            _, writer = await asyncio.open_connection("127.0.0.1", server.port)  # sends nothing
            deadline = loop.time() + 10
            while not handlers:
                assert loop.time() < deadline, "the probe was never accepted"
                await asyncio.sleep(0.01)
            [handler] = handlers
            handler.cancel()
            await asyncio.wait([handler])
            await asyncio.sleep(0.05)  # done-callbacks have run
            writer.close()
            handlers.clear()
    finally:
        loop.set_task_factory(None)
        await server.close()
    assert not [r.getMessage() for r in caplog.records if r.name == "asyncio"]


# -- a SIGTERM at any moment of a start-up, under load -----------------------------------------

BURNERS = 2  # CPU-bound processes beside the start-ups: a newcomer's laptop is rarely quiet


@pytest.fixture
def cpu_load() -> Iterator[None]:
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(BURNERS)]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait(timeout=30)


def _command(command: str, dsn: str, log: Path, port: int) -> subprocess.Popen[bytes]:
    """``orchestrator COMMAND`` of the agent app on ``dsn`` (an API on ``port``), its output
    in ``log``."""
    env = {**os.environ, **FAST, "DATABASE_URL": dsn, "ORCHESTRATOR_API_PORT": str(port)}
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "--app", "tests.support.agent_app:orc",
             command],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip


def _started(command: str, dsn: str, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    """``orchestrator COMMAND`` on ``dsn``, its output in ``log``, once it handles SIGTERM (the
    entry point's first lines have run): the process and its port."""
    port = free_port()
    process = _command(command, dsn, log, port)
    try:
        until_it_handles_sigterm(process.pid, timeout=120)
    except BaseException:
        process.kill()
        process.wait(timeout=30)
        raise
    return process, port


def _is_up(command: str, port: int, log: Path) -> bool:
    if command == "worker":
        return " started: " in log.read_text()
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _start_up_seconds(command: str, dsn: str, log: Path) -> float:
    """How long a start-up takes here, now: from its entry point until it serves."""
    process, port = _started(command, dsn, log)
    began = time.monotonic()
    try:
        while not _is_up(command, port, log):
            assert process.poll() is None and time.monotonic() - began < 120, log.read_text()
            time.sleep(0.05)
        return time.monotonic() - began
    finally:
        process.terminate()
        process.wait(timeout=60)


def _signalled_at(command: str, dsn: str, log: Path, delay: float) -> tuple[int | None, str]:
    """A start-up sent SIGTERM ``delay`` seconds after its entry point began: its exit code
    (None: still running a minute later, the signal lost) and its output."""
    process, _ = _started(command, dsn, log)
    try:
        time.sleep(delay)
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=60)
        return process.returncode, log.read_text()
    finally:
        process.kill()
        process.wait(timeout=30)


@pytest.mark.parametrize(
    "runs", [10, pytest.param(100, marks=pytest.mark.slow)], ids=["10-runs", "100-runs"]
)
@pytest.mark.parametrize("command", ["worker", "serve"])
def test_a_sigterm_at_any_moment_of_start_up_ends_the_process_with_0(
    command: str, runs: int, dsn: str, cpu_load: None, tmp_path: Path
) -> None:
    """SIGTERM at a random moment of a start-up (importing, waiting for and opening the
    database, starting the drain or uvicorn, or just after), with CPU-bound processes beside
    it: every process ends, with 0 and without a traceback. Raised from the signal handler,
    the stop was lost when it landed in a weakref callback during an import ("Exception
    ignored in ...") or in a callback of the event loop."""
    horizon = 1.25 * _start_up_seconds(command, dsn, tmp_path / "measured.log")
    rng = random.Random(20261127 + runs)
    delays = [rng.uniform(0, horizon) for _ in range(runs)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        ends = list(pool.map(
            lambda n: _signalled_at(command, dsn, tmp_path / f"{n}.log", delays[n]), range(runs)
        ))  # fmt: skip
    for (code, output), delay in zip(ends, delays, strict=True):
        assert code == 0, f"signalled {delay:.2f} s in, exit {code}: {output}"
        assert "Traceback" not in output and " ERROR " not in output, output
