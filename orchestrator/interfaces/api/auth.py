"""Who is calling: a bearer token, checked against orc_api_tokens, gives the request its
principal; each endpoint names the scope it needs (orchestrator.domain.principals).

A token's check is cached for a few seconds, so a busy client costs one lookup per few
seconds, not one per request; a revoked token stops working within that time. A request that
lasts (an event stream, a long-poll) checks its token again every RECHECK_SECONDS through the
same cache, and ends once it is revoked.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from orchestrator.domain.principals import Principal, Scope, Unauthorized
from orchestrator.storage.tokens import TokenStore

CACHE_SECONDS = 5.0
#: How often a long-lived answer checks its token again (a cached check: no query in between).
RECHECK_SECONDS = 1.0
CACHE_SIZE = 10_000

bearer = HTTPBearer(auto_error=False, description="An API token: `orchestrator tokens create`")


class Authenticator:
    def __init__(self, tokens: TokenStore) -> None:
        self.tokens = tokens
        self._cache: dict[bytes, tuple[float, Principal]] = {}

    async def principal(self, token: str) -> Principal:
        key = hashlib.sha256(token.encode()).digest()
        now = time.monotonic()
        cached = self._cache.get(key)
        if cached is not None and cached[0] > now:
            return cached[1]
        principal = await self.tokens.authenticate(token)
        if len(self._cache) >= CACHE_SIZE:
            self._cache.clear()
        self._cache[key] = (now + CACHE_SECONDS, principal)
        return principal


async def authenticate(request: Request) -> Principal:
    """The caller of ``request``, by its bearer token; Unauthorized without a live one. Run by
    the app's Authenticate middleware, before anything else reads the request."""
    credentials = await bearer(request)
    if credentials is None:
        raise Unauthorized("an API token is required (Authorization: Bearer orc_...)")
    authenticator: Authenticator = request.app.state.authenticator
    return await authenticator.principal(credentials.credentials)


async def still_authenticated(request: Request) -> None:
    """Unauthorized once the token ``request`` came with is revoked (or has gone): a long-lived
    answer asks this as it goes (docs/api.md, "Auth")."""
    await authenticate(request)


async def principal(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> Principal:
    """The caller the Authenticate middleware found (``credentials`` declares the bearer token
    in the OpenAPI document; the middleware has read it already)."""
    caller: Principal = request.state.principal
    return caller


@dataclass(frozen=True)
class Allowed:
    """The dependency of an endpoint that needs ``scope``: the caller, if it has it. The scope is
    declared here, on the route, where tests/test_authorization.py reads what each route needs."""

    scope: Scope

    async def __call__(self, caller: Annotated[Principal, Depends(principal)]) -> Principal:
        caller.require(self.scope)
        return caller
