"""Flow control's storage (migration 0029; docs/flow-control.md): the limits in effect, the
keys with their pauses, and what a key's jobs spend. The claim itself enforces the limits, in
the fetch's statement (``orc_flow_gate_v1``); this store is what the rest of the fleet says to
it: a config applied, a provider's 429, an operator's pause, a call's real usage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from psycopg.types.json import Jsonb

from orchestrator.domain.applications import (
    Application,
    Declaration,
    Declared,
    Kind,
    limit_definitions,
)
from orchestrator.domain.errors import FlowKeyNotFound, StaleLease
from orchestrator.domain.flow import FlowKey
from orchestrator.domain.flow_learned import Learned
from orchestrator.domain.flow_window import Admit, Room
from orchestrator.storage.applications import ApplicationStore
from orchestrator.storage.database import Conn
from orchestrator.storage.runner import Queries, Row
from retry_config import LiveConfig, RetryConfig


@dataclass(frozen=True)
class Leased:
    """An external worker's attempt, whose calls come one request at a time, to any API server:
    its lease (each call is taken only from the attempt that holds it), with which the database
    keeps what an in-process attempt counts itself (whether a call of it was admitted)."""

    attempt: int
    lease_token: UUID


@dataclass(frozen=True)
class Admitted:
    """A running job's call as its key decided it: the key it was admitted against (None:
    nothing limits it), the verdict, and its spend's id when it was recorded (for ``go``)."""

    key: str | None
    verdict: Admit | Room
    spend: int | None = None


class FlowStore:
    def __init__(self, queries: Queries, applications: ApplicationStore) -> None:
        self.queries = queries
        self.applications = applications
        self._synced: str | None = None

    async def apply(
        self, config: LiveConfig, application: Application, declares: str | None = None
    ) -> list[str]:
        """Write the limits of the config in effect as ``application``'s, once per version this
        process applies (again at each call while a withdrawal waits for a live peer that
        declares otherwise than ``declares``, this process's fingerprint); the names of those
        that changed or are gone (their keys' waiters are rescheduled). ApplicationConflict:
        another application defines one of them otherwise (nothing written)."""
        current = config.current
        if self._synced == current.version and current.version:
            return []
        changed, declared = await self.sync(current, application, declares)
        if not declared.deferred:
            self._synced = current.version
        return changed

    async def sync(
        self, config: RetryConfig, application: Application, declares: str | None = None
    ) -> tuple[list[str], Declared]:
        """Declare ``config``'s limits and limited job types as ``application``'s and write
        them; the limits it withdrew that no other application defines go (once no live peer
        of the application declares otherwise than ``declares``; None: at once)."""
        kinds = limit_definitions(config)
        limits, types = kinds[Kind.LIMIT], kinds[Kind.LIMIT_OF_TYPE]
        declaration = Declaration(application, kinds, declares=declares)

        async def write(conn: Conn, declared: Declared) -> list[Row]:
            params = {
                "limits": Jsonb([{"name": name, **limit} for name, limit in limits.items()]),
                "types": Jsonb([{"job_type": name, **t} for name, t in types.items()]),
                "gone_limits": declared.gone(Kind.LIMIT),
                "gone_types": declared.gone(Kind.LIMIT_OF_TYPE),
            }
            return await self.queries.rows("sync_flow_limits", params, conn)

        declared, rows = await self.applications.in_declaration(declaration, write)
        names = [row["name"] for row in rows]
        await self.relimited(names)
        return names, declared

    async def relimited(self, names: Sequence[str]) -> None:
        """The lines of the keys of these limits, removed, raised or lowered, handed out as
        they now allow."""
        if names:
            keys = await self.queries.rows("flow_keys_of_limits", {"names": list(names)})
            await self.reschedule([row["key"] for row in keys])

    async def reschedule(self, keys: Sequence[str]) -> int:
        """Hand each key's capacity out afresh, as the key stands now (orc_flow_reschedule_v1),
        one key per transaction (a transaction waits for one key's lock at most): how many
        waiters got a dispatch for now."""
        dispatched = 0
        for key in keys:
            row = await self.queries.row("reschedule_flow_key", {"key": key})
            dispatched += int(row["dispatched"]) if row else 0
        return dispatched

    async def backstop(self, stale_seconds: float = 60) -> int:
        """The safety net's backstop for a lost wake-up: the keys with waiters in line and none
        on its way for ``stale_seconds``, with a waiter whose time passed that long ago and
        whose dispatch is lost, or with one sent for later than its key's pause and window
        explain, rescheduled. How many waiters got a dispatch for now."""
        rows = await self.queries.rows("flow_keys_to_backstop", {"stale_seconds": stale_seconds})
        return await self.reschedule([row["key"] for row in rows])

    async def keys(self, key: str | None = None) -> list[FlowKey]:
        """Every key (or ``key``), its ``requests`` and ``units`` the allowances in effect: its
        limit's, lowered to what its provider allows when the limit learns, by the database's
        rule (orc_flow_limit_of_v1), the one every claim and call meets."""
        rows = await self.queries.rows("flow_keys", {"key": key})
        return [FlowKey.model_validate(row) for row in rows]

    async def get(self, key: str) -> FlowKey:
        found = await self.keys(key)
        if not found:
            raise FlowKeyNotFound(key)
        return found[0]

    async def pause(self, key: str, *, seconds: float, reason: str, by: str) -> None:
        """No job of ``key`` starts for ``seconds`` from now, by the database's clock."""
        params = {"key": key, "seconds": seconds, "reason": reason, "by": by}
        row = await self.queries.row("pause_flow_key", params)
        if row is None or not row["paused"]:
            raise FlowKeyNotFound(key)

    async def resume(self, key: str) -> int:
        """Lift the key's pause (and its adaptive rate reduction): how many waiters go now."""
        row = await self.queries.row("resume_flow_key", {"key": key})
        if row is None or row["dispatched"] is None:
            raise FlowKeyNotFound(key)
        return int(row["dispatched"])

    async def passable_for(self, job_id: UUID) -> float | None:
        """Seconds the job's key stays paused from now, by the database's clock, when its type
        may pass the pause on a fallback model, as its claim decides (None: it may not)."""
        row = await self.queries.row("flow_key_passable_for", {"job_id": job_id})
        return None if row is None else float(row["seconds"])

    async def learn(self, key: str, reply: Learned) -> None:
        """What a reply of ``key``'s provider said of its limits (orc_flow_learn_v1): kept, if
        the key's limit learns; the key held until a spent limit's reset."""
        params = {
            "key": key, "requests": reply.requests, "units": reply.units, "hold": reply.hold,
            "reason": reply.reason if reply.spent else None,
        }  # fmt: skip
        await self.queries.execute("flow_learn", params)

    async def admit_call(
        self, job_id: UUID, model: str | None, *, units: int, first: bool | Leased,
        call_id: str | None = None,
    ) -> Admitted:  # fmt: skip
        """Admit a running job's next call, to ``model`` (None: the one its key is for),
        estimated at ``units``, before it is sent, against the key of that model (the job's
        own, or a fallback model's): its spend recorded in that key's window if it fits now, or
        at the instant its room comes if it comes soon (``Admit.after``: the call waits for it in
        place, then ``go``), else when it will (its ``at`` in seconds from now: its job parks).
        ``first``: the job's first call since its claim, which takes the claim's reservation
        there; or, for an external worker's attempt, its lease, checked here, the database
        knowing whether a call of it was admitted, and ``call_id`` naming the call, which,
        admitted and asked again, is answered as it was and not counted twice. One statement,
        under the key's lock (orc_flow_admit_call_v1). StaleLease (nothing recorded): the lease
        is not the job's."""
        leased = first if isinstance(first, Leased) else None
        params = {
            "job_id": job_id, "model": model, "units": units, "first": first is True,
            "attempt": leased.attempt if leased else None,
            "lease_token": leased.lease_token if leased else None, "call_id": call_id,
        }  # fmt: skip
        row = await self.queries.row("flow_admit_call", params)
        assert row is not None  # the function answers one row
        if row["stale"]:
            raise StaleLease(job_id, leased.lease_token if leased else None)
        if not row["go"]:
            return Admitted(row["key"], Room(row["blocked"], row["at"], row["reserved"]))
        verdict = Admit(int(row["units"]), reuse=row["reuse"], after=row["after"])
        return Admitted(row["key"], verdict, row["spend"])

    async def go(self, admitted: Admitted) -> float | None:
        """A call admitted ahead, at the instant its room came: None, it goes; else its key was
        paused meanwhile, its spend left the window, and the pause lasts this many seconds
        more (its job parks)."""
        if admitted.key is None or admitted.spend is None:
            return None
        params = {"key": admitted.key, "spend": admitted.spend}
        row = await self.queries.row("flow_call_go", params)
        return None if row is None or row["paused_for"] is None else float(row["paused_for"])

    async def call_key(self, job_id: UUID, model: str) -> str | None:
        """The key a job's call to ``model`` is admitted against, where its usage reconciles
        its spend (None: the job has no key)."""
        row = await self.queries.row("flow_call_key", {"job_id": job_id, "model": model})
        return None if row is None else str(row["key"])

    async def spend(
        self, key: str, job_id: UUID, *, units: int, call_id: str,
        sent_seconds_ago: float | None = None,
    ) -> None:  # fmt: skip
        """The call ``call_id`` of ``job_id`` used ``units``: its first call since the job's
        admission corrects the reservation made then, a later one adds a request and its units
        to the key's window (orc_flow_spend_v2); either dated from when the call was sent, when
        that is known, as the provider counts it from when it arrives. Once per call: written
        again (a try after a lost acknowledgement), it changes nothing."""
        params: dict[str, Any] = {
            "key": key, "job_id": job_id, "units": units, "sent_seconds_ago": sent_seconds_ago,
            "call_id": call_id,
        }  # fmt: skip
        await self.queries.execute("flow_spend", params)
