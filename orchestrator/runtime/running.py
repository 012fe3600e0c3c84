"""The attempts one worker is running now: what its heartbeats refresh, its drain hands back,
and an abort request reaches."""

from __future__ import annotations

from collections.abc import Iterator
from uuid import UUID

from orchestrator.runtime.attempt import Attempt


class Running:
    def __init__(self) -> None:
        # By lease token: one job can have two here, a superseded attempt not yet stopped and
        # its replacement.
        self._attempts: dict[UUID, Attempt] = {}

    def add(self, attempt: Attempt) -> None:
        self._attempts[attempt.claim.lease_token] = attempt

    def remove(self, attempt: Attempt) -> None:
        self._attempts.pop(attempt.claim.lease_token, None)

    def __len__(self) -> int:
        return len(self._attempts)

    def __iter__(self) -> Iterator[Attempt]:
        return iter(list(self._attempts.values()))

    def leases(self) -> dict[UUID, UUID]:
        """Lease token -> job id, of the attempts still believed to hold their job."""
        return {lease: a.claim.id for lease, a in self._attempts.items() if a.lost is None}

    def released_here(self, lease_token: UUID) -> bool:
        """Whether the attempt that held ``lease_token`` let it go itself: it ended here, or
        it is writing its own outcome. A heartbeat that no longer finds the lease then found
        that outcome, not a lease lost to another attempt."""
        attempt = self._attempts.get(lease_token)
        return attempt is None or attempt.releasing

    def abandon(self, lease_token: UUID, reason: str) -> None:
        """Stop an attempt that no longer holds its job (or cannot prove it does): it is
        cancelled and writes nothing more."""
        attempt = self._attempts.get(lease_token)
        if attempt is not None:
            attempt.abandon(reason)

    def jobs(self) -> set[UUID]:
        return {a.claim.id for a in self._attempts.values()}

    def dispatches(self) -> dict[int, Attempt]:
        return {a.dispatch_id: a for a in self._attempts.values()}
