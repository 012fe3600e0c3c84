"""API tokens (orc_api_tokens): created by an operator with database access, checked at every
API request, revoked by name. Only a token's SHA-256 is kept (orchestrator.domain.principals).
A name is kept in its normal form, and one that looks like another token's is refused."""

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
    bound_tenants,
    canonical,
    matches,
    name_of,
    new_token,
    parse_token,
)
from orchestrator.storage.database import Conn
from orchestrator.storage.runner import Queries
from retry_config.names import tenant_refusal


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
        """A new token; its whole text is in the result, and nowhere else afterwards. Its name
        is kept in normal form (principals.name_of); TokenError when it looks like another
        token's name, revoked ones included (they keep the name, for the record). A worker token
        cannot be limited to tenants (the API would refuse it at every use)."""
        if tenants is not None and Scope.WORKER in scopes:
            raise TokenError(
                f"token {name!r}: the worker scope cannot be limited to tenants (an external "
                "worker runs whichever job comes due, of any tenant); create it without --tenant"
            )
        for tenant in tenants or ():
            reason = tenant_refusal(tenant)
            if reason is not None:
                raise TokenError(f"token {name!r}: tenant: {reason}")
        token, typed, name = new_token(), name, name_of(name)

        async def create(conn: Conn) -> None:
            await self.queries.execute("lock_token_names", conn=conn)
            found = await self.queries.row("token_of_person", {"name": name}, conn)
            if found is not None:
                raise TokenError(_taken(typed, name, found["name"]))
            await self.queries.execute(
                "create_token",
                {
                    "id": token.id,
                    "name": name,
                    "secret_sha256": token.secret_sha256,
                    "scopes": sorted({scope.value for scope in scopes}),
                    "tenants": sorted(set(tenants)) if tenants is not None else None,
                    "created_by": by,
                },
                conn,
            )

        await self.queries.in_transaction(create)
        return token

    async def list_tokens(self) -> list[TokenInfo]:
        return [TokenInfo.model_validate(row) for row in await self.queries.rows("list_tokens")]

    async def revoke(self, name: str) -> None:
        params = {"names": [name, canonical(name)], "folded": canonical(name)}
        if await self.queries.row("revoke_token", params) is None:
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
            tenants=bound_tenants(tenants),
            token_id=row["id"],
        )


def _taken(typed: str, name: str, existing: str) -> str:
    """Why a name is refused: the same as a token's once normalised, or a look-alike of it."""
    if canonical(existing).casefold() != name.casefold():
        why = "looks like it (letters of another script that look the same, or 0 and 1)"
    elif typed != existing:
        why = f"is the same name in normal form ({name!r}: case, spaces and width aside)"
    else:
        why = "exists already"
    return f"a token named {existing!r} {why}; revoked tokens keep their names"
