"""``orchestrator tail`` (docs/output.md), a real process beside a worker process on a real
PostgreSQL: a job's output printed as it is written, attempt by attempt (the first attempt's
progress record and text, its superseded marker, the next attempt's), until the job has
finished; ``--offset``; ``--final``, which waits for the job's end; and the user's mistakes (an
unknown job, a bad id or offset): one line, exit 2."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest

from orchestrator import Orchestrator, Status
from orchestrator.interfaces.cli import main
from tests.support import output_app
from tests.support.workers import WorkerProcess

ROOT = Path(__file__).resolve().parent.parent
APP = "tests.support.output_app:orc"
DELTAS = 60


def attempt_lines(attempt: int) -> str:
    """What the streamer's attempt writes, as ``tail`` prints it after the attempt's record."""
    return "".join(f"a{attempt}d{n} " for n in range(DELTAS)) + "\n"


def progress(attempt: int) -> str:
    """The attempt's progress record's line (its keys in the order PostgreSQL's jsonb keeps)."""
    return f'[attempt {attempt}] progress {{"deltas": {DELTAS}, "attempt": {attempt}}}\n'


SUPERSEDED = "[attempt 1] superseded: its output from step 1 on is made again by the next attempt\n"


async def tail(dsn: str, job_id: UUID, *options: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "orchestrator", "--app", APP, "tail", str(job_id), *options,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT,
        env={**os.environ, "DATABASE_URL": dsn, "ORCHESTRATOR_RETRY_CONFIG": str(output_app.CONFIG)},
    )  # fmt: skip


async def test_tail_prints_a_job_s_output_as_it_is_written_attempt_by_attempt_until_its_end(
    make_orc: Callable[..., Orchestrator], empty_dsn: str
) -> None:
    orc = make_orc(retry_config=output_app.CONFIG)
    output_app.register(orc)
    async with orc:
        job_id = await orc.submit("streamer", {"deltas": DELTAS, "every": 0.05, "fail_first": True})
        live = await tail(empty_dsn, job_id)
        final = await tail(empty_dsn, job_id, "--final")  # waits for the job's end
        with WorkerProcess(empty_dsn, APP, ORCHESTRATOR_RETRY_CONFIG=output_app.CONFIG):
            async with asyncio.timeout(60):
                assert live.stdout is not None
                printed = b""
                while b"a1d0 " not in printed:
                    read = await live.stdout.read(4096)
                    assert read, "tail ended before the job wrote anything"
                    printed += read
                assert (await orc.get_job(job_id)).finished_at is None  # printed as written
                out, err = await live.communicate()
                finals = await final.communicate()
            job = await orc.get_job(job_id)
        assert job.status is Status.COMPLETED
        # After the job's end: from an offset (the first attempt's text on), then the final.
        from_one = await (await tail(empty_dsn, job_id, "--offset", "1")).communicate()
    assert (printed + out).decode() == (
        progress(1) + attempt_lines(1) + SUPERSEDED + progress(2) + attempt_lines(2)
    )
    assert (live.returncode, err.decode()) == (0, f"job {job_id} COMPLETED\n")
    assert from_one == (
        ("[attempt 1]\n" + attempt_lines(1) + SUPERSEDED + progress(2) + attempt_lines(2)).encode(),
        f"job {job_id} COMPLETED\n".encode(),
    )
    assert finals == (
        (progress(2) + attempt_lines(2)).encode(),
        f"job {job_id} COMPLETED\n".encode(),
    )
    assert final.returncode == 0


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["tail", str(UUID(int=1))], "no job with id 00000000-0000-0000-0000-000000000001"),
        (["tail", "not-a-job-id"], "not a job id"),
        (["tail", str(UUID(int=1)), "--offset", "-1"], "argument --offset: must be a whole number"),
        (["tail", str(UUID(int=1)), "--offset", "x"], "argument --offset: must be a whole number"),
    ],
)
def test_tail_says_a_mistake_in_one_line_and_exits_2(
    argv: list[str], said: str, dsn: str, db: Any, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setenv("DATABASE_URL", dsn)
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.startswith(f"error: {said}") and err.count("\n") == 1, err
