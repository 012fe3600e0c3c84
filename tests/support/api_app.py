"""The application ``orchestrator serve`` runs in the API tests: the scripted job types
(tests/support/scripted.py), the agent job (approvals, steps), and ``external_echo``, an
external job type that the Node.js worker (tests/support/external_worker.js) runs over the API,
with ``external_agent`` and ``external_quick``, external types whose LLM calls are admitted in
their flow keys' windows.
Settings come from the environment; its retry config is CONFIG. Each of the authorization
table's tenants has a schedule (SCHEDULES) that fires only on the first of January."""

from __future__ import annotations

from orchestrator import Orchestrator
from tests.support import agent_app, scripted
from tests.support.harness import config_with

#: external_echo: four application retries in all would dead-letter at the fourth failure.
TABLE = """
[job_types.external_echo]
external = true
app_max_retries = 3
worker_max_attempts = 1
job_timeout_seconds = 60
output_max_bytes = 200   # its live output's cap (tests/test_external_contract.py)

# External types under flow control, whose workers admit each LLM call over the API
# (tests/test_flow_external.py): two calls an hour; one call each 1.5 s.
[limits.external_hourly]
key = "external-hourly:{payload.model}"
requests = 2
interval_seconds = 3600

[limits.external_quick]
key = "external-quick:{payload.model}"
requests = 1
interval_seconds = 1.5

[job_types.external_agent]
external = true
limit = "external_hourly"
app_max_retries = 3
worker_max_attempts = 1
job_timeout_seconds = 60

[job_types.external_quick]
external = true
limit = "external_quick"
app_max_retries = 3
worker_max_attempts = 1
job_timeout_seconds = 60

# Token budgets of the tenants the API tests use, never reached: a token limited to one tenant
# must not see another's (GET /api/v1/config, the dashboard's usage page).
[token_budgets."tenant-a"]
tokens = 100000000
[token_budgets."tenant-b"]
tokens = 100000000
[token_budgets."acme"]
tokens = 100000000
[token_budgets."globex"]
tokens = 100000000
"""
CONFIG = config_with(scripted.TABLE, agent_app.TABLE, TABLE)
orc = Orchestrator(retry_config_path=CONFIG)
scripted.register(orc)
agent_app.register(orc)

#: tenant -> its schedule's name (tests/test_authorization.py acts on them).
SCHEDULES = {tenant: f"nightly-{tenant}" for tenant in ("tenant-a", "tenant-b")}
for tenant, name in SCHEDULES.items():
    orc.schedule(name, "scripted", cron="0 0 1 1 *", payload={"script": ["ok"]}, tenant_id=tenant)
