"""Token budgets per tenant, from the retry config's ``[token_budgets."<tenant>"]`` tables.

    [token_budgets."acme"]
    tokens = 1_000_000     # input + output + cache read + cache write tokens
    period = "day"         # "hour" or "day": calendar periods in UTC

Checked before each LLM call of the tenant's jobs (docs/configuration.md, "Token accounting
and budgets"); a reload applies a change to the next call.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from retry_config.models import MAX_VALUE
from retry_config.names import tenant_refusal

#: Seconds in each period a budget may have.
PERIODS: dict[str, int] = {"hour": 3_600, "day": 86_400}


class TokenBudget(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: int = Field(gt=0, le=MAX_VALUE, description="Tokens the tenant may spend per period.")
    period: Literal["hour", "day"] = Field(
        "day", description="The calendar period (UTC) the budget is for: hour or day."
    )


def parse_budgets(raw: Any, path: Path, problems: list[str]) -> dict[str, TokenBudget]:
    """The ``token_budgets`` table's budgets by tenant; its problems added to ``problems``."""
    if not isinstance(raw, Mapping):
        problems.append(f"{path}: [token_budgets] must be a table of tenants")
        return {}
    budgets: dict[str, TokenBudget] = {}
    for tenant, entry in raw.items():
        refused = tenant_refusal(tenant)
        if refused is not None:
            problems.append(f"{path}: token_budgets: {refused}")
            continue
        try:
            budgets[tenant] = TokenBudget.model_validate(entry)
        except ValidationError as exc:
            for err in exc.errors(include_url=False):
                loc = ".".join(str(p) for p in err["loc"]) or "(entry)"
                problems.append(
                    f"{path}: token_budgets for tenant {tenant!r}: field {loc!r}: {err['msg']}"
                )
    return budgets
