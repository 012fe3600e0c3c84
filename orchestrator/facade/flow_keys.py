"""The operators' view of flow control (docs/flow-control.md): the flow keys, and the pause
that holds a key's jobs."""

from __future__ import annotations

from orchestrator.domain.errors import InvalidArgument
from orchestrator.domain.flow import FlowKey
from orchestrator.facade.arguments import storable
from orchestrator.facade.lifecycle import Lifecycle


class FlowKeys:
    def __init__(self, lifecycle: Lifecycle) -> None:
        self._lifecycle = lifecycle

    async def keys(self, key: str | None) -> list[FlowKey]:
        storable(key=key)
        return await self._lifecycle.stores.flow.keys(key)

    async def pause(self, key: str, *, seconds: float, reason: str, by: str) -> FlowKey:
        storable(key=key, reason=reason, by=by)
        if not 0 < seconds <= 86_400 * 30:
            raise InvalidArgument(f"seconds: {seconds:g} is not in (0, 2592000]")
        await self._lifecycle.stores.flow.pause(
            key, seconds=seconds, reason=reason or "paused", by=by
        )
        return await self._lifecycle.stores.flow.get(key)

    async def resume(self, key: str) -> FlowKey:
        storable(key=key)
        await self._lifecycle.stores.flow.resume(key)
        return await self._lifecycle.stores.flow.get(key)
