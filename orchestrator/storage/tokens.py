"""API tokens (orc_api_tokens): created by an operator with database access, checked at every
API request, revoked by name. Only a token's SHA-256 is kept (orchestrator.domain.principals)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from uuid import UUID

from pydantic import BaseModel, ConfigDict

from orchestrator.domain.errors import OrchestratorError
from orchestrator.domain.principals import (
    NewToken,
    Principal,
    Scope,
    Unauthorized,
    matches,
    new_token,
    parse_token,
)
from orchestrator.storage.runner import Queries


class TokenError(OrchestratorError):
    code = "TOKEN_INVALID"


class TokenInfo(BaseModel):
    """A token as ``orchestrator tokens list`` shows it: never its secret."""

    model_config = ConfigDict(frozen=True)

    id: UUID
    name: str
    scopes: list[Scope]
    tenants: list[str] | None
    created_by: str
    created_at: datetime
    revoked_at: datetime | None


class TokenStore:
    def __init__(self, queries: Queries) -> None:
        self.queries = queries

    async def create(
        self, name: str, scopes: Sequence[Scope], tenants: Sequence[str] | None, *, by: str
    ) -> NewToken:
        """A new token; its whole text is in the result, and nowhere else afterwards. A worker
        token cannot be limited to tenants (the API would refuse it at every use)."""
        if tenants is not None and Scope.WORKER in scopes:
            raise TokenError(
                f"token {name!r}: the worker scope cannot be limited to tenants (an external "
                "worker runs whichever job comes due, of any tenant); create it without --tenant"
            )
        token = new_token()
        row = await self.queries.row(
            "create_token",
            {
                "id": token.id,
                "name": name,
                "secret_sha256": token.secret_sha256,
                "scopes": sorted({scope.value for scope in scopes}),
                "tenants": sorted(set(tenants)) if tenants is not None else None,
                "created_by": by,
            },
        )
        if row is None:
            raise TokenError(f"a token named {name!r} exists already (revoked ones keep the name)")
        return token

    async def list_tokens(self) -> list[TokenInfo]:
        return [TokenInfo.model_validate(row) for row in await self.queries.rows("list_tokens")]

    async def revoke(self, name: str) -> None:
        if await self.queries.row("revoke_token", {"name": name}) is None:
            raise TokenError(f"no live token named {name!r}")

    async def authenticate(self, token: str) -> Principal:
        """The principal a token stands for; Unauthorized for anything but a live token."""
        token_id, secret = parse_token(token)
        row = await self.queries.row("find_token", {"id": token_id})
        if row is None or not matches(secret, bytes(row["secret_sha256"])):
            raise Unauthorized("unknown or revoked API token")
        tenants = row["tenants"]
        return Principal(
            name=row["name"],
            scopes=frozenset(Scope(s) for s in row["scopes"]),
            tenants=frozenset(tenants) if tenants is not None else None,
            token_id=row["id"],
        )
