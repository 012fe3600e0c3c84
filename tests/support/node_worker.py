"""tests/support/external_worker.js, the external worker in Node.js, in a process of its own:
its JSON lines read back."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any
from uuid import UUID

from tests.support.api_server import ApiServer
from tests.support.harness import ROOT
from tests.support.tools import find

SCRIPT = ROOT / "tests" / "support" / "external_worker.js"


class NodeWorker:
    """The worker, named ``name``, running jobs of ``job_type`` through ``server``."""

    def __init__(
        self, server: ApiServer, secret: str, name: str, tmp: Path, job_type: str = "external_echo"
    ) -> None:
        self.log = tmp / f"{name}.log"
        env = {**os.environ, "ORCHESTRATOR_URL": server.url, "ORCHESTRATOR_TOKEN": secret}
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                [find("node"), str(SCRIPT), name, job_type], env=env, stdout=out,
                stderr=subprocess.STDOUT,
            )  # fmt: skip

    def lines(self) -> list[dict[str, Any]]:
        found = []
        for line in self.log.read_text().splitlines():
            with contextlib.suppress(ValueError):
                found.append(json.loads(line))
        return found

    def events(self, job_id: UUID) -> list[dict[str, Any]]:
        """What it logged of this job, in order."""
        return [e for e in self.lines() if e.get("job_id") == str(job_id)]

    def claimed(self, job_id: UUID) -> bool:
        return any(e["event"] == "claimed" for e in self.events(job_id))

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=10)
