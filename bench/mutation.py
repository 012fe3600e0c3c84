"""Mutation testing of the code that guards the rest (docs/testing.md): cosmic-ray changes one
thing at a time in a module (a comparison, a condition, a constant, an exception) and runs the
tests that exercise it; a mutant no test notices ("survived") is an untested behaviour.

    ./dev mutation [TARGET ...]      (default: every target below, one after the other)

cosmic-ray mutates files in place, in a scratch copy of this working tree (never the tree
itself, so an interrupted run leaves nothing behind): the ``orchestrator serve`` processes the
API tests start import the mutant from that copy too. Each target runs only its own tests,
``-x``, under ``nice -n 19``, with a timeout per mutant. Set DATABASE_URL to a PostgreSQL
server for speed (without it each run starts the embedded one in the copy).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Target:
    module: str
    tests: tuple[str, ...]
    #: seconds a mutant may run before it counts as killed by timeout
    timeout: float
    #: only the mutants in these functions (all, when empty)
    functions: tuple[str, ...] = ()


EXTERNAL_TESTS = (  # the quickest first: -x stops at the first failure
    "tests/test_external_contract.py",
    "tests/test_external_workers.py::test_a_stale_report_is_refused_and_changes_nothing",
    "tests/test_external_workers.py::test_every_report_without_the_lease_gets_the_same_409",
    "tests/test_api.py::test_the_replay_endpoints_reproduce_rp_001_to_rp_004",
)
TARGETS = {
    "auth": Target(
        "orchestrator/interfaces/api/auth.py",
        (
            "tests/test_api.py::test_a_request_without_a_live_token_is_refused",
            "tests/test_api.py::test_each_endpoint_needs_its_scope",
            "tests/test_token_cache.py",
        ),
        timeout=120,
    ),
    "workers": Target(
        "orchestrator/interfaces/api/workers.py",
        (
            *EXTERNAL_TESTS,
            "tests/test_external_workers.py::test_in_process_workers_never_take_an_external_job",
            "tests/test_api.py::test_the_replay_endpoints_are_off_by_default",
            "tests/test_api.py::test_the_openapi_document_is_served_and_checked_in",
        ),
        timeout=180,
    ),
    "external": Target(
        "orchestrator/runtime/external.py",
        EXTERNAL_TESTS,
        timeout=180,
    ),
    # the tenant checks; tests/test_authorization.py: every operation x credentials
    "jobs": Target(
        "orchestrator/interfaces/api/jobs.py",
        (
            "tests/test_authorization.py",
            "tests/test_api.py",
            "tests/test_tenants.py",
            "tests/test_api_errors.py::test_a_wait_is_capped_at_the_configured_maximum",
            "tests/test_api_errors.py::test_an_idle_stream_sends_a_ping_at_the_configured_interval",
        ),
        timeout=300,
    ),
    "operations": Target(
        "orchestrator/interfaces/api/operations.py",
        ("tests/test_authorization.py", "tests/test_api.py"),
        timeout=300,
    ),
    # the users' schedules: the due-tick rule, the crontab reader, the scheduler's firing
    "schedules": Target(
        "orchestrator/domain/schedules.py", ("tests/test_schedule_ticks.py",), timeout=120
    ),
    "crontab": Target(
        "orchestrator/domain/crontab.py", ("tests/test_schedule_ticks.py",), timeout=120
    ),
    "scheduler": Target(
        "orchestrator/services/scheduler.py",
        (
            "tests/test_schedules.py::test_after_downtime_only_the_ticks_within_the_backfill_window_run",
            "tests/test_schedules.py::test_schedulers_racing_for_the_same_ticks_fire_each_once",
            "tests/test_schedules.py::test_a_pause_that_commits_between_the_read_and_the_firing_wins",
            "tests/test_schedules.py::test_a_long_backfill_is_fired_a_thousand_ticks_at_a_time_without_waiting",
            "tests/test_schedules.py::test_a_scheduler_without_schedules_returns_at_once",
            "tests/test_schedules.py::test_the_listing_shows_the_next_and_last_run_and_a_pause_holds_the_ticks",
            "tests/test_schedules.py::test_a_scheduler_rides_through_a_lost_connection",
            "tests/test_schedules.py::test_a_check_that_fails_is_logged_and_tried_again",
        ),
        timeout=180,
    ),
    "ui-session": Target(
        "orchestrator/interfaces/ui/pages.py",
        (
            "tests/test_ui_session.py",
            "tests/test_ui.py::test_every_dashboard_form_without_its_csrf_field_is_refused_with_401",
            "tests/test_ui.py::test_sign_in_needs_a_live_token_and_sets_a_strict_http_only_cookie",
            "tests/test_ui.py::test_another_site_can_neither_frame_the_dashboard_nor_sign_a_browser_in",
            "tests/test_ui.py::test_a_tenant_s_token_never_sees_another_tenant_s_jobs",
        ),
        timeout=240,
        functions=(
            "sign_in_first",
            "viewer",
            "from_this_page",
            "_bytes",
            "_same_origin",
            "signed",
            "acting",
            "signing_in",
            "login_form",
            "login",
            "logout",
            "_local",
        ),
    ),
}

#: Operators left out: arithmetic and unary swaps (dozens per expression, rarely a guard),
#: comparison swaps other than a negation or an off-by-one (``==`` to ``<`` says nothing a
#: ``!=`` does not), variable swaps, and a route's decorator (its removal is a 404 every test
#: of the route sees).
EXCLUDED = [
    "core/ReplaceBinaryOperator_(?!(Add_Sub|Sub_Add)$).*",
    "core/ReplaceUnaryOperator_.*",
    "core/ReplaceComparisonOperator_(?!(Eq_NotEq|NotEq_Eq|Lt_GtE|Lt_LtE|Gt_LtE|Gt_GtE|LtE_Gt"
    "|LtE_Lt|GtE_Lt|GtE_Gt|Is_IsNot|IsNot_Is|In_NotIn|NotIn_In)$).*",
    "core/VariableReplacer",
    "core/VariableInserter",
    "core/RemoveDecorator",
]


def config(target: Target, work: Path) -> str:
    present = [test for test in target.tests if (work / test.split("::")[0]).exists()]
    for test in sorted(set(target.tests) - set(present)):
        print(f"warning: {test} is not in this tree: left out", file=sys.stderr)
    tests = " ".join(present)
    command = f"{BIN / 'python'} -m pytest -x -q -p no:cacheprovider {tests}"
    excluded = ", ".join(json.dumps(pattern) for pattern in EXCLUDED)
    return (
        f'[cosmic-ray]\nmodule-path = "{target.module}"\ntimeout = {target.timeout}\n'
        f"excluded-modules = []\ntest-command = {json.dumps(command)}\n\n"
        '[cosmic-ray.distributor]\nname = "local"\n\n'
        f"[cosmic-ray.filters.operators-filter]\nexclude-operators = [{excluded}]\n"
    )


def scratch_copy(into: Path) -> None:
    """The working tree as it is (uncommitted changes too), without ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)


def outside(session: Path, functions: tuple[str, ...]) -> None:
    """Leave out (as a filter does) the mutants outside these functions."""
    marks = ", ".join("?" * len(functions))
    with sqlite3.connect(session) as results:
        results.execute(
            "INSERT INTO work_results (worker_outcome, output, job_id) SELECT 'SKIPPED', "
            f"'outside the target functions', job_id FROM mutation_specs WHERE job_id NOT IN "
            f"(SELECT job_id FROM work_results) AND coalesce(definition_name, '') NOT IN ({marks})",
            functions,
        )


def run(name: str, target: Target, work: Path, *, again: bool) -> dict[str, object]:
    """Every mutant of the target against its tests; ``again``: only the survivors of the
    previous run in ``work``, against the tests as they are now (a test added kills mutants,
    it does not revive one)."""
    (work / "mutation.toml").write_text(config(target, work))
    session = f"mutation-{name}.sqlite"

    def cosmic(*args: str) -> None:
        subprocess.run(["nice", "-n", "19", *args], cwd=work, check=True)

    if again:
        with sqlite3.connect(work / session) as results:
            results.execute("DELETE FROM work_results WHERE test_outcome = 'SURVIVED'")
    else:
        (work / session).unlink(missing_ok=True)
        cosmic(str(BIN / "cosmic-ray"), "init", "mutation.toml", session)
        cosmic(str(BIN / "cr-filter-operators"), session, "mutation.toml")
        cosmic(str(BIN / "cr-filter-pragma"), session)
        if target.functions:
            outside(work / session, target.functions)
    cosmic(str(BIN / "cosmic-ray"), "exec", "mutation.toml", session)
    dumped = subprocess.run(
        [BIN / "cosmic-ray", "dump", session], cwd=work, check=True, capture_output=True
    ).stdout.decode()
    counts: Counter[str] = Counter()
    survivors = []
    for line in dumped.splitlines():
        item, result = json.loads(line)
        if result is None or result["worker_outcome"] == "skipped":  # left out by a filter
            continue
        outcome = result["test_outcome"]
        counts[outcome] += 1
        if outcome == "survived":
            [mutation] = item["mutations"]
            survivors.append(
                f"{target.module}:{mutation['start_pos'][0]} {mutation['operator_name']} "
                f"#{mutation['occurrence']}\n{result['diff']}"
            )
    tried = sum(counts.values())
    killed = tried - counts["survived"]
    return {
        "target": name, "module": target.module, "mutants": tried, "killed": killed,
        "survived": counts["survived"], "score": round(100 * killed / tried, 1) if tried else None,
        "survivors": survivors,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="*", metavar="TARGET", help=", ".join(TARGETS))
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy (its path)")
    parser.add_argument(
        "--again", type=Path, metavar="COPY",
        help="a scratch copy kept by --keep: run its survivors again against tests/ as it is "
        "now (after adding tests; source changes need a full run)",
    )  # fmt: skip
    arguments = parser.parse_args()
    unknown = set(arguments.targets) - set(TARGETS)
    if unknown:
        parser.error(f"unknown target(s) {sorted(unknown)}: choose from {', '.join(TARGETS)}")
    names = arguments.targets or list(TARGETS)
    work = arguments.again or Path(tempfile.mkdtemp(prefix="mutation-"))
    try:
        scratch_copy(work)  # again: the tests as they are now (and no mutant left behind)
        for name in names:  # one copy: later edits of the tree do not reach this run
            report = run(name, TARGETS[name], work, again=arguments.again is not None)
            survivors = report.pop("survivors")
            print(json.dumps(report), flush=True)
            for survivor in survivors:  # type: ignore[attr-defined]
                print(survivor, flush=True)
    finally:
        if arguments.keep or arguments.again:
            print(f"scratch copy: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
