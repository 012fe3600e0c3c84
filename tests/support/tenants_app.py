"""The applications ``orchestrator serve`` runs in tests/test_tenant_isolation.py: two tenants,
and what each must not learn of, or take from, the other and the fleet.

``orc``: the scripted job types, and in its retry config (CONFIG) a schedule of each tenant and
one of no tenant (named after their job types, never firing in a test: the first of January),
whose payloads name them, a limit weighting both tenants, and both tenants' token budgets.
``ticking``: the same, and ``every-second``, a schedule of tenant-a that ticks each second: an
attacker of tenant-a can predict its ticks' job keys.
"""

from __future__ import annotations

from typing import Any

from orchestrator import JobContext, Orchestrator
from tests.support import scripted
from tests.support.harness import config_with

MINE, THEIRS = "tenant-a", "tenant-b"
#: What each configured schedule's payload carries: none may reach another tenant's token.
MARKERS = {MINE: "report-of-tenant-a", THEIRS: "report-of-tenant-b", None: "report-of-no-tenant"}
#: The configured schedules' job types, by tenant.
REPORTS = {MINE: "report_a", THEIRS: "report_b", None: "report_fleet"}
#: tenant-a's schedule of ``ticking``.
TICKING = "every-second"

TABLE = f"""
[job_types.report_a]
schedule = {{ cron = "0 0 1 1 *", tenant_id = "{MINE}", payload = {{ marker = "{MARKERS[MINE]}" }} }}

[job_types.report_b]
schedule = {{ cron = "0 0 1 1 *", tenant_id = "{THEIRS}", payload = {{ marker = "{MARKERS[THEIRS]}" }} }}

[job_types.report_fleet]
schedule = {{ cron = "0 0 1 1 *", payload = {{ marker = "{MARKERS[None]}" }} }}

[limits.shared]
key = "shared:{{job_type}}"
concurrency = 10
weights = {{ "{MINE}" = 2, "{THEIRS}" = 3 }}

[token_budgets."{MINE}"]
tokens = 100000000
[token_budgets."{THEIRS}"]
tokens = 100000000
"""
CONFIG = config_with(scripted.TABLE, TABLE)


def register(made: Orchestrator) -> None:
    """The job types CONFIG names."""
    scripted.register(made)
    for name in REPORTS.values():

        @made.job_type(name)
        async def report(ctx: JobContext, payload: Any) -> None:
            return None


def build() -> Orchestrator:
    made = Orchestrator(retry_config_path=CONFIG)
    register(made)
    return made


orc = build()
ticking = build()
ticking.schedule(
    TICKING, "scripted", cron="* * * * * *", payload={"script": ["ok"]}, tenant_id=MINE
)
