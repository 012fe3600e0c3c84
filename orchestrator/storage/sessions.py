"""The dashboard's sign-in sessions (orc_ui_sessions): a browser signs in with an API token and
gets a random session id in a cookie; only the id's SHA-256 is stored, with the token (the
session ends with it) and the session's CSRF token."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from uuid import UUID

from orchestrator.domain.principals import Principal, Scope, bound_tenants
from orchestrator.storage.runner import Queries


@dataclass(frozen=True)
class Session:
    principal: Principal
    csrf: str


class SessionStore:
    def __init__(self, queries: Queries) -> None:
        self.queries = queries

    async def create(self, token_id: UUID, *, seconds: float) -> str:
        """A new session of this token for ``seconds``; its id, for the cookie (only here)."""
        session_id = secrets.token_urlsafe(32)
        await self.queries.execute(
            "create_session",
            {"id_sha256": _digest(session_id), "token_id": token_id,
             "csrf": secrets.token_urlsafe(24), "seconds": seconds},
        )  # fmt: skip
        return session_id

    async def find(self, session_id: str) -> Session | None:
        """The session, while it and its token live."""
        row = await self.queries.row("find_session", {"id_sha256": _digest(session_id)})
        if row is None:
            return None
        principal = Principal(
            name=row["name"],
            scopes=frozenset(Scope(s) for s in row["scopes"]),
            tenants=bound_tenants(row["tenants"]),
            token_id=row["id"],
        )
        return Session(principal, row["csrf"])

    async def end(self, session_id: str) -> None:
        """End it (and any that expired)."""
        await self.queries.execute("end_session", {"id_sha256": _digest(session_id)})


def _digest(session_id: str) -> bytes:
    return hashlib.sha256(session_id.encode()).digest()
