"""Who acts: an API token's principal, its scopes and its tenants (docs/api.md, "Auth").

A token is ``orc_<id>_<secret>``: the id finds its row, the secret is checked against the
SHA-256 the row keeps (the secret itself is shown once, at creation, and never stored). Pure:
the store reads and writes the rows, the API asks these questions.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from enum import StrEnum
from uuid import UUID, uuid4

from orchestrator.domain.errors import OrchestratorError


class Scope(StrEnum):
    READ = "read"  # see jobs, events, dead letters, approvals, config, queues
    SUBMIT = "submit"  # submit jobs
    OPERATE = "operate"  # cancel, requeue, discard, approve, reject
    WORKER = "worker"  # run jobs as an external worker (claim, heartbeat, complete)
    ADMIN = "admin"  # all of the above, and the internal replay endpoints


class Unauthorized(OrchestratorError):
    """No credentials, or credentials that name no live token (HTTP 401)."""

    code = "UNAUTHORIZED"


class Forbidden(OrchestratorError):
    """A known principal acting beyond its scopes or tenants (HTTP 403)."""

    code = "FORBIDDEN"


@dataclass(frozen=True)
class Principal:
    """An authenticated caller. ``tenants`` None: every tenant's jobs (and jobs of none)."""

    name: str
    scopes: frozenset[Scope]
    tenants: frozenset[str] | None = None
    token_id: UUID | None = None  # the token it signed in with

    @property
    def actor(self) -> str:
        """Who acted, as records name it (``decided_by``, ``discarded_by``, a cancel's ``by``):
        apart from the command line's ``cli:<user>``, so a token and a shell user never pass
        for each other in the two-person rule."""
        return f"token:{self.name}"

    def allows(self, scope: Scope) -> bool:
        return Scope.ADMIN in self.scopes or scope in self.scopes

    def require(self, scope: Scope) -> None:
        if not self.allows(scope):
            raise Forbidden(f"token {self.name!r} lacks the {scope.value!r} scope")

    def sees(self, tenant_id: str | None) -> bool:
        """Whether a job of ``tenant_id`` is this principal's to see or act on. A principal
        limited to tenants sees no job without a tenant."""
        return self.tenants is None or (tenant_id is not None and tenant_id in self.tenants)

    def tenant_for_submit(self, tenant_id: str | None) -> str | None:
        """The tenant a submit gets: the one asked for, which must be the principal's; a
        principal of exactly one tenant submits into it when none is asked for."""
        if tenant_id is None and self.tenants is not None and len(self.tenants) == 1:
            (tenant_id,) = self.tenants
        if not self.sees(tenant_id):
            raise Forbidden(f"token {self.name!r} cannot submit for tenant {tenant_id!r}")
        return tenant_id


_TOKEN = re.compile(r"orc_([0-9a-f]{32})_([A-Za-z0-9_-]{43})")


@dataclass(frozen=True)
class NewToken:
    id: UUID
    secret_sha256: bytes
    #: The whole token, shown once to whoever created it.
    token: str


def new_token() -> NewToken:
    token_id, secret = uuid4(), secrets.token_urlsafe(32)
    return NewToken(token_id, digest(secret), f"orc_{token_id.hex}_{secret}")


def parse_token(token: str) -> tuple[UUID, str]:
    """(id, secret) of a token; Unauthorized when it is not one."""
    found = _TOKEN.fullmatch(token.strip())
    if found is None:
        raise Unauthorized("not an orchestrator API token")
    return UUID(found.group(1)), found.group(2)


def digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def matches(secret: str, secret_sha256: bytes) -> bool:
    return hmac.compare_digest(digest(secret), secret_sha256)
