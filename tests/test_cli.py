"""The CLI: each command against the test database; user mistakes are one line and exit 2."""

from __future__ import annotations

import asyncio
import getpass
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

import tasks
from orchestrator import Orchestrator
from orchestrator.domain.classification import ErrorClass
from orchestrator.domain.events import Fault
from orchestrator.domain.models import JobState
from orchestrator.interfaces.cli import main
from orchestrator.settings import nearest_data_dir
from tests.support import log_guard, scripted
from tests.support.harness import WorkerRun, config_with

ROOT = Path(__file__).resolve().parent.parent
OS_USER = getpass.getuser()


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
    assert cli("jobs", "--status", "pending") == (code, out, "")  # any case

    code, out, _ = cli("cancel", str(job_id), "--reason", "no longer needed", "--by", "alice")
    assert code == 0
    code, out, _ = cli("status", str(job_id))
    assert "CANCELLED" in out
    # why, and who: the name given and the OS user who ran the command (the API records tokens)
    assert f"job.cancelled            by alice (cli:{OS_USER}): no longer needed" in out

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
        (["submit", "http_request", "--tenant", ""], "argument --tenant: a tenant cannot be empty"),
        (["tokens", "create", "ci", "--scope", "read", "--tenant", " "], "a tenant cannot be only"),
        (["status", "not-a-job-id"], "not a job id"),
        (["status", str(uuid.UUID(int=1))], "no job with id 00000000-0000-0000-0000-000000000001"),
        (["--app", "no_such_module:orc", "jobs"], "cannot import 'no_such_module'"),
        (["--app", "tasks.app", "jobs"], "--app must look like module:attribute"),
        (["dlq", "discard", str(uuid.UUID(int=2)), "--by", "me"], "no dead letter"),
        (["dlq", "show", str(uuid.UUID(int=3))], f"no dead letter with id {uuid.UUID(int=3)}"),
        (["dlq", "requeue", "nope"], "not a dead letter id: 'nope'"),
        (["approvals", "approve", "nope", "--by", "me"], "not an approval id: 'nope'"),
        (
            ["approvals", "reject", str(uuid.UUID(int=4)), "--by", "me", "--reason", "no"],
            f"no approval with id {uuid.UUID(int=4)}",
        ),
        # argparse's own mistakes are one line too
        (["jobs", "--limit", "-1"], "argument --limit: must be a whole number from 1 to 100000"),
        (["jobs", "--limit", str(10**30)], "argument --limit: must be a whole number from 1 to"),
        (["dlq", "list", "--limit", "0"], "argument --limit: must be a whole number from 1 to"),
        (["approvals", "list", "--limit", "x"], "argument --limit: must be a whole number"),
        (["jobs", "--status", "done"], "argument --status: invalid choice: 'DONE'"),
        (["dlq", "discard", str(uuid.UUID(int=2))], "required: --by"),
        (["no-such-command"], "argument COMMAND: invalid choice: 'no-such-command'"),
        (["migrate", "--json"], "--json goes with --plan or --check"),
        (["stats", "--step", "90"], "step: 90 s is not a whole number of minutes"),
        (["stats", "--step", "30"], "argument --step: must be whole seconds from 1m to 366d"),
        (["stats", "--by", "tenant,colour"], "by: 'colour' is not one of job_type, queue, tenant"),
        (["stats", "--from", "yesterday"], "argument --from: not an ISO 8601 time: 'yesterday'"),
        (["stats", "--from", "2026-01-02T00:00Z", "--to", "2026-01-01T00:00Z"], "must be before"),
        (
            ["submit", "http_request", "--payload", "[" * 10_000 + "]" * 10_000],
            "--payload is nested too deeply to read",
        ),
        (
            ["status", "\udcff"],
            "an argument is not UTF-8 text: b'\\xff'",
        ),  # as Python reads b"\xff"
    ],
)
def test_user_mistakes_are_one_line_and_exit_2(cli: Any, argv: list[str], fragment: str) -> None:
    code, out, err = cli(*argv)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and fragment in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    ("environment", "expected"),
    [
        (
            {"ORCHESTRATOR_WORKER_CONCURRENCY": "0"},
            "error: ORCHESTRATOR_WORKER_CONCURRENCY: Input should be greater than or equal to 1 "
            "(got '0')",
        ),
        (
            {"DATABASE_URL": "postgresql://ops:s3cret word@db/orchestrator"},
            "error: DATABASE_URL: not a PostgreSQL URL (postgresql://user:password@host:port/"
            "database) nor a key=value connection string",  # the password never repeated
        ),
        (
            {"ORCHESTRATOR_SWEEP_CRON": "every minute"},
            "error: ORCHESTRATOR_SWEEP_CRON: not a cron schedule (five fields, or six with "
            "seconds last) (got 'every minute')",
        ),
        (
            {"ORCHESTRATOR_ZOMBIE_THRESHOLD": "40"},
            "error: Settings: ORCHESTRATOR_HEARTBEAT_INTERVAL (30 s) must be at most half of "
            "ORCHESTRATOR_ZOMBIE_THRESHOLD (40 s): a running job whose heartbeat is late once "
            "would be swept as a zombie",
        ),
    ],
)
def test_a_bad_setting_is_one_line_naming_its_variable(
    dsn: str, environment: dict[str, str], expected: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "jobs"],
        capture_output=True, text=True, env={**os.environ, "DATABASE_URL": dsn, **environment},
        cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (2, "", expected + "\n")


@pytest.mark.parametrize(
    "url",
    ["postgresql://orc:s3cret-pw@db host/orc", "not a url", "host=db password=s3cret word"],
)  # the last: libpq's own reason would quote a part of the password
def test_a_malformed_database_url_is_one_line_without_its_password(url: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "jobs"],
        capture_output=True, text=True, env={**os.environ, "DATABASE_URL": url}, cwd=ROOT,
        timeout=60,
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith("error: DATABASE_URL: not a PostgreSQL URL (")
    assert done.stderr.count("\n") == 1 and "s3cret" not in done.stderr, done.stderr


def test_a_command_uses_the_embedded_database_of_a_folder_above(tmp_path: Path) -> None:
    # run from a project's subfolder, it finds the project's .orchestrator (as git finds .git);
    # from a folder with none above it, ./.orchestrator (where it says it creates one)
    (tmp_path / ".orchestrator" / "pgdata").mkdir(parents=True)
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    assert nearest_data_dir(tmp_path / "sub" / "deeper") == tmp_path / ".orchestrator"
    (tmp_path / "elsewhere").mkdir()
    assert nearest_data_dir(tmp_path / "elsewhere") == tmp_path / ".orchestrator"
    assert nearest_data_dir(Path("/")) == Path("/.orchestrator")


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
    code, out, _ = cli("dlq", "list", "--state", "RECORDED")
    assert code == 0 and job_id in out and "[PERMANENT HTTP_400] 400 Bad Request" in out
    letter_id = out.split()[0]
    code, out, err = cli("dlq", "show", job_id)  # a job's id: its dead letter's is named
    assert (code, err) == (
        2, f"error: {job_id} is a job's id, not a dead letter's: its dead letter is "
        f"{letter_id} (orchestrator dlq show {letter_id})\n",
    )  # fmt: skip

    code, out, err = cli("dlq", "discard", letter_id, "--by", "alice")  # no request to confirm
    assert code == 2 and out == ""
    assert err == (
        f"error: --reason is required: it requests the discard of dead letter {letter_id}, "
        "which a second reviewer then confirms (without --reason)\n"
    )
    code, out, err = cli("dlq", "discard", letter_id, "--by", "alice", "--reason", "bad input")
    assert code == 0 and "a second reviewer must confirm" in out
    code, out, err = cli("dlq", "show", letter_id)
    assert code == 0 and out.splitlines()[:3] == [
        f"dead letter {letter_id}  discard_requested",
        f"  job {job_id}  http_request  (orchestrator status {job_id})",
        "  error: [PERMANENT HTTP_400] 400 Bad Request",
    ]
    assert f"  discard requested by alice (cli:{OS_USER}): bad input" in out
    code, out, err = cli("dlq", "discard", letter_id, "--by", "alice")
    assert code == 2 and "second reviewer" in err
    code, out, err = cli("dlq", "requeue", letter_id)
    assert code == 0  # still possible while only requested
    uuid.UUID(out.strip())
    code, out, err = cli("dlq", "discard", letter_id, "--by", "bob")
    assert code == 2 and "it is requeued" in err


def test_a_discard_requested_by_lk_is_not_confirmed_by_capital_i_or_palochka_k(
    cli: Any, dsn: str
) -> None:
    """Issue 43: a capital I and a Cyrillic capital palochka look like a small l (their case
    folds do not): refused as the second reviewer of "lk"; "ik" is another person."""
    code, out, _ = cli("submit", "http_request", "--payload", '{"url": "http://127.0.0.1:9/"}')
    with psycopg.connect(dsn, autocommit=True) as conn:
        letter = conn.execute(
            "INSERT INTO orc_dead_letters (id, job_id, job_type, payload, error)"
            " VALUES (gen_random_uuid(), %s, 'http_request', '{}', '{\"ts\": \"2026-11-21T00:00:00Z\","
            ' "message": "gone", "code": "HTTP_404", "classification": "PERMANENT",'
            ' "attempt": 1, "terminal": true}\') RETURNING id',
            (out.strip(),),
        ).fetchone()
    assert letter is not None
    letter_id = str(letter[0])
    code, out, err = cli("dlq", "discard", letter_id, "--by", "lk", "--reason", "stale")
    assert code == 0, err
    for look_alike in ("Ik", "\u04c0k"):
        code, out, err = cli("dlq", "discard", letter_id, "--by", look_alike)
        assert (code, out) == (2, "")
        assert err == (
            f"error: lk (cli:{OS_USER}) requested this discard, and {look_alike} (cli:{OS_USER})"
            " is the same person; a second reviewer must confirm it\n"
        )
    code, out, err = cli("dlq", "discard", letter_id, "--by", "ik")
    assert code == 0, err
    assert cli("dlq", "show", letter_id)[1].splitlines()[0].endswith("discarded")


@log_guard.fails_jobs("HTTP_400")
async def test_a_tenant_is_shown_and_filters_jobs_and_dead_letters(
    cli: Any, make_orc: Callable[..., Orchestrator], db: psycopg.AsyncConnection[Any]
) -> None:
    def submit(*options: str) -> str:
        payload = '{"url": "http://127.0.0.1:9/"}'
        return str(cli("submit", "http_request", "--payload", payload, *options)[1].strip())

    acme = await asyncio.to_thread(submit, "--tenant", "acme")  # the CLI runs a loop of its own
    nobody = await asyncio.to_thread(submit)
    orc = make_orc()
    tasks.register_all(orc)
    async with orc:  # both fail as an attempt's permanent error fails them
        for job_id in (acme, nobody):
            await db.execute(
                "UPDATE orc_jobs SET status = 'RUNNING', lease_token = gen_random_uuid() "
                "WHERE id = %s",
                (job_id,),
            )
            held = JobState.model_validate(dict(await orc.get_job(job_id)))  # its lease too
            fault = Fault("400 Bad Request", "HTTP_400", ErrorClass.PERMANENT)
            await orc.stores.jobs.fail([orc.failures.terminal(held, fault)])

    def check() -> None:
        code, out, _ = cli("status", acme)
        assert code == 0 and out.splitlines()[2] == "  tenant acme"
        assert "tenant" not in cli("status", nobody)[1]
        code, out, _ = cli("jobs", "--tenant", "acme")
        assert code == 0 and len(out.splitlines()) == 1
        assert out.startswith(acme) and out.endswith("  tenant acme\n")
        code, out, _ = cli("jobs")
        assert [line.endswith("  tenant acme") for line in out.splitlines()] == [False, True]
        assert cli("jobs", "--tenant", "initech", "--type", "http_request") == (
            0, "", "no jobs of type http_request for tenant initech\n",
        )  # fmt: skip

        code, out, _ = cli("dlq", "list", "--tenant", "acme")
        assert code == 0 and len(out.splitlines()) == 1
        assert f"job {acme}" in out and " tenant acme  [PERMANENT HTTP_400] 400 Bad Request" in out
        code, out, _ = cli("dlq", "list")
        assert [" tenant " in line for line in out.splitlines()] == [False, True]
        code, out, _ = cli("dlq", "show", cli("dlq", "list", "--tenant", "acme")[1].split()[0])
        assert code == 0 and "  tenant acme" in out.splitlines()
        assert cli("dlq", "list", "--state", "recorded", "--tenant", "initech") == (
            0, "", "no recorded dead letters for tenant initech\n",
        )  # fmt: skip

    await asyncio.to_thread(check)


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
    code, out, _ = cli("approvals", "list", "--status", "PENDING")
    assert code == 0 and ids[0][1] in out and "deploy?" in out
    code, out, err = cli("approvals", "approve", ids[0][1], "--by", "alice")
    assert (code, out) == (0, f"approved {ids[0][1]} (by alice)\n")
    code, out, err = cli("approvals", "reject", ids[1][1], "--by", "bob")
    assert code == 2 and "--reason" in err  # a rejection says why
    code, out, err = cli("approvals", "reject", ids[1][1], "--by", "bob", "--reason", "no")
    assert (code, out) == (0, f"rejected {ids[1][1]} (by bob)\n")
    code, out, err = cli("approvals", "approve", ids[0][1], "--by", "alice")
    assert code == 2 and "already approved" in err
    code, out, _ = cli("status", ids[1][0])
    assert "FAILED" in out and "job.rejected" in out and f"by bob (cli:{OS_USER}): no" in out


def test_demo_with_the_real_llm_needs_a_key(cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    code, _, err = cli("demo", "--real-llm")
    assert code == 2 and "--real-llm needs ANTHROPIC_API_KEY" in err


def test_config_names_the_closest_known_type_for_a_typo(cli: Any, tmp_path: Path) -> None:
    typo = tmp_path / "typo.toml"
    typo.write_text("[job_types.http_requset]\n[job_types.webhok_dispatch]\n")
    code, _, err = cli("config", "validate", str(typo))
    assert code == 2
    assert err.splitlines() == [
        f"error: {typo}: job type 'http_requset' is neither registered nor built in; did you "
        "mean 'http_request'?",
        f"error: {typo}: job type 'webhok_dispatch' is neither registered nor built in; did you "
        "mean 'webhook_dispatch'?",
    ]
    code, out, err = cli("config", "show", "http_requset")
    assert (code, out) == (2, "")
    assert err == (
        "error: job type 'http_requset' is neither registered nor built in; did you mean "
        "'http_request'?\n"
    )
    bad_defaults = tmp_path / "defaults.toml"
    bad_defaults.write_text("[defaults]\napp_max_retries = -1\n[job_types.http_request]\n")
    code, _, err = cli("config", "validate", str(bad_defaults))
    assert code == 2 and err.count("\n") == 1 and f"{bad_defaults}: defaults: " in err


def test_empty_lists_say_so_on_stderr(cli: Any) -> None:
    assert cli("jobs") == (0, "", "no jobs\n")
    assert cli("jobs", "--status", "failed", "--type", "http_request") == (
        0, "", "no FAILED jobs of type http_request\n",
    )  # fmt: skip
    assert cli("dlq", "list") == (0, "", "no open dead letters\n")
    assert cli("dlq", "list", "--state", "requeued") == (0, "", "no requeued dead letters\n")
    assert cli("approvals", "list") == (0, "", "no pending approvals\n")
    assert cli("approvals", "list", "--status", "all") == (0, "", "no approvals\n")


def test_status_shows_when_a_scheduled_job_is_due(cli: Any) -> None:
    code, out, _ = cli(
        "submit", "http_request", "--payload", '{"url": "http://127.0.0.1:9/"}',
        "--run-at", "2099-01-01T00:00:00Z",
    )  # fmt: skip
    code, out, _ = cli("status", out.strip())
    assert code == 0 and "PENDING" in out
    assert "  scheduled for 2099-01-01T00:00:00+00:00 (in " in out


def test_status_and_jobs_show_the_job_key_and_its_revision(cli: Any) -> None:
    submit = ["submit", "http_request", "--payload", '{"url": "http://127.0.0.1:9/"}',
              "--job-key", "doc-42", "--run-at", "2099-01-01T00:00:00Z"]  # fmt: skip
    code, out, _ = cli(*submit)
    job_id = out.strip()
    assert code == 0
    code, out, _ = cli(*submit, "--job-key-mode", "replace")  # the same job, replaced
    assert (code, out.strip()) == (0, job_id)
    code, out, _ = cli("status", job_id)
    assert "  job key doc-42 (revision 1)" in out
    assert "job.replaced             job key doc-42 (replace): revision 1" in out
    code, out, _ = cli("jobs")
    assert code == 0 and f"{job_id}  http_request" in out and "key doc-42 rev 1" in out


def test_jobs_by_key_list_each_tenant_s_own_job(cli: Any) -> None:
    submit = ["submit", "http_request", "--payload", '{"url": "http://127.0.0.1:9/"}',
              "--job-key", "doc-42", "--run-at", "2099-01-01T00:00:00Z"]  # fmt: skip
    ids = {
        tenant: cli(*submit, *(["--tenant", tenant] if tenant else []))[1].strip()
        for tenant in ("acme", "globex", None)
    }
    assert len(set(ids.values())) == 3  # a key per tenant, and one with no tenant
    code, out, _ = cli("jobs", "--job-key", "doc-42", "--tenant", "acme")
    assert (code, [line.split()[0] for line in out.splitlines()]) == (0, [ids["acme"]])
    assert out.rstrip().endswith("tenant acme  key doc-42 rev 0")
    code, out, _ = cli("jobs", "--job-key", "doc-42")
    assert [line.split()[0] for line in out.splitlines()] == [ids[None], ids["globex"], ids["acme"]]
    assert cli("jobs", "--job-key", "doc-42", "--tenant", "initech") == (
        0, "", "no jobs with key doc-42 for tenant initech\n"
    )  # fmt: skip


async def test_status_shows_how_a_failed_job_degraded(
    cli: Any, make_orc: Callable[..., Orchestrator]
) -> None:
    hook = {"channel": "webhook", "url": "http://127.0.0.1:9/hooks/oncall"}
    orc = make_orc(retry_config=config_with(scripted.TABLE), escalation_target=hook)
    scripted.register(orc)
    tasks.register_all(orc)  # send_notification, which carries the escalation
    async with WorkerRun(orc) as run:
        job_id = await orc.submit("scripted", {"script": ["permanent"]})
        await run.until_finished(job_id)
    (degraded,) = [e for e in await orc.job_events(job_id) if e.kind == "job.degraded"]
    notice = degraded.payload["escalation_job_id"]
    code, out, _ = await asyncio.to_thread(cli, "status", str(job_id))  # a loop of its own
    assert code == 0 and "FAILED" in out
    assert (
        f"job.degraded             a person is notified (job {notice}): Job failed permanently "
        "(PERMANENT). Manual review required."
    ) in out


async def test_output_cut_short_by_its_reader_ends_quietly(
    dsn: str, make_orc: Callable[..., Orchestrator]
) -> None:
    """``orchestrator jobs | head -1``: the pipe closes while the command still writes."""
    orc = make_orc()
    tasks.register_all(orc)
    await orc.open()
    await orc.submit_many(
        [
            {"job_type": "http_request", "payload": {"url": f"http://127.0.0.1:9/{n}"}}
            for n in range(3000)
        ]
    )
    code, err = await asyncio.to_thread(read_one_line_then_close, dsn)
    assert (code, err) == (141, "")


def read_one_line_then_close(dsn: str) -> tuple[int, str]:
    env = {**os.environ, "DATABASE_URL": dsn}
    reader = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "jobs", "--limit", "3000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT,
    )  # fmt: skip
    assert reader.stdout is not None and reader.stderr is not None
    assert b"http_request" in reader.stdout.readline()  # 3,000 lines are ~300 kB: far more
    reader.stdout.close()  # than a pipe holds, so the command is still writing
    err = reader.stderr.read().decode()
    return reader.wait(timeout=60), err


def test_an_argument_that_is_not_utf8_is_one_line(dsn: str) -> None:
    env = {**os.environ, "DATABASE_URL": dsn}
    for argv in ([b"status", b"\xff"], [b"submit", b"http_request", b"--agent-id", b"a\xffb"]):
        done = subprocess.run(
            [sys.executable, "-m", "orchestrator", *argv],
            capture_output=True, env=env, cwd=ROOT, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 2 and done.stdout == b""
        assert done.stderr.decode().startswith("error: an argument is not UTF-8 text: b'")
        assert done.stderr.count(b"\n") == 1


def test_dev_orchestrator_finds_the_app_in_the_callers_directory(tmp_path: Path, dsn: str) -> None:
    """``./dev orchestrator --app mymodule:orc`` typed in the directory that holds mymodule.py."""
    (tmp_path / "mymodule.py").write_text(
        "from orchestrator import JobContext, Orchestrator\n\n"
        "orc = Orchestrator()\n\n\n"
        '@orc.job_type("greet")\n'
        "async def greet(ctx: JobContext, payload: dict) -> dict:\n"
        "    return payload\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "ORCHESTRATOR_RETRY_CONFIG"}
    done = subprocess.run(
        [str(ROOT / "dev"), "orchestrator", "--app", "mymodule:orc", "config", "show", "greet"],
        capture_output=True, text=True, env={**env, "DATABASE_URL": dsn}, cwd=tmp_path,
        timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["app_max_retries"] == 3  # [defaults], for the type it found


def test_tokens_are_created_once_listed_without_secrets_and_revoked(cli: Any, dsn: str) -> None:
    code, out, err = cli("tokens", "create", "ci", "--scope", "submit", "--scope", "read",
                         "--tenant", "acme")  # fmt: skip
    secret = out.strip()
    assert code == 0 and secret.startswith("orc_") and "only time it is shown" in err
    assert cli("tokens", "create", "ci", "--scope", "read")[0] == 2  # names are unique
    code, out, _ = cli("tokens", "list")
    assert code == 0 and "ci" in out and "read,submit" in out and "acme" in out
    assert secret.split("_", 2)[2] not in out  # never the secret (which may hold a "_")
    assert cli("tokens", "create", "x", "--scope", "root")[0] == 2
    assert cli("tokens", "revoke", "ci")[:2] == (0, "token 'ci' revoked\n")
    code, _, err = cli("tokens", "revoke", "ci")
    assert code == 2 and "no live token named 'ci'" in err
    assert "revoked" in cli("tokens", "list")[1]


def test_a_worker_token_limited_to_tenants_is_refused_at_creation(dsn: str) -> None:
    """The API would refuse it at every use (an external worker runs any tenant's job): the
    command that makes it says so instead, in one line, and stores nothing."""
    env = {**os.environ, "DATABASE_URL": dsn}

    def orchestrator(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "orchestrator", *argv],
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
        )  # fmt: skip

    for scopes in (["worker"], ["read", "worker"]):
        argv = [arg for scope in scopes for arg in ("--scope", scope)]
        refused = orchestrator("tokens", "create", "node", *argv, "--tenant", "acme")
        assert (refused.returncode, refused.stdout) == (2, ""), refused.stderr
        assert refused.stderr == (
            "error: token 'node': the worker scope cannot be limited to tenants (an external "
            "worker runs whichever job comes due, of any tenant); create it without --tenant\n"
        )
    assert "node" not in orchestrator("tokens", "list").stdout
    made = orchestrator("tokens", "create", "node", "--scope", "worker")
    assert made.returncode == 0 and made.stdout.startswith("orc_")


def test_serve_ends_with_0_on_sigterm(dsn: str) -> None:
    from tests.support.api_server import ApiServer

    with ApiServer(dsn) as server:
        assert server.stop() == 0


def test_stats_prints_the_rollups_as_lines_or_the_api_s_json(cli: Any, dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for tenant, completed in (("acme", 3), ("globex", 5)):
            conn.execute(
                "INSERT INTO orc_job_rollups SELECT 60, date_trunc('minute', now())"
                " - interval '5 minutes', 'digest', 'default', %s, %s, 1, 0, 1, 2, 1, %s,"
                " %s * 250, 400, 0, %s, 0, 0, 0, 0, 0, 0, 0, 0",
                (tenant, completed, completed + 1, completed + 1, completed + 1),
            )
    code, out, err = cli("stats", "--by", "tenant", "--tenant", "globex")
    assert code == 0 and err == "", err
    assert "tenant=globex" in out and "acme" not in out
    line = next(row for row in out.splitlines() if row.strip().endswith("400 ms"))
    assert line.split()[1:7] == ["5", "1", "0", "1", "2", "1"]
    code, out, err = cli("stats", "--json")
    assert code == 0
    [series] = json.loads(out)["jobs"]
    assert series["key"] == {} and series["points"][0]["completed"] == 8
    assert series["points"][0]["durations"]["count"] == 10
