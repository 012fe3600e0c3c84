"""The CLI: each command against the test database; user mistakes are one line and exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from orchestrator.cli import main

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def cli(
    dsn: str,
    db: psycopg.AsyncConnection[Any],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> Any:
    monkeypatch.setenv("DATABASE_URL", dsn)
    monkeypatch.delenv("ORCHESTRATOR_RETRY_CONFIG", raising=False)

    def run(*argv: str) -> tuple[int, str, str]:
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse's usage errors
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_submit_status_jobs_cancel(cli: Any) -> None:
    code, out, _ = cli(
        "submit", "http_request", "--payload", '{"url": "http://127.0.0.1:9/x"}', "--agent-id", "a1"
    )
    assert code == 0
    job_id = uuid.UUID(out.strip())

    code, out, _ = cli("status", str(job_id))
    assert code == 0
    assert f"job {job_id}  http_request  PENDING" in out
    assert "retries 0/3" in out and "job.created" in out

    code, out, _ = cli("jobs", "--status", "PENDING")
    assert code == 0 and str(job_id) in out

    code, out, _ = cli("cancel", str(job_id), "--reason", "test")
    assert code == 0
    code, out, _ = cli("status", str(job_id))
    assert "CANCELLED" in out and "job.cancelled" in out

    code, out, _ = cli("jobs", "--status", "PENDING")
    assert str(job_id) not in out


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["submit", "no_such_type"], "unknown job type 'no_such_type'"),
        (
            ["submit", "http_request", "--payload", '{"url": "not a url"}'],
            "invalid payload for job type 'http_request': url",
        ),
        (["submit", "http_request", "--payload", "{oops"], "--payload is not valid JSON"),
        (["status", "not-a-job-id"], "not a job id"),
        (["status", str(uuid.UUID(int=1))], "no job with id 00000000-0000-0000-0000-000000000001"),
        (["--app", "no_such_module:orc", "jobs"], "cannot import 'no_such_module'"),
        (["--app", "tasks.app", "jobs"], "--app must look like module:attribute"),
        (["dlq", "discard", str(uuid.UUID(int=2)), "--by", "me"], "no dead letter"),
    ],
)
def test_user_mistakes_are_one_line_and_exit_2(cli: Any, argv: list[str], fragment: str) -> None:
    code, out, err = cli(*argv)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and fragment in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_config_validate_and_show(cli: Any, tmp_path: Path) -> None:
    code, out, _ = cli("config", "validate")
    assert code == 0 and "default.toml: ok (9 job types)" in out

    bad = tmp_path / "bad.toml"
    bad.write_text("[job_types.llm_generate]\nbackoff = { base_ms = 10, cap_ms = 5 }\n")
    code, out, err = cli("config", "validate", str(bad))
    assert code == 2
    assert f"{bad}: job type 'llm_generate'" in err and "cap_ms (5) must be >= base_ms (10)" in err

    code, out, _ = cli("config", "show", "llm_generate")
    shown = json.loads(out)
    assert shown["app_max_retries"] == 5 and shown["backoff"]["multiplier"] == 3

    code, out, _ = cli("config", "show")
    assert set(json.loads(out)["job_types"]) >= {"http_request", "sweep_zombies"}


def test_migrate_on_a_migrated_database(cli: Any) -> None:
    code, out, _ = cli("migrate")
    assert (code, out.strip()) == (0, "database is up to date")


def test_dlq_list_requeue_and_two_person_discard(cli: Any, dsn: str) -> None:
    code, out, _ = cli("submit", "http_request", "--payload", '{"url": "http://127.0.0.1:9/"}')
    job_id = out.strip()
    with psycopg.connect(dsn, autocommit=True) as conn:  # fail it as a worker would
        conn.execute(
            "UPDATE orc_jobs SET status='RUNNING', lease_token=gen_random_uuid() WHERE id=%s",
            (job_id,),
        )
        conn.execute(
            "WITH f AS (UPDATE orc_jobs SET status='FAILED', lease_token=NULL WHERE id=%s RETURNING id, job_type, payload) "
            "INSERT INTO orc_dead_letters (id, job_id, job_type, payload, error) SELECT gen_random_uuid(), id, job_type, payload, "
            """'{"ts": "2026-11-21T00:00:00Z", "message": "400 Bad Request", "code": "HTTP_400", "classification": "PERMANENT", "attempt": 1, "max_attempts": 5, "terminal": true}' FROM f""",
            (job_id,),
        )
    code, out, _ = cli("dlq", "list")
    assert code == 0 and job_id in out and "[PERMANENT HTTP_400] 400 Bad Request" in out
    letter_id = out.split()[0]

    code, out, err = cli("dlq", "discard", letter_id, "--by", "alice", "--reason", "bad input")
    assert code == 0 and "a second reviewer must confirm" in out
    code, out, err = cli("dlq", "discard", letter_id, "--by", "alice")
    assert code == 2 and "second reviewer" in err
    code, out, err = cli("dlq", "requeue", letter_id)
    assert code == 0  # still possible while only requested
    uuid.UUID(out.strip())
    code, out, err = cli("dlq", "discard", letter_id, "--by", "bob")
    assert code == 2 and "it is requeued" in err


def test_the_console_script_runs_as_a_real_process(dsn: str) -> None:
    env = {**os.environ, "DATABASE_URL": dsn}
    ok = subprocess.run(
        [sys.executable, "-m", "orchestrator", "config", "validate"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "orchestrator", "submit", "nope"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: unknown job type 'nope'") and "Traceback" not in bad.stderr


def test_approvals_list_approve_and_reject(cli: Any, dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        ids = []
        for _ in range(2):
            code, out, _ = cli(
                "submit", "http_request", "--payload", '{"url": "http://127.0.0.1:9/"}'
            )
            job_id = out.strip()
            conn.execute(
                "UPDATE orc_jobs SET status = 'RUNNING', lease_token = gen_random_uuid() WHERE id = %s",
                (job_id,),
            )
            conn.execute(
                "UPDATE orc_jobs SET status = 'WAITING_APPROVAL', lease_token = NULL WHERE id = %s",
                (job_id,),
            )
            row = conn.execute(
                "INSERT INTO orc_approvals (id, job_id, step, key, question, on_reject, expires_at) "
                "VALUES (gen_random_uuid(), %s, 1, 'gate', 'deploy?', 'fail', now() + interval '1 hour') RETURNING id",
                (job_id,),
            ).fetchone()
            assert row is not None
            ids.append((job_id, str(row[0])))
    code, out, _ = cli("approvals", "list")
    assert code == 0 and ids[0][1] in out and "deploy?" in out
    code, out, err = cli("approvals", "approve", ids[0][1], "--by", "alice")
    assert code == 0 and "approved" in out
    code, out, err = cli("approvals", "reject", ids[1][1], "--by", "bob")
    assert code == 2 and "--reason" in err  # a rejection says why
    code, out, err = cli("approvals", "reject", ids[1][1], "--by", "bob", "--reason", "no")
    assert code == 0
    code, out, err = cli("approvals", "approve", ids[0][1], "--by", "alice")
    assert code == 2 and "already approved" in err
    code, out, _ = cli("status", ids[1][0])
    assert "FAILED" in out and "job.rejected" in out and "by bob: no" in out


def test_demo_with_the_real_llm_needs_a_key(cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    code, _, err = cli("demo", "--real-llm")
    assert code == 2 and "--real-llm needs ANTHROPIC_API_KEY" in err
