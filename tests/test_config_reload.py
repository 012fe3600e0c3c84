"""Retry config edits without a restart (docs/configuration.md, "Reloading"): the pure diff and
hold of fixed fields, then real worker and ``serve`` processes whose file is rewritten under them
(atomically, and as a Kubernetes ConfigMap swaps its ``..data`` symlink)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import retry_config
from orchestrator import Orchestrator
from orchestrator.interfaces.cli import main
from orchestrator.runtime.clients import Clients
from retry_config import DEFAULTS, ConfigError, JobRetryConfig, RetryConfig
from tests.support import scripted
from tests.support.api_server import ApiServer, token
from tests.support.harness import BASE_CONFIG, free_port, wait_for
from tests.support.workers import ROOT, WorkerProcess

# -- the diff, pure -----------------------------------------------------------------------------

NAMES = ("alpha", "beta", "gamma")
#: The ERROR a refused version is logged with.
REFUSED = r"retry config \S+: (version \w+|its content \(unreadable\)) refused, version \w+ stays"


@st.composite
def tables(draw: st.DrawFn) -> dict[str, Any]:
    """A table of a few fields, valid by construction (base <= cap, inner timeouts inside)."""
    table: dict[str, Any] = {}
    if draw(st.booleans()):
        base = draw(st.integers(1, 10_000))
        table["backoff"] = {
            "base_ms": base,
            "cap_ms": draw(st.integers(base, 600_000)),
            "multiplier": draw(st.sampled_from([1, 1.5, 2, 3])),
            "jitter": draw(
                st.sampled_from(["full", "none", {"mode": "proportional", "ratio": 0.2}])
            ),
        }
    for name, values in {
        "app_max_retries": st.integers(0, 20),
        "worker_max_attempts": st.integers(1, 20),
        "queue": st.sampled_from(["q1", "q2"]),
        "tool_timeouts_ms": st.sampled_from([{}, {"kubectl": 1000}, {"kubectl": 2000, "ls": 5}]),
    }.items():
        if draw(st.booleans()):
            table[name] = draw(values)
    return table


@st.composite
def configs(draw: st.DrawFn) -> RetryConfig:
    names = draw(st.lists(st.sampled_from(NAMES), unique=True))
    raw = {"defaults": draw(tables()), "job_types": {name: draw(tables()) for name in names}}
    return retry_config.parse(raw, Path("drawn.toml"))


@given(configs())
def test_a_config_against_itself_changes_nothing(config: RetryConfig) -> None:
    assert retry_config.diff(config, config) == {}


def applied(config: JobRetryConfig, fields: dict[str, tuple[Any, Any]]) -> JobRetryConfig:
    """``config`` with each field set to its new value (``backoff.base_ms``: nested)."""
    data = config.model_dump(mode="json")
    for path, (_, new) in fields.items():
        *parents, last = path.split(".")
        target = data
        for parent in parents:
            target = target[parent]
        target[last] = new
    return JobRetryConfig.model_validate(data)


@settings(max_examples=200)
@given(configs(), configs())
def test_the_diff_s_new_values_make_the_other_config(a: RetryConfig, b: RetryConfig) -> None:
    changes = retry_config.diff(a, b)
    assert applied(a.defaults, changes.get(DEFAULTS, {})) == b.defaults
    for name in {*a.job_types, *b.job_types}:
        assert applied(a.for_type(name), changes.get(name, {})) == b.for_type(name)
        for path, (old, new) in changes.get(name, {}).items():
            assert old != new, path
    assert set(changes) <= {DEFAULTS, *a.job_types, *b.job_types}


def parsed(text: str) -> RetryConfig:
    return retry_config.parse_bytes(text.encode(), Path("t.toml"))


def test_the_diff_names_each_scope_and_field_once_per_line() -> None:
    old = parsed("[defaults.backoff]\nbase_ms = 50\n[job_types.alpha]\napp_max_retries = 4\n")
    new = parsed(
        "[defaults.backoff]\nbase_ms = 80\n[job_types.alpha]\napp_max_retries = 5\n"
        "backoff = { jitter = 'none' }\nstep_timeout_seconds = 300\n"
    )
    assert retry_config.describe(retry_config.diff(old, new)) == [
        "[defaults]: backoff.base_ms 50 -> 80",
        "job type 'alpha': app_max_retries 4 -> 5, backoff.base_ms 50 -> 80, backoff.jitter "
        '{"mode":"full"} -> {"mode":"none"}, step_timeout_seconds unset -> 300',
    ]
    # a type whose table goes falls back to [defaults]
    gone = retry_config.diff(old, parsed("[defaults.backoff]\nbase_ms = 50\n"))
    assert gone == {"alpha": {"app_max_retries": (4, 3)}}


def test_a_version_is_the_content_s_hash() -> None:
    text = "[defaults]\napp_max_retries = 1\n"
    assert parsed(text).version == retry_config.version_of(text.encode())
    assert parsed(text).version != parsed(text + "# a comment\n").version
    assert re.fullmatch(r"[0-9a-f]{12}", parsed(text).version)


def test_fields_fixed_at_start_up_are_held_and_named(make_orc: Callable[..., Orchestrator]) -> None:
    orc = make_orc()
    running = parsed("[job_types.http_request]\nqueue = 'web'\n")
    new = parsed(
        "[defaults]\nworker_max_attempts = 7\n"
        "[job_types.http_request]\nqueue = 'other'\napp_max_retries = 9\n"
        "[job_types.http_request.schedule]\ncron = '0 7 * * *'\n"
        "[job_types.sweep_zombies]\nworker_max_attempts = 5\n"
    )
    held, fixed = orc.hold_fixed(new, running)
    assert held.for_type("http_request").schedule is None  # schedules: at the next start
    assert fixed == {
        "http_request": ["queue", "schedule"],
        "sweep_zombies": ["worker_max_attempts"],
        # not named in either file: inherits [defaults]' 7, held at its start-up 3
        "retry_safety_net": ["worker_max_attempts"],
        "expire_approvals": ["worker_max_attempts"],
        "prune_checkpoints": ["worker_max_attempts"],
        "prune_finished": ["worker_max_attempts"],
        "rollup_jobs": ["worker_max_attempts"],
    }
    assert held.queue_of("http_request") == "web"
    assert held.for_type("http_request").app_max_retries == 9  # the rest of the edit applies
    assert held.for_type("sweep_zombies").worker_max_attempts == 3
    assert held.for_type("some_type").worker_max_attempts == 7  # not fixed for job types
    assert held.version == new.version
    assert orc.hold_fixed(running, running) == (running, {})


@pytest.mark.logs_errors(REFUSED)
async def test_a_reload_checks_against_the_application_and_holds_what_a_restart_applies(
    make_orc: Callable[..., Orchestrator], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    file = ConfigFile(tmp_path, "rename")
    file.write(config_text(base=300))
    orc = make_orc(retry_config=file.path, retry_config_poll_seconds=0.1)
    scripted.register(orc)
    reload = orc.config_reload()
    assert reload is not None and orc.config_reload() is reload  # one per process
    first = orc.retry_config

    # valid as a file, but naming a job type the application does not have
    file.write(config_text(base=300) + "[job_types.scriptd]\napp_max_retries = 1\n")
    with caplog.at_level(logging.WARNING, "orchestrator.config"):
        await reload.poll()
        await reload.poll()  # the same version: refused once, logged once
    (refusal,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "job type 'scriptd' is neither registered nor built in" in refusal.getMessage()
    assert orc.retry_config is first
    caplog.clear()

    # the queue is fixed at start-up: held, and named; the rest applies
    file.write(config_text(base=500) + "queue = 'elsewhere'\n")
    with caplog.at_level(logging.WARNING, "orchestrator.config"):
        await reload.poll()
    assert orc.retry_config.for_type("scripted").backoff.base_ms == 500
    assert orc.retry_config.queue_of("scripted") == "scripted"
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        m.endswith("scripted: queue changed in the file; fixed at start-up, it takes effect at "
                   "the next restart") for m in messages
    ), messages  # fmt: skip
    assert "retry config change: job type 'scripted': backoff.base_ms 300 -> 500" in messages
    caplog.clear()

    # a file gone is refused too, once; back as it was, nothing is applied again
    in_effect = orc.retry_config
    file.path.unlink()
    with caplog.at_level(logging.WARNING, "orchestrator.config"):
        await reload.poll()
        await reload.poll()
        file.write(config_text(base=500) + "queue = 'elsewhere'\n")
        await reload.poll()
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [
        f"its content (unreadable) refused, version {in_effect.version} stays in effect: "
        f"{file.path}: file not found",
        f"back to version {in_effect.version}, the one in effect",
    ]
    assert orc.retry_config is in_effect

    assert make_orc(retry_config_poll_seconds=0).config_reload() is None


def test_a_job_type_s_http_client_follows_its_timeouts() -> None:
    clients = Clients()
    config = JobRetryConfig(call_timeout_ms=5_000, connect_timeout_ms=1_000)
    client = clients.http("t", config)
    assert clients.http("t", config.model_copy(update={"app_max_retries": 9})) is client
    edited = clients.http("t", config.model_copy(update={"call_timeout_ms": 6_000}))
    assert edited is not client and edited.timeout.read == 6


# -- real processes -----------------------------------------------------------------------------

#: The scripted type with application retries enough for the test, a fixed delay, no jitter.
SCRIPTED = """
[job_types.scripted]
worker_max_attempts = 4
app_max_retries = 200
backoff = {{ base_ms = {base}, cap_ms = 60000, multiplier = 1, jitter = "none" }}
"""
INVALID = SCRIPTED.format(base=900).replace("cap_ms = 60000", "cap_ms = 10")


def config_text(base: int) -> str:
    return BASE_CONFIG.read_text() + SCRIPTED.format(base=base)


class ConfigFile:
    """The worker's config file, rewritten as an editor does (a new file renamed over it) or
    as the kubelet updates a ConfigMap mount (``retry.toml -> ..data/retry.toml``, with
    ``..data`` a symlink to a timestamped directory, swapped by a rename)."""

    def __init__(self, directory: Path, how: str) -> None:
        self.directory, self.how, self.n = directory, how, 0
        self.path = directory / "retry.toml"

    def write(self, text: str) -> None:
        self.n += 1
        if self.how == "rename":
            new = self.directory / f".retry.toml.{self.n}"
            new.write_text(text)
            os.replace(new, self.path)
            return
        version = self.directory / f"..2026_11_26_{self.n:02d}"
        version.mkdir()
        (version / "retry.toml").write_text(text)
        link = self.directory / "..data_tmp"
        link.symlink_to(version.name)
        os.replace(link, self.directory / "..data")
        if not self.path.is_symlink():
            self.path.symlink_to("..data/retry.toml")


async def retry_delays(orc: Orchestrator, job_id: Any) -> list[float]:
    return [
        e.payload["backoff_ms"]
        for e in await orc.job_events(job_id)
        if e.kind == "job.retry_scheduled"
    ]


def metric(port: int, line: str) -> bool:
    return line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text.splitlines()


@pytest.mark.logs_errors(REFUSED)
@pytest.mark.parametrize("how", ["rename", "configmap"])
async def test_a_running_worker_applies_an_edit_and_keeps_it_through_an_invalid_one(
    how: str, dsn: str, make_orc: Callable[..., Orchestrator], tmp_path: Path,
) -> None:  # fmt: skip
    file = ConfigFile(tmp_path, how)
    file.write(config_text(base=300))
    first = retry_config.load(file.path).version
    orc = make_orc(retry_config=file.path)
    scripted.register(orc)
    port = free_port()
    env = {
        "ORCHESTRATOR_RETRY_CONFIG": file.path,
        "ORCHESTRATOR_RETRY_CONFIG_POLL_SECONDS": "0.1",
        "ORCHESTRATOR_HEALTH_PORT": port,
        "ORCHESTRATOR_STALLED_WORKER_SECONDS": "1.5",  # the registry heartbeat every 0.5 s
    }
    with WorkerProcess(dsn, "tests.support.scripted_app:orc", **env) as worker:
        async with orc:
            job_id = await orc.submit("scripted", {"script": ["app"] * 300})

            async def retried(n: int, since: int = 0) -> bool:
                return len(await retry_delays(orc, job_id)) >= since + n

            await wait_for(lambda: retried(2), timeout=30)
            assert set(await retry_delays(orc, job_id)) == {300}

            file.write(config_text(base=700))
            second = retry_config.load(file.path).version
            await wait_for(lambda: _said(worker, f"version {second} applied"), timeout=15)
            before = len(await retry_delays(orc, job_id))
            await wait_for(lambda: retried(3, before), timeout=30)
            # (the attempt running while the file changed may have started under the old one)
            assert set((await retry_delays(orc, job_id))[before + 1 :]) == {700}
            log = worker.output()
            assert (
                f"retry config {file.path}: version {second} applied (was {first}): "
                "1 scope(s) changed" in log
            )
            assert "retry config change: job type 'scripted': backoff.base_ms 300 -> 700" in log
            assert metric(port, f'orchestrator_retry_config_version{{version="{second}"}} 1.0')
            assert metric(port, 'orchestrator_retry_config_reloads_total{result="applied"} 1.0')
            assert metric(port, "orchestrator_retry_config_refused 0.0")

            file.write(BASE_CONFIG.read_text() + INVALID)
            await wait_for(lambda: _said(worker, "refused"), timeout=15)
            before = len(await retry_delays(orc, job_id))
            await wait_for(lambda: retried(3, before), timeout=30)
            assert set((await retry_delays(orc, job_id))[before:]) == {700}
            refusal = worker.output()
            assert f"version {second} stays in effect" in refusal
            assert "cap_ms (10) must be >= base_ms (900)" in refusal
            assert metric(port, "orchestrator_retry_config_refused 1.0")
            assert metric(port, 'orchestrator_retry_config_reloads_total{result="refused"} 1.0')

            # the registry says which version the worker runs, and that it is not the file's

            async def shown_on(version: str, on_file: bool) -> bool:
                code, shown = await show_workers(dsn, file.path)
                (entry,) = shown["workers"]
                return code == 0 and (entry["version"], entry["on_file_version"]) == (
                    version,
                    on_file,
                )

            await wait_for(lambda: shown_on(second, False), timeout=10)
            _, shown = await show_workers(dsn, file.path)
            assert "cap_ms (10) must be >= base_ms (900)" in shown["config"]["error"]

            file.write(config_text(base=700))  # back to the version in effect
            await wait_for(lambda: _said(worker, f"back to version {second}"), timeout=15)
            assert metric(port, "orchestrator_retry_config_refused 0.0")
            await wait_for(lambda: shown_on(second, True), timeout=10)
            _, shown = await show_workers(dsn, file.path)
            (recorded,) = shown["workers"]
            assert recorded["worker"].endswith(f"/{worker.pid}/w{recorded['worker_id']}")


async def _said(worker: WorkerProcess, text: str) -> bool:
    return text in worker.output()


async def show_workers(dsn: str, path: Path) -> tuple[int, Any]:
    """``orchestrator config show --workers`` as an operator runs it (a process of its own,
    reading its settings and the application at its start), its exit code and its output."""
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "orchestrator", "--app", "tests.support.scripted_app:orc",
         "config", "show", "--workers"],
        env={**os.environ, "DATABASE_URL": dsn, "ORCHESTRATOR_RETRY_CONFIG": str(path)},
        cwd=ROOT, capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert done.stdout, done.stderr
    return done.returncode, json.loads(done.stdout)


async def test_a_worker_records_its_version_and_config_show_flags_the_others(
    dsn: str, tmp_path: Path, db: psycopg.AsyncConnection[Any],
) -> None:  # fmt: skip
    file = ConfigFile(tmp_path, "rename")
    file.write(config_text(base=300))
    version = retry_config.load(file.path).version
    env = {"ORCHESTRATOR_RETRY_CONFIG": file.path, "ORCHESTRATOR_STALLED_WORKER_SECONDS": "1.5",
           "ORCHESTRATOR_RETRY_CONFIG_POLL_SECONDS": "0"}  # fmt: skip
    with WorkerProcess(dsn, "tests.support.scripted_app:orc", **env) as worker:

        async def recorded() -> bool:
            cur = await db.execute("SELECT config_version FROM orc_worker_configs")
            return [row[0] for row in await cur.fetchall()] == [version]

        await wait_for(recorded, timeout=20)
        file.write(config_text(base=700))  # this worker does not reload (poll 0)
        code, shown = await show_workers(dsn, file.path)
        assert code == 0
        assert shown["version"] == retry_config.load(file.path).version != version
        (entry,) = shown["workers"]
        assert (entry["version"], entry["on_file_version"]) == (version, False)
        assert str(worker.pid) in entry["worker"]
        worker.signal(signal.SIGTERM)  # it unregisters: its row goes with its entry (cascade)
        assert await asyncio.to_thread(worker.wait) == 0
    cur = await db.execute("SELECT count(*) FROM orc_worker_configs")
    assert (await cur.fetchone()) == (0,)


@pytest.mark.logs_errors(REFUSED)
async def test_serve_reloads_what_the_api_reports(
    dsn: str, make_orc: Callable[..., Orchestrator], tmp_path: Path,
    db: psycopg.AsyncConnection[Any],
) -> None:  # fmt: skip
    file = ConfigFile(tmp_path, "configmap")
    file.write(config_text(base=300))
    orc = make_orc(retry_config=file.path)
    scripted.register(orc)
    env = {"ORCHESTRATOR_RETRY_CONFIG": file.path, "ORCHESTRATOR_RETRY_CONFIG_POLL_SECONDS": "0.1",
           "ORCHESTRATOR_STALLED_WORKER_SECONDS": "1.5"}  # fmt: skip
    app = "tests.support.scripted_app:orc"
    async with orc:
        secret = await token(orc.stores.tokens, "reader")
    with ApiServer(dsn, app, **env) as server:
        headers = {"Authorization": f"Bearer {secret}"}

        def shown() -> dict[str, Any]:
            answer = httpx.get(f"{server.url}/api/v1/config", headers=headers, timeout=5)
            assert answer.status_code == 200, answer.text
            body: dict[str, Any] = answer.json()
            return body

        assert shown()["job_types"]["scripted"]["backoff"]["base_ms"] == 300
        file.write(config_text(base=700))
        second = retry_config.load(file.path).version

        async def applied() -> bool:
            return shown()["version"] == second

        await wait_for(applied, timeout=15)
        assert shown()["job_types"]["scripted"]["backoff"]["base_ms"] == 700

        async def recorded() -> bool:  # beside its registry entry, as a worker's
            cur = await db.execute("SELECT worker, config_version FROM orc_worker_configs")
            rows = await cur.fetchall()
            return len(rows) == 1 and "/api/w" in rows[0][0] and rows[0][1] == second

        await wait_for(recorded, timeout=15)
        file.write(BASE_CONFIG.read_text() + INVALID)

        async def refused() -> bool:
            return "refused" in server.output()

        await wait_for(refused, timeout=15)
        assert shown()["version"] == second
        assert shown()["job_types"]["scripted"]["backoff"]["base_ms"] == 700


# -- config diff ----------------------------------------------------------------------------------


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> Any:
    running = tmp_path / "running.toml"
    running.write_text(config_text(base=300))
    monkeypatch.setenv("ORCHESTRATOR_RETRY_CONFIG", str(running))

    def run(*argv: str) -> tuple[int, str, str]:
        try:
            code = main(["--app", "tests.support.scripted_app:orc", *argv])
        except SystemExit as exc:
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_config_diff_shows_what_an_edit_changes_before_it_is_applied(
    cli: Any, tmp_path: Path
) -> None:
    edited = tmp_path / "edited.toml"
    edited.write_text(config_text(base=700).replace("app_max_retries = 200", "queue = 'slow'"))
    code, out, err = cli("config", "diff", str(edited))
    assert (code, err) == (1, "")
    assert out.splitlines() == [
        "job type 'scripted'",
        "  app_max_retries: 200 -> 3",
        "  backoff.base_ms: 300 -> 700",
        '  queue: unset -> "slow"  (fixed at start-up: applied at the next restart)',
    ]

    same = tmp_path / "same.toml"
    same.write_text(config_text(base=300) + "# only a comment\n")
    code, out, err = cli("config", "diff", str(same))
    assert (code, out) == (0, "")
    assert "no change against" in err


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[defaults]\nbackoff = { base_ms = 10, cap_ms = 5 }\n", "cap_ms (5) must be >= base_ms"),
        ("[job_types.scriptd]\napp_max_retries = 1\n", "did you mean 'scripted'?"),
        ("[defaults\n", "not valid TOML"),
        (
            "[job_types.ext]\nexternal = true\nqueue = 'shared'\n"
            "[job_types.scripted]\nqueue = 'shared'\n",
            "job type 'scripted' is on queue 'shared', the queue of the external job type 'ext'",
        ),
    ],
)
def test_config_diff_refuses_an_invalid_file_without_a_traceback(
    cli: Any, tmp_path: Path, text: str, problem: str
) -> None:
    edited = tmp_path / "edited.toml"
    edited.write_text(text)
    code, out, err = cli("config", "diff", str(edited))
    assert (code, out) == (2, "")
    assert err.startswith("error: ") and problem in err and "Traceback" not in err
    assert cli("config", "validate", str(edited)) == (code, out, err)  # the same checks
    code, _, err = cli("config", "diff", str(tmp_path / "missing.toml"))
    assert code == 2 and "file not found" in err


def test_an_invalid_file_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="cap_ms"):
        parsed(INVALID)
