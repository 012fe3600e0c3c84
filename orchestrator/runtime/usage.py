"""Token accounting for one attempt: its LLM calls' usage recorded as they return, and the
token budgets checked before each call (docs/configuration.md, "Token accounting and budgets").

The usage of a call is written at once, in a statement of its own, tried again through a
database outage (``until_written``) under one call id, so it is written once, and stays
whatever the attempt does next: the tokens were spent. With flow control
(docs/flow-control.md), the call's tokens (input, cache writes and output; cache reads are not
counted against a rate, as providers do not) then reconcile its job's reservation in its key's
window, and, for a limit that learns, the headers of each reply keep the key in step with its
provider's limits (orchestrator.domain.flow_learned). The budget check reads the job's own
budget and spend, and its tenant's spend in the current period (the tenant's budget is read
from the retry config in effect at each check: a reload applies to the next call).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from orchestrator.domain.errors import TokenBudgetExhausted
from orchestrator.domain.flow_learned import learned
from orchestrator.domain.flow_window import Admit, parked
from orchestrator.domain.models import Claim
from orchestrator.domain.usage import budget_spent
from orchestrator.runtime.loops import until_written
from orchestrator.runtime.metrics import Metrics
from orchestrator.storage.flow import FlowStore
from orchestrator.storage.usage import CallUsage, UsageStore
from retry_config.budgets import TokenBudget

BudgetOf = Callable[[str], TokenBudget | None]


@dataclass
class Accounting:
    claim: Claim
    store: UsageStore
    metrics: Metrics
    tenant_budget: BudgetOf  # the tenant's budget in the retry config in effect now
    #: Flow control: each call is admitted in its job's key's window before it is sent, and its
    #: usage reconciles its reservation there.
    flow: FlowStore | None = None
    #: The job's limit counts requests or units per interval, or learns them (as the attempt's
    #: config says).
    windowed: bool = False
    #: The job's limit learns its key's limits from the provider's replies.
    learns: bool = False
    _calls: int = field(default=0, init=False)  # calls admitted by this attempt
    _keys: dict[str, str] = field(default_factory=dict, init=False)  # a model's, once admitted

    async def admit(self, units: int, model: str | None = None) -> None:
        """Admit the job's next call, to ``model`` (None: the one its key is for), estimated at
        ``units``, before it is sent, in the window of that model's key (a fallback model's
        call: that model's): at once if it fits; if its room comes soon, admitted for then (its
        room reserved) and sent once it has waited for it in place, unless the key was paused
        meanwhile; else raise CallParked (the attempt ends, its job waits in its own key's line,
        sent for when a fallback model's room comes if that is known). The attempt's first call
        takes the claim's reservation. Nothing for a job whose limit has no window."""
        key = self.claim.flow_key
        if self.flow is None or key is None or not self.windowed:
            return
        if units < 0:
            raise ValueError(f"a call's estimate cannot be negative: {units}")
        admitted = await self.flow.admit_call(
            self.claim.id, model, units=units, first=self._calls == 0
        )
        verdict = admitted.verdict
        if not isinstance(verdict, Admit):
            raise parked(
                key, admitted.key, verdict.blocked, units, release=verdict.reserved, at=verdict.at
            )
        if verdict.after > 0:
            started = time.monotonic()
            await asyncio.sleep(verdict.after)  # (from after its spend was placed: it is due)
            self.metrics.call_waited(self.claim.job_type, time.monotonic() - started)
            paused_for = await self.flow.go(admitted)
            if paused_for is not None:  # its spend left the window: nothing to release
                raise parked(key, admitted.key, "paused", units, release=False, at=paused_for)
        self._calls += 1
        if model is not None and admitted.key is not None:
            self._keys[model] = admitted.key  # its usage reconciles there

    async def record(
        self, model: str, *, input_tokens: int, output_tokens: int, cache_read_tokens: int,
        cache_creation_tokens: int, call_id: str | None, sent_at: float | None = None,
    ) -> None:  # fmt: skip
        claim = self.claim
        usage = call_usage(
            claim, model, input_tokens=input_tokens, output_tokens=output_tokens,
            cache_read_tokens=cache_read_tokens, cache_creation_tokens=cache_creation_tokens,
            call_id=call_id,
        )  # fmt: skip
        self.metrics.llm_call(model, outcome="ok", tokens=tokens_of(usage))
        await until_written(f"job {claim.id}'s LLM usage", lambda: self.store.record(usage))
        if self.flow is not None and claim.flow_key is not None:
            flow, key = self.flow, self._keys.get(model, claim.flow_key)

            def write() -> Awaitable[None]:
                ago = None if sent_at is None else time.monotonic() - sent_at
                return flow.spend(
                    key, claim.id, units=spent(usage), call_id=usage.call_id,
                    sent_seconds_ago=ago,
                )  # fmt: skip

            await until_written(f"job {claim.id}'s spend on {key}", write)

    async def learn(self, headers: Mapping[str, str], model: str | None = None) -> None:
        """A reply's ``headers``: for a job whose limit learns, what their rate-limit headers
        say of the provider's limits is kept in its key's row (the key its call to ``model``
        was admitted on: a fallback model's own), for the whole fleet (written through a
        database outage). Nothing for a reply without them, or another job."""
        key = self.claim.flow_key if model is None else self._keys.get(model, self.claim.flow_key)
        if self.flow is None or key is None or not self.learns:
            return
        reply = learned(headers, now=datetime.now(UTC))  # a time in them: from their Date
        if reply is None:
            return
        flow = self.flow
        await until_written(f"{key}'s provider limits", lambda: flow.learn(key, reply))

    async def key_passable_for(self) -> float | None:
        """Seconds the job's flow key stays paused when its type may pass the pause on a
        fallback model, as the database decides (None: it may not, or no key)."""
        if self.flow is None or self.claim.flow_key is None:
            return None
        return await self.flow.passable_for(self.claim.id)

    async def check(self) -> None:
        claim = self.claim
        tenant = claim.tenant_id
        budget = self.tenant_budget(tenant) if tenant is not None else None
        state = await self.store.budget_state(
            claim.id, tenant, budget.period if budget is not None else None
        )
        if state.job_budget is not None and budget_spent(state.job_spent, state.job_budget):
            raise TokenBudgetExhausted(
                f"the job's token budget is spent: {state.job_spent} of {state.job_budget}"
                " tokens used"
            )
        if (
            budget is not None
            and state.tenant_spent is not None
            and budget_spent(state.tenant_spent, budget.tokens)
        ):
            raise TokenBudgetExhausted(
                f"tenant {tenant!r}'s token budget for this {budget.period} (from"
                f" {state.period_start.isoformat()}) is spent: {state.tenant_spent} of"
                f" {budget.tokens} tokens used"
            )


def call_usage(
    claim: Claim, model: str, *, input_tokens: int, output_tokens: int, cache_read_tokens: int,
    cache_creation_tokens: int, call_id: str | None,
) -> CallUsage:  # fmt: skip
    """The usage row of one call the attempt of ``claim`` made (the call id made up when the
    provider gave none); ValueError for a negative count."""
    counts = (input_tokens, output_tokens, cache_read_tokens, cache_creation_tokens)
    if any(n < 0 for n in counts):
        raise ValueError(
            f"token counts cannot be negative: (input, output, cache read, cache creation) {counts}"
        )
    return CallUsage(  # the columns hold 200 characters: a longer name is cut, not lost
        job_id=claim.id, call_id=(call_id or f"call-{uuid.uuid4()}")[:200],
        attempt=claim.attempt, tenant_id=claim.tenant_id, agent_id=claim.agent_id,
        job_type=claim.job_type, model=model[:200], input_tokens=input_tokens,
        output_tokens=output_tokens, cache_read_tokens=cache_read_tokens,
        cache_creation_tokens=cache_creation_tokens,
    )  # fmt: skip


def tokens_of(usage: CallUsage) -> dict[str, int]:
    """Its tokens by kind, as the metrics name them."""
    return {
        "input": usage.input_tokens, "output": usage.output_tokens,
        "cache_read": usage.cache_read_tokens, "cache_creation": usage.cache_creation_tokens,
    }  # fmt: skip


def spent(usage: CallUsage) -> int:
    """What the call spent in its flow key's window: input, cache writes and output (cache
    reads are not counted against a rate, as providers do not)."""
    return usage.input_tokens + usage.cache_creation_tokens + usage.output_tokens
