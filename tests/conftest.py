"""Test harness: a real PostgreSQL for every test that touches storage.

With ``DATABASE_URL`` set, that server is used; otherwise the embedded one (``.orchestrator/``).
Each session creates its own database there, migrates it once, and drops it at the end; each
test starts from empty tables. Helpers live in ``tests/support/`` (harness.py: settings, waits,
a worker in the test's loop; scripted, agent_app, job_types_app: job types; workers.py: worker
processes; node_worker: the Node.js external worker; external, http_peers, slow_peers: real
peers on 127.0.0.1; previous_release: the release before, run for upgrade tests; tools: the
operators' tools, which fail a test under CI=true when missing instead of skipping it).

A background error fails its test (tests/support/log_guard.py): an ERROR, or any record with a
traceback, logged during a test by this process or by a worker or server started through
tests/support/workers.py or api_server.py, fails it at teardown. A test that provokes errors on
purpose lists them, as regular expressions searched in each error's text (log line and
traceback), on the test, its class or its module:

    @pytest.mark.logs_errors("Exception in ASGI application", "ConnectionRefusedError")
    pytestmark = pytest.mark.logs_errors(...)  # the whole module
    @log_guard.fails_jobs("HTTP_400")  # jobs failed on purpose, no escalation target
    @log_guard.crashes  # attempts crashed by SimulatedCrash

Keep a pattern as narrow as the error the test provokes (docs/testing.md).

No process a test starts outlives the run (tests/support/leftovers.py): those still alive when
it ends are killed, and the run fails naming them.

Where each part of the code is tested:

    orchestrator/domain       states: test_states, test_transitions_db; policy and backoff:
                              test_policy, test_backoff; max_attempts in stored events and by
                              a worker process: test_max_attempts; classification:
                              test_classification;
                              events and failures: test_events, test_failures, test_runtime;
                              each event kind's one writer: test_event_writers;
                              degradation: test_degradation; principals (names, persons,
                              the two-person rule across the upgrade): test_principals;
                              schedules' ticks, crontab files: test_schedule_ticks
    orchestrator/storage      submit and job keys: test_submit; tenants, end to end:
                              test_tenants; migrations: test_migrate; Graphile Worker's
                              API for producers: test_graphile_compat; a rolling
                              deploy beside the previous release: test_rollout;
                              connections: test_pool; every store operation: test_transitions_db;
                              the embedded server's life (and a new one said): test_embedded; lock order and
                              conflicts: test_lock_order; the fetch's rules: test_fetch;
                              every hot statement's plan on a planted history (no
                              sequential scan of a job-sized table): test_plans; the named
                              queries beside their stores: test_queries; where the SQL lives
                              (function files, schema.sql, an upgrade's catalog):
                              test_sql_layout; several applications on one database
                              (declarations, refusals, withdrawals, unserved jobs):
                              test_applications, and with real processes of two
                              applications: test_applications_fleet
    checkpoints               test_checkpoints, test_crash, test_chaos (slow)
    orchestrator/runtime      the worker loop: test_worker_loop, test_batched_writes,
                              test_worker_wakeup; attempts and outcomes: test_runtime,
                              test_timeouts; liveness and drain: test_liveness; group commit:
                              test_group_commit; a database outage: test_outage; start-up
                              while the database is away, connect failures: test_startup;
                              metrics: test_metrics; the lease contract by its effects
                              (heartbeats read back, a job kept past the zombie threshold,
                              in process and external): test_lease_contract; retry config
                              reloads (worker and serve processes), config diff:
                              test_config_reload
    workflows                 jobs that depend on jobs (docs/workflows.md): a graph in one
                              batch on a worker process, two parents ending at once, each
                              failure policy, a parent ending during its child's submit,
                              refused parents: test_dependencies; another tenant's parents
                              over the API: test_tenant_isolation
    flow control              limits per key enforced at the claim, pauses, fairness, worker
                              processes against the local LLM server's rate limit:
                              test_flow_control; a key from its limit's template (the
                              database's rule against its model, refused submits, a job
                              without its key at its claim): test_flow_keys; worker
                              processes' fetches across many keys
                              (no deadlock), limits changed in the file, pauses changed, the
                              backstop: test_flow_fleet; flow key locks in one order
                              (completion batches and the sweep across keys, worker
                              processes: no deadlock): test_flow_locks; every call
                              admitted (a fleet of agents held to the window, a parked
                              agent resuming at its call, worker processes): test_flow_calls; the call's admission as a pure
                              rule (property tests), equal to the claim's SQL: test_flow_window;
                              the call's admission in one statement (SQL) held to its Python
                              model on the same sequences (property tests):
                              test_flow_admission_model;
                              limits learned from the provider's headers (pure rules, equal to
                              the gate's SQL; worker processes against the local server's
                              Anthropic and OpenAI headers; a pause's end handing the key's
                              room to its line with nothing running): test_flow_learned;
                              pauses and retries on the database's clock, a provider's times
                              read against its reply's Date (worker processes an hour fast and
                              an hour slow, under libfaketime): test_flow_clock; fairness on
                              real spend, tenant_share and priority within a share (worker
                              processes): test_flow_fairness, as a pure policy (property
                              tests): test_flow_share; the fallback pass-through:
                              test_flow_fallback; an external worker's calls admitted and
                              recorded over the API (the Node.js worker, stale leases, other
                              tenants' tokens, a call id asked again counted once):
                              test_flow_external
    live output               a job's output (docs/output.md): chunks in order at their
                              offsets, a stale attempt's write refused, the superseded
                              marker and the final read, a committed step not repeated, the
                              size cap, worker processes against the local LLM server, the
                              API's read and stream (tenants, offsets, Last-Event-ID):
                              test_output; the Python client's output() (both flavours, its
                              server killed mid-stream, a revoked token): test_output_client;
                              `orchestrator tail` (a real process beside a worker process:
                              attempt by attempt, --offset, --final, mistakes): test_output_tail
    schedules                 firing once per tick (three worker processes), backfill, pause,
                              listings, tenants, refusals: test_schedules
    orchestrator/services     sweep: test_liveness, test_timeouts; safety net, dead letters:
                              test_runtime; approvals and checkpoint retention:
                              test_approvals; retention of finished jobs, the archive and
                              `prune`: test_retention; a bad row in a batch: test_passed_over;
                              the maintenance lane: test_worker_loop; rollups and the stats
                              read (API, tenants): test_rollups
    orchestrator/interfaces   test_cli, test_first_hour; the lists (cut, filters, header
                              rows) through the real command: test_cli_lists; the HTTP API: test_api,
                              test_api_schema (Schemathesis), every error code and limit
                              answered for a real reason: test_api_errors; test_external_workers
                              (a Node.js worker); what the external workers' endpoints write:
                              test_external_contract; the token cache's window, for
                              streams and long-polls too: test_token_cache; who sees a lease token: test_lease_token; the
                              dashboard: test_ui (a real Chromium), a job's page (its summary,
                              approvals, steps, transcript, live output): test_ui_job_page, every page's
                              layout at 390 and 1280 px: test_ui_layout, test_ui_views, its
                              session and CSRF rules over HTTP: test_ui_session; `serve`
                              through a database outage (503 within a probe's 2 s, the
                              outage page, the live pages' notice, a job's output
                              resumed, its log and access lines): test_ui_outage; the overview's banners and "Now" chart:
                              test_ui_overview; the fleet summary (API, CLI, tenants):
                              test_fleet_summary; the string
                              rule, everywhere: test_strings; who may call what (every
                              operation and page x every credential): test_authorization;
                              one tenant's token against another tenant and the fleet
                              (the reserved queues, a schedule's tick keys, the config
                              read, blank tenants on every path, the overview's zombies,
                              a job page's 404): test_tenant_isolation
                              dead-letter review at scale (filters, bulk actions, tenants, the
                              two-person rule; API and CLI): test_dead_letter_review; its
                              page in Chromium: test_ui_dead_letters
    logs and traces           test_logs, test_tracing
    tasks, demo               test_job_types, test_llm_server, test_demo
    token accounting          usage recorded per call, totals, budgets, the API's tenant
                              filter, the CLI, the exporter: test_usage
    retry_config              test_retry_config
    k8s/, docs/, the layout   test_k8s, test_docs, test_architecture; alert rules and
                              dashboard: test_monitoring; autoscaling: test_autoscaling
    tests/support             the background-error guard: test_log_guard; no process outliving
                              the run: test_leftovers
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import hypothesis
import psycopg
import pytest

from orchestrator import Orchestrator
from orchestrator.storage.database import (
    drop_database,
    ensure_database,
    start_embedded,
    with_database,
)
from orchestrator.storage.migrate import migrate
from tests.support.harness import clear_tables, settings_for_tests

pytest_plugins = ["tests.support.log_guard", "tests.support.leftovers"]

# Hypothesis, as every test here: no duration asserted (its per-example deadline, 200 ms, and its
# health check of slow data generation both fail on a loaded machine, not on a wrong answer).
hypothesis.settings.register_profile(
    "suite", deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow]
)
hypothesis.settings.load_profile("suite")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def server_dsn() -> str:
    return os.environ.get("DATABASE_URL") or start_embedded(ROOT / ".orchestrator")


@pytest.fixture(scope="session")
def dsn(server_dsn: str) -> Iterator[str]:
    name = f"orc_test_{uuid.uuid4().hex[:10]}"
    ensure_database(server_dsn, name)
    test_dsn = with_database(server_dsn, name)

    async def apply() -> None:
        async with await psycopg.AsyncConnection.connect(test_dsn, autocommit=True) as conn:
            await migrate(conn)

    asyncio.run(apply())
    yield test_dsn
    drop_database(server_dsn, name)


@pytest.fixture
async def db(dsn: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """A raw autocommit connection to the test database, on empty tables."""
    await asyncio.to_thread(clear_tables, dsn)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture(scope="module", autouse=True)
def _each_module_starts_on_empty_tables(dsn: str) -> None:
    """Whatever test ran before this module in this process (in three processes, any of them),
    the module's servers and workers start on empty tables (before its own module fixtures:
    autouse ones come first in their scope)."""
    clear_tables(dsn)


@pytest.fixture
def empty_dsn(dsn: str) -> str:
    """The test database, on empty tables, for a test that hands it to processes."""
    clear_tables(dsn)
    return dsn


@pytest.fixture
async def make_orc(
    dsn: str, db: psycopg.AsyncConnection[Any]
) -> AsyncIterator[Callable[..., Orchestrator]]:
    """Build Orchestrators on the test database (``tracer_provider``: with tracing); they are
    closed after the test."""
    made: list[Orchestrator] = []

    def make(tracer_provider: Any = None, **settings: Any) -> Orchestrator:
        orc = Orchestrator(
            settings=settings_for_tests(**settings), dsn=dsn, tracer_provider=tracer_provider
        )
        made.append(orc)
        return orc

    yield make
    for orc in made:
        await orc.close()
