"""Token accounting: what an LLM call spent, totals over a time range, and token budgets.

One row per LLM call that returned (``orc_llm_usage``, migration 0030), written by the attempt
that made it (``JobContext.record_llm_usage``). Totals group by any of :data:`GROUPS`; a budget
counts every kind of token: input, output, cache read and cache write.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from uuid import UUID

from pydantic import BaseModel, Field, computed_field

from orchestrator.domain.errors import InvalidArgument

#: What totals may be grouped by, and the column each names.
GROUPS: dict[str, str] = {
    "job": "job_id",
    "tenant": "tenant_id",
    "agent": "agent_id",
    "model": "model",
    "job_type": "job_type",
}
#: Token kinds, as the provider reports them (the columns' and the metrics' names).
KINDS = ("input", "output", "cache_read", "cache_creation")


class Tokens(BaseModel):
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_creation_tokens: int = 0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def total_tokens(self) -> int:
        """What a token budget counts: every kind."""
        return (
            self.input_tokens + self.output_tokens + self.cache_read_tokens
            + self.cache_creation_tokens
        )  # fmt: skip


class UsageTotal(Tokens):
    """Calls and tokens of one group; only the fields grouped by are set."""

    job_id: UUID | None = None
    tenant_id: str | None = None
    agent_id: str | None = None
    model: str | None = None
    job_type: str | None = None
    calls: int = 0


class LlmCall(Tokens):
    """One LLM call a job made, as the provider counted it."""

    call_id: str
    attempt: int
    model: str
    recorded_at: datetime


class JobUsage(BaseModel):
    """A job's LLM calls, their totals, and its own token budget (None: none); and, added up,
    those of the jobs below it in the tree its steps spawned (docs/workflows.md), failed ones
    included."""

    job_id: UUID
    token_budget: int | None = None
    total: Tokens = Field(default_factory=Tokens)
    calls: list[LlmCall] = Field(default_factory=list)
    descendants: int = 0
    descendant_calls: int = 0
    descendants_total: Tokens = Field(default_factory=Tokens)


def groups_of(by: str | Iterable[str]) -> tuple[str, ...]:
    """``"tenant,model"`` or ``["tenant", "model"]`` as the group names, checked."""
    names = [p.strip() for p in by.split(",")] if isinstance(by, str) else [*by]
    names = [n for n in names if n]
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        raise InvalidArgument(
            f"by: cannot group usage by {', '.join(map(repr, unknown))}; "
            f"group by any of {', '.join(GROUPS)}"
        )
    return tuple(dict.fromkeys(names))


def budget_spent(spent: int, budget: int) -> bool:
    """A budget is spent once its tokens are used up: the next call would go over it."""
    return spent >= budget
