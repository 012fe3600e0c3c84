"""Children a step spawns and waits for (docs/workflows.md): spawned once whatever crashes
happen (recorded with them, by step and key, in the transaction that submits them), and waited
for without holding a worker slot (the job stops, BLOCKED, and is resumed at its next attempt
from its last checkpoint once every child has ended: the waiting dependencies use)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from uuid import UUID

from orchestrator.domain.errors import PermanentError, SubmitError
from orchestrator.domain.models import Awaited, Fence
from orchestrator.storage.graph import GraphStore

#: Child specs (a JobSpec or its dict each) as job rows of the parent's tenant and trace.
ChildRows = Callable[[Sequence[Any], "str | None", str], list[dict[str, Any]]]


class AwaitingChildren(BaseException):
    """Raised by ``Step.wait_for`` once the job waits: the attempt ends without an outcome.

    A BaseException, so that a task's ``except Exception`` cannot swallow it by accident.
    """

    def __init__(self, waiting: int) -> None:
        self.waiting = waiting
        super().__init__(f"waiting for {waiting} children")


class Children:
    """A job's children, as its steps spawn and wait for them."""

    def __init__(
        self, store: GraphStore, rows: ChildRows,
        typed: Callable[[list[Awaited]], list[Awaited]], *, tenant_id: str | None, trace_id: str,
    ) -> None:  # fmt: skip
        self.store = store
        self.rows = rows
        self.typed = typed
        self.tenant_id = tenant_id
        self.trace_id = trace_id

    async def spawn(
        self, fence: Fence, *, step: int, key: str, specs: Sequence[Any], cancel_with_parent: bool
    ) -> list[UUID]:
        """The children's ids; a spec the submit refuses fails the job for good (PermanentError
        with the refusal's code): running it again would be refused again."""
        with _refusals_permanent():
            rows = self.rows(specs, self.tenant_id, self.trace_id)
            return await self.store.spawn(
                fence, step=step, key=key, rows=rows, cancel_with_parent=cancel_with_parent
            )

    async def wait_for(self, fence: Fence, children: Sequence[UUID]) -> list[Awaited]:
        """Their outcomes, once they have all ended; until then the job stops
        (AwaitingChildren). A job it did not spawn fails it for good."""
        with _refusals_permanent():
            waiting = await self.store.wait_for(fence, children)
        if waiting:
            raise AwaitingChildren(waiting)
        return self.typed(await self.store.outcomes(children))


@contextmanager
def _refusals_permanent() -> Iterator[None]:
    try:
        yield
    except SubmitError as exc:
        raise PermanentError(str(exc), code=exc.code) from None
