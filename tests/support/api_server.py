"""``orchestrator serve`` as a real process on 127.0.0.1, for the API tests, with tokens made
the way an operator makes them (``orchestrator tokens create``'s store)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from orchestrator import Orchestrator
from orchestrator.domain.principals import Scope
from orchestrator.storage.tokens import TokenStore
from tests.support import log_guard
from tests.support.harness import free_port
from tests.support.workers import FAST

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.support.api_app:orc"


class ApiServer:
    def __init__(
        self, dsn: str, app: str = APP, *, wait: bool = True, port: int | None = None, **env: Any
    ) -> None:
        """``wait``: return once it is ready (else at once: a test of its start-up); ``port``:
        this one (a server started again where its clients reconnect), else a free one."""
        self.port = free_port() if port is None else port
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - kept open for the process
            prefix="serve-", suffix=".log", delete=False
        )
        from tests.support.api_app import CONFIG

        environment = {
            **os.environ, **FAST, "DATABASE_URL": dsn, "PYTHONUNBUFFERED": "1",
            "ORCHESTRATOR_API_PORT": str(self.port),
        }  # fmt: skip
        if app == APP:  # another application reads its own config (or the default)
            environment["ORCHESTRATOR_RETRY_CONFIG"] = str(CONFIG)
        else:
            environment.pop("ORCHESTRATOR_RETRY_CONFIG", None)
        environment.update({key: str(value) for key, value in env.items()})
        self.process = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "--app", app, "serve"],
            cwd=ROOT, env=environment, stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log_guard.watch(f"serve {app}", self.process, self.log.name)
        if wait:
            self._wait_ready()

    def _wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"orchestrator serve exited: {self.output()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"orchestrator serve not ready: {self.output()[-3000:]}")

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()

    def __enter__(self) -> ApiServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.log.close()
        os.unlink(self.log.name)


async def token(
    tokens: TokenStore, name: str, *scopes: Scope, tenants: Sequence[str] | None = None
) -> str:
    made = await tokens.create(name, scopes or tuple(Scope), tenants, by="tests")
    return made.token


@contextlib.contextmanager
def ui_session(server: ApiServer, secret: str) -> Iterator[tuple[httpx.Client, str]]:
    """A client signed in to the dashboard as a browser does (the sign-in form's CSRF token,
    from its page and cookie), and the session's CSRF token for its forms."""
    with httpx.Client(base_url=server.url, timeout=10) as browser:
        signed = browser.post(
            "/ui/login", data={"token": secret, "csrf": page_csrf(browser, "/ui/login")}
        )
        assert signed.status_code == 303 and "error" not in signed.headers["location"], signed.text
        yield browser, page_csrf(browser, "/ui")


def page_csrf(browser: httpx.Client, page: str) -> str:
    """The CSRF token of the dashboard page's forms (the sign-in page: with its cookie)."""
    found = re.search(r'name="csrf" value="([^"]+)"', browser.get(page).text)
    assert found, page
    return found.group(1)


async def api_orchestrator(make_orc: Callable[..., Orchestrator], **settings: Any) -> Orchestrator:
    """An open Orchestrator on the test database with what ``serve`` runs in these tests (the
    API app's config and job types): the tests' own side of the server, for tokens and jobs."""
    from tests.support import agent_app, api_app, scripted

    made = make_orc(retry_config=api_app.CONFIG, **settings)
    scripted.register(made)
    agent_app.register(made)
    await made.open()
    return made
