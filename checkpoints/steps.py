"""Checkpointed steps, as a task writes them::

    steps = ctx.steps(State, initial=State(), max_steps=20)
    async for step in steps:
        reply = await ask_llm(step.state.history)
        receipt = await step.effect("post", call=lambda inv: post(reply, key=inv),
                                    reconcile=lambda inv: find_post(inv))
        await step.checkpoint(step.state.after(reply, receipt), final=reply.done)
    return steps.state.answer        # the last committed state

The first step yielded is the one after the last checkpoint, with that checkpoint's state: a
job that crashed, drained, timed out or retried resumes there, and a committed step never runs
again. Each step ends with ``checkpoint``, its commit point; the loop ends after a ``final``
checkpoint (also when a resumed attempt finds one) or after ``max_steps`` steps, and the task
returns from ``steps.state``. ``approval`` may stop the job until a human decides.

Each step runs under the step timeout (a :class:`StepClock` given by the orchestrator): a step
that overruns is cancelled, never commits, and its job is retried from the last checkpoint.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, Literal, Protocol, TypeVar

from pydantic import TypeAdapter

from checkpoints.children import Children
from checkpoints.gate import ApprovalGate
from checkpoints.ledger import Call, Ledger, Reconcile
from orchestrator.domain.errors import PermanentError
from orchestrator.domain.models import Awaited

S = TypeVar("S")
T = TypeVar("T")


class CheckpointMissing(PermanentError):
    def __init__(self, step: int) -> None:
        super().__init__(
            f"step {step} ended without step.checkpoint(...): a step must commit before the "
            "next one starts",
            code="CHECKPOINT_MISSING",
        )


@dataclass(frozen=True)
class ApprovalDecision:
    approval_id: uuid.UUID
    status: str  # approved | rejected | expired
    decided_by: str | None
    reason: str | None

    @property
    def approved(self) -> bool:
        return self.status == "approved"


class StepClock(Protocol):
    """Times the steps: ``start`` when a step begins, ``stop`` when its work is done (at its
    checkpoint, or when the next step is asked for). ``stop`` raises if the step overran (and the
    task swallowed the cancellation), so an overrun step never commits."""

    def start(self, step: int) -> None: ...

    def stop(self) -> None: ...


class Step(Generic[S]):
    def __init__(
        self, ledger: Ledger, gate: ApprovalGate, number: int, state: S,
        adapter: TypeAdapter[S], clock: StepClock | None = None,
        children: Children | None = None,
    ) -> None:  # fmt: skip
        self.number = number
        self._children = children
        self._spawns = 0
        self._clock = clock
        self.state = state  #: the state at the start of this step (the last checkpoint's)
        self._ledger = ledger
        self._gate = gate
        self._adapter = adapter
        self._calls = 0
        self.committed: S | None = None
        self.checkpointed = False
        self.final = False

    async def effect(
        self,
        name: str,
        call: Call[T],
        *,
        args: Any = None,
        key: str | None = None,
        idempotent: bool = False,
        reconcile: Reconcile | None = None,
        result_type: Any = Any,
        commit_now: bool = False,
    ) -> T:
        """Make a side-effecting call through the ledger (see checkpoints.ledger).

        ``key`` names the call within the step; by default its position (``call1``,
        ``call2``...), stable as long as the step makes its calls in the same order.
        ``commit_now``: commit its result at once instead of with the checkpoint, so even a
        crash before the checkpoint keeps it (an LLM reply whose tool calls the step goes on
        to make: a resumed step then makes the same calls, under the same keys).
        """
        self._calls += 1
        return await self._ledger.effect(
            step=self.number, key=key or f"call{self._calls}", name=name, call=call, args=args,
            idempotent=idempotent, reconcile=reconcile, result_type=result_type,
            commit_now=commit_now,
        )  # fmt: skip

    async def spawn(
        self, specs: Sequence[Any], *, key: str | None = None, cancel_with_parent: bool = True
    ) -> list[uuid.UUID]:
        """Submit child jobs (JobSpecs, or their dicts; of this job's tenant and trace), once:
        a step run again after a crash or a wait gets the same children back, never new ones
        (they are recorded with this step and ``key``, by default the spawn's position in the
        step, in the transaction that submits them). Their ids, in order; a spec's
        ``depends_on`` may name an earlier one of them by its index. ``cancel_with_parent``:
        cancelling this job cancels those not ended."""
        self._spawns += 1
        return await self._family().spawn(
            self._ledger.fence, step=self.number, key=key or f"spawn{self._spawns}",
            specs=specs, cancel_with_parent=cancel_with_parent,
        )  # fmt: skip

    async def wait_for(self, children: Sequence[uuid.UUID]) -> list[Awaited]:
        """The children's outcomes (each its result, or its failure), in order, once every one
        has ended. Until then the job stops here, holding no worker slot, no lease and no
        heartbeat (BLOCKED), and resumes at its next attempt, from its last checkpoint, when
        the last child ends: this step runs again, and this call returns. Waiting spends no
        attempt or retry budget."""
        await self._ledger.flush()
        return await self._family().wait_for(self._ledger.fence, children)

    def _family(self) -> Children:
        if self._children is None:
            raise RuntimeError("this step's job cannot spawn children (no worker gave it any)")
        return self._children

    async def checkpoint(self, state: S, *, final: bool = False) -> None:
        """Commit this step: its state and its side effects, together. ``final``: the job has no
        further step (its result is to be read from this state)."""
        if self.checkpointed:
            raise RuntimeError(f"step {self.number} is already checkpointed")
        if self._clock is not None:
            self._clock.stop()
        await self._ledger.checkpoint(
            self.number,
            self._adapter.dump_python(self._adapter.validate_python(state), mode="json"),
            final=final,
        )
        self.committed, self.checkpointed, self.final = state, True, final

    async def approval(
        self,
        question: str,
        *,
        expires_in: timedelta,
        details: Any = None,
        key: str = "approval",
        on_reject: Literal["fail", "resume"] = "fail",
        notify: dict[str, Any] | None = None,
    ) -> ApprovalDecision:
        """Ask a human before going on. The first time, the job stops here (WAITING_APPROVAL)
        and a notice goes out (an ``approval_notify`` job to ``notify``, a channel target, or
        else to the configured approval target), submitted in the same transaction; once
        decided the job resumes from the last checkpoint, this step runs again, and this call
        returns the decision. A rejection fails the job unless ``on_reject="resume"``."""
        fence = self._ledger.fence
        asked = await self._gate.asked(fence, self.number, key)
        if asked is not None:
            if asked.status == "pending":
                raise RuntimeError(f"approval {asked.id} is pending while its job runs")
            return ApprovalDecision(asked.id, asked.status, asked.decided_by, asked.reason)
        await self._ledger.flush()
        raise await self._gate.ask(
            fence, step=self.number, key=key, question=question,
            details=details if details is not None else {}, on_reject=on_reject,
            expires_in=expires_in, notify=notify,
        )  # fmt: skip


class Steps(Generic[S]):
    """The steps of a job, from the one after its last checkpoint (an async iterator)."""

    def __init__(
        self, ledger: Ledger, gate: ApprovalGate, state_type: Any, initial: S,
        max_steps: int | None, clock: StepClock | None = None,
        children: Children | None = None,
    ) -> None:  # fmt: skip
        self._children = children
        self._ledger = ledger
        self._gate = gate
        self._clock = clock
        self._adapter: TypeAdapter[S] = TypeAdapter(state_type)
        self._max_steps = max_steps
        self._current: Step[S] | None = None
        self._loaded = False
        #: The last committed state (``initial`` until a step commits).
        self.state: S = initial
        #: The last committed step (0 before any).
        self.last_step = 0
        #: Whether the job's final step is committed (rather than the loop stopping at
        #: ``max_steps``).
        self.finished = False

    def __aiter__(self) -> Steps[S]:
        return self

    async def __anext__(self) -> Step[S]:
        if self._clock is not None:
            self._clock.stop()
        if not self._loaded:
            self._loaded = True
            last = await self._ledger.last_checkpoint()
            if last is not None:
                self.state = self._adapter.validate_python(last.state)
                self.last_step, self.finished = last.step, last.final
        elif self._current is not None:
            if not self._current.checkpointed:
                raise CheckpointMissing(self._current.number)
            self.state = self._current.committed  # type: ignore[assignment]
            self.last_step, self.finished = self._current.number, self._current.final
        number = self.last_step + 1
        if self.finished or (self._max_steps is not None and number > self._max_steps):
            self._current = None
            raise StopAsyncIteration
        self._current = Step(
            self._ledger, self._gate, number, self.state, self._adapter, self._clock,
            self._children,
        )  # fmt: skip
        if self._clock is not None:
            self._clock.start(number)
        return self._current
