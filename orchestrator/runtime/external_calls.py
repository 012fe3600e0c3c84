"""An external worker's LLM calls (docs/api.md, "An external worker's LLM calls"): each admitted
in its job's flow key's window before it is sent, and its usage recorded once it returns, as an
in-process task's are (``ctx.admit_call``, ``ctx.record_llm_usage``; docs/flow-control.md,
"Every call admitted"), by the same statement (orc_flow_admit_call_v1) and the same writers
(FlowStore, UsageStore).

Only the attempt's own bookkeeping moves: its calls come one request at a time, to any API
server, so the database keeps whether its first call was admitted (that call takes the claim's
reservation), and each call admitted under its call id (asked again, it is answered as it
was). A call whose room comes soon (orc_flow_wait_in_place_v1) is admitted for that instant,
its room reserved, and the request waits for it in place, then answers "go" unless the key was
paused meanwhile; one whose room is further off parks the job there and then, as
``ctx.admit_call`` does, and the worker stops.

Every report is taken only from the attempt that holds the job's lease, as a heartbeat or a
completion is: any other is StaleLease, and nothing is recorded.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from uuid import UUID

from orchestrator.domain.errors import StaleLease
from orchestrator.domain.flow_window import Admit, CallBlocked, parked
from orchestrator.domain.usage import Tokens
from orchestrator.runtime.metrics import Metrics
from orchestrator.runtime.outcomes import Outcome, OutcomeWriter, Parked, named
from orchestrator.runtime.usage import call_usage, spent, tokens_of
from orchestrator.storage.flow import Leased
from orchestrator.storage.jobs import Held
from orchestrator.storage.stores import Stores


@dataclass(frozen=True)
class Go:
    """Send the call now: it is counted in its key's window."""


async def end_attempt(
    writer: OutcomeWriter, metrics: Metrics, held: Held, outcome: Outcome, lease_token: UUID
) -> str:
    """Write an external attempt's outcome, as its held dispatch's end, and count it; its name.
    StaleLease (nothing written) when the attempt lost the lease meanwhile."""
    if not await writer.write(held.dispatch_id, held.claim, outcome):
        raise StaleLease(held.claim.id, lease_token)
    name, error_class, layer = named(outcome)
    metrics.attempt_finished(
        held.claim.job_type, name, held.running_ms / 1000, error_class=error_class, layer=layer
    )
    return name


class ExternalCalls:
    def __init__(self, stores: Stores, writer: OutcomeWriter, metrics: Metrics) -> None:
        self.stores = stores
        self.writer = writer
        self.metrics = metrics

    async def admit(
        self, job_id: UUID, *, attempt: int, lease_token: UUID, units: int, model: str | None,
        call_id: str | None = None,
    ) -> Go | Parked:  # fmt: skip
        """Admit the attempt's next call, to ``model`` (None: the one its job's key is for),
        estimated at ``units``: Go (at once, or once its room, which comes soon, has come), or
        Parked (the attempt ended: its job waits in its key's line, no budget used). A call
        ``call_id`` admitted already (its answer lost on the way) is Go again, counted once.
        StaleLease, and nothing recorded, unless this attempt holds the job's lease."""
        admitted = await self.stores.flow.admit_call(
            job_id, model, units=units, first=Leased(attempt, lease_token), call_id=call_id
        )
        verdict = admitted.verdict
        if isinstance(verdict, Admit) and verdict.after > 0:
            await asyncio.sleep(verdict.after)  # (from after its spend was placed: it is due)
            paused_for = await self.stores.flow.go(admitted)
            if paused_for is not None:  # its spend left the window: nothing to release
                return await self._park(
                    job_id, attempt, lease_token, admitted.key, "paused", units, False, paused_for
                )
        if isinstance(verdict, Admit):
            return Go()
        return await self._park(
            job_id, attempt, lease_token, admitted.key, verdict.blocked, units,
            verdict.reserved, verdict.at,
        )  # fmt: skip

    async def _park(
        self, job_id: UUID, attempt: int, lease_token: UUID, call_key: str | None,
        blocked: CallBlocked, units: int, release: bool, at: float,
    ) -> Parked:  # fmt: skip
        """End the attempt as an in-process park does (orchestrator.runtime.outcomes)."""
        held = await self.stores.jobs.held(job_id, attempt=attempt, lease_token=lease_token)
        if held is None:
            raise StaleLease(job_id, lease_token)
        key = held.claim.flow_key
        assert key is not None  # a call that found no room has a key
        outcome = Parked.of(parked(key, call_key, blocked, units, release=release, at=at))
        await end_attempt(self.writer, self.metrics, held, outcome, lease_token)
        return outcome

    async def record(
        self, job_id: UUID, *, attempt: int, lease_token: UUID, model: str, tokens: Tokens,
        call_id: str | None, sent_seconds_ago: float | None,
    ) -> bool:  # fmt: skip
        """Record a call of the attempt that returned: its usage, and its spend in the window
        of the key it was admitted against (reconciling its admission's estimate), dated from
        ``sent_seconds_ago`` before now on the database's clock. False: a call of this
        ``call_id`` was recorded already. StaleLease, and nothing recorded, unless this attempt
        holds the job's lease."""
        held = await self.stores.jobs.held(job_id, attempt=attempt, lease_token=lease_token)
        if held is None:
            raise StaleLease(job_id, lease_token)
        usage = call_usage(
            held.claim, model, input_tokens=tokens.input_tokens,
            output_tokens=tokens.output_tokens, cache_read_tokens=tokens.cache_read_tokens,
            cache_creation_tokens=tokens.cache_creation_tokens, call_id=call_id,
        )  # fmt: skip
        recorded = await self.stores.usage.record(usage)
        if recorded:
            self.metrics.llm_call(model, outcome="ok", tokens=tokens_of(usage))
        key = await self.stores.flow.call_key(job_id, model)
        if key is not None:  # written once per call id, as its usage is
            await self.stores.flow.spend(
                key, job_id, units=spent(usage), call_id=usage.call_id,
                sent_seconds_ago=sent_seconds_ago,
            )  # fmt: skip
        return recorded
