"""The side-effect ledger of one attempt.

Protocol for one side-effecting call, identified by a deterministic ``invocation_id``
(``<job id>.<step>.<key>``, URL- and header-safe, passed to the call so it can serve as a real
idempotency key; a replay's job id there is its chain's first job's, whose ledger it carries):

    begin     the ledger says committed  -> return its result; never call again
              pending or failed (an earlier attempt was cut off, or its call raised: it may
              have happened) -> reconcile(invocation_id) first, unless the call is idempotent;
              if the external system confirms it, commit that result and return it
              unknown -> record it pending, with its arguments
    call      the call raises -> record it failed (classified), re-raise
              it returns -> its result waits for the step's commit point: the checkpoint (one
              statement) or, in a plain task's implicit step, right away

An attempt that ends without a crash (error, drain, approval wait) commits the results it
holds before its outcome is written (``flush``); only a crash leaves pending records behind.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import TypeAdapter

from checkpoints.store import Checkpoint, CheckpointStore
from orchestrator.domain.classification import Classifier, classify
from orchestrator.domain.errors import PermanentError
from orchestrator.domain.events import error_summary
from orchestrator.domain.models import Fence

T = TypeVar("T")
KEY = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # keeps invocation ids safe in URLs and headers


@dataclass(frozen=True)
class Reconciled:
    """What ``reconcile(invocation_id)`` returns when the external system says it happened."""

    result: Any = None


Call = Callable[[str], Awaitable[T]]
Reconcile = Callable[[str], Awaitable[Reconciled | None]]


class Ledger:
    def __init__(
        self, store: CheckpointStore, fence: Fence, classifiers: list[Classifier],
        before_commit: Callable[[], Awaitable[None]] | None = None,
    ) -> None:  # fmt: skip
        self.store = store
        self.fence = fence
        self.classifiers = classifiers
        #: Run before each checkpoint and each flush (the attempt's live output written first,
        #: so a committed step's output is stored before it: orchestrator.runtime.output).
        self.before_commit = before_commit
        self._held: dict[int, list[dict[str, Any]]] = {}  # step -> results awaiting commit

    async def effect(
        self,
        *,
        step: int,
        key: str,
        name: str,
        call: Call[T],
        args: Any,
        idempotent: bool,
        reconcile: Reconcile | None,
        result_type: Any,
        commit_now: bool,
    ) -> T:
        if not idempotent and reconcile is None:
            raise PermanentError(
                f"side effect {name!r}: give reconcile= (to ask the external system whether "
                "an interrupted call happened) or declare it idempotent=True",
                code="EFFECT_NOT_RECONCILABLE",
            )
        if not KEY.match(key):
            raise PermanentError(
                f"side effect {name!r}: key {key!r} must be 1-64 letters, digits, '_', '-' or '.'",
                code="EFFECT_KEY_INVALID",
            )
        adapter: TypeAdapter[T] = TypeAdapter(result_type)
        entry = await self.store.begin_effect(self.fence, step=step, key=key, name=name, args=args)
        invocation_id = entry.invocation_id
        if entry.status == "committed":
            return adapter.validate_python(entry.result)
        if entry.status in ("pending", "failed"):
            if reconcile is not None and not idempotent:
                found = await reconcile(invocation_id)
                if found is not None:
                    value = adapter.validate_python(found.result)
                    await self.store.commit_effects(
                        self.fence, [_committed(invocation_id, adapter, value, reconciled=True)]
                    )
                    return value
            await self.store.retry_effect(self.fence, invocation_id)
        try:
            value = adapter.validate_python(await call(invocation_id))
        except Exception as exc:
            await self.store.fail_effect(
                self.fence, invocation_id, error_summary(exc, classify(exc, self.classifiers))
            )
            raise
        done = _committed(invocation_id, adapter, value, reconciled=False)
        if commit_now:
            await self.store.commit_effects(self.fence, [done])
        else:
            self._held.setdefault(step, []).append(done)
        return value

    async def checkpoint(self, step: int, state: Any, *, final: bool) -> None:
        """The step's commit point: its state and its side effects' results, one statement."""
        if self.before_commit is not None:
            await self.before_commit()
        await self.store.write_checkpoint(
            self.fence, step=step, state=state, final=final, effects=self._held.pop(step, [])
        )

    async def last_checkpoint(self) -> Checkpoint | None:
        return await self.store.last_checkpoint(self.fence.job_id)

    async def flush(self) -> None:
        """Commit the results still held (the attempt is ending before its step committed). They
        are let go once written, so a flush that failed can be made again."""
        if self.before_commit is not None:
            await self.before_commit()
        held = [e for step in sorted(self._held) for e in self._held[step]]
        await self.store.commit_effects(self.fence, held)
        self._held.clear()


def _committed(
    invocation_id: str, adapter: TypeAdapter[Any], value: Any, *, reconciled: bool
) -> dict[str, Any]:
    return {
        "invocation_id": invocation_id,
        "result": adapter.dump_python(value, mode="json"),
        "reconciled": reconciled,
    }
