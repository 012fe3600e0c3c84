"""What a task sees of its own attempt: ``async def fn(ctx: JobContext, payload)``."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar
from uuid import UUID

import httpx

from orchestrator.calls import call_limit
from orchestrator.secrets import Secrets
from retry_config import JobRetryConfig

if TYPE_CHECKING:
    from checkpoints import CheckpointStore, Ledger, StepClock, Steps
    from checkpoints.ledger import Call, Reconcile

C = TypeVar("C")
S = TypeVar("S")
T = TypeVar("T")


@dataclass(frozen=True)
class JobContext:
    job_id: UUID
    job_type: str
    attempt: int  # every claim of this job so far, this one included (never reset)
    run: int  # run of the current dispatch (infrastructure retries)
    retry_count: int  # application retries used before this attempt
    max_retries: int
    lease_token: UUID  # this attempt's run id; every write it makes is fenced by it
    worker: str
    trace_id: str
    agent_id: str | None
    config: JobRetryConfig
    log: logging.LoggerAdapter[logging.Logger]
    #: HTTP client with the type's connect and total call timeouts (see orchestrator.calls).
    http: httpx.AsyncClient = field(repr=False)
    #: Secrets by name, from the environment or the mounted secrets directory; their values
    #: are redacted from stored errors and logs (orchestrator.secrets).
    secrets: Secrets = field(repr=False)
    _should_abort: Callable[[], bool] = field(repr=False)
    _shared: Callable[[Hashable, Callable[[], Any]], Any] = field(repr=False)
    _ledger: Ledger = field(repr=False)
    _checkpoints: CheckpointStore = field(repr=False)
    _step_clock: StepClock = field(repr=False)

    def should_abort(self) -> bool:
        """True once this attempt should stop: a drain, a cancel, its step overran, or its job
        was handed to another attempt.

        Long tasks check it between steps; an ``await`` is cancelled anyway when it happens.
        """
        return self._should_abort()

    def shared(self, key: Hashable, make: Callable[[], C]) -> C:
        """A client shared by this worker's attempts (made once per ``key`` by ``make()``,
        closed with ``aclose()`` when the worker stops): connections are reused, and a thousand
        concurrent jobs do not make a thousand clients."""
        client: C = self._shared(key, make)
        return client

    def call_limit(self, tool: str | None = None) -> AbstractAsyncContextManager[None]:
        """Bound one call (a tool run, a subprocess...) by the type's limit for ``tool``
        (``tool_timeouts_ms``, else ``call_timeout_ms``); overrunning raises CallTimedOut.

            async with ctx.call_limit("kubectl"):
                await run_kubectl(args)
        """
        what = f"tool {tool!r}" if tool else "call"
        return call_limit(self.config.call_timeout(tool), what)

    def steps(
        self, state_type: Any = Any, *, initial: Any = None, max_steps: int | None = None
    ) -> Steps[Any]:
        """Checkpointed steps, from the one after the last checkpoint (see checkpoints.steps),
        each under the step timeout.

        ``state_type`` (a pydantic model, or any type pydantic knows) validates the state
        written by ``step.checkpoint`` and read back on resume; ``initial`` is step 1's state.
        """
        from checkpoints import Steps

        return Steps(
            self._ledger, self._checkpoints, state_type, initial, max_steps, self._step_clock
        )

    async def effect(
        self,
        name: str,
        call: Call[T],
        *,
        key: str,
        args: Any = None,
        idempotent: bool = False,
        reconcile: Reconcile | None = None,
        result_type: Any = Any,
    ) -> T:
        """A side effect in a plain task (its single implicit step): recorded pending before the
        call, committed as soon as it returns, never made twice (see checkpoints.ledger)."""
        return await self._ledger.effect(
            step=1, key=key, name=name, call=call, args=args, idempotent=idempotent,
            reconcile=reconcile, result_type=result_type, commit_now=True,
        )  # fmt: skip
