"""Who acts: an API token's principal, its scopes and its tenants (docs/api.md, "Auth"), and
when two names are one person (docs/api.md, "The principal rule").

A token is ``orc_<id>_<secret>``: the id finds its row, the secret is checked against the
SHA-256 the row keeps (the secret itself is shown once, at creation, and never stored). Pure:
the store reads and writes the rows, the API asks these questions.

A name is kept in its normal form (:func:`name_of`): Unicode NFKC, case-folded, trimmed, its
inner spaces collapsed, and a name with an invisible, format or control character is refused.
Two names are one person when their :func:`skeleton` is the same: the normal form with the
Cyrillic and Greek letters that look like Latin ones (and the digits 0 and 1) replaced by those
(fullwidth letters are already Latin after NFKC). So ``Alice``, `` alice ``, ``ali\u200bce``,
``\u0430lice`` (Cyrillic a) and ``\uff41lice`` (fullwidth a) are all ``alice``'s.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar
from uuid import UUID, uuid4

from orchestrator.domain.errors import OrchestratorError
from retry_config.names import tenant_refusal

T = TypeVar("T")


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
        the kind, ``token:``, and the name. The two-person rule compares the person
        (:func:`person_of`), whatever the kind: ``token:alice`` is ``alice (cli:root)``."""
        return f"token:{self.name}"

    def is_person_of(self, recorded: str | None) -> bool:
        """Whether a recorded actor is this principal's person (the two-person rule)."""
        return recorded is not None and person_of(recorded) == person_of(self.actor)

    def allows(self, scope: Scope) -> bool:
        return Scope.ADMIN in self.scopes or scope in self.scopes

    def require(self, scope: Scope) -> None:
        if not self.allows(scope):
            raise Forbidden(f"token {self.name!r} lacks the {scope.value!r} scope")

    def require_fleet(self, what: str) -> None:
        """Refuse a principal limited to tenants what is shared by the whole fleet (``what``),
        such as flow keys: their counts and pauses cover every tenant's jobs."""
        if self.tenants is not None:
            raise Forbidden(f"token {self.name!r} is limited to tenants; {what} are fleet-wide")

    def sees(self, tenant_id: str | None) -> bool:
        """Whether a job of ``tenant_id`` is this principal's to see or act on. A principal
        limited to tenants sees no job without a tenant."""
        return self.tenants is None or (tenant_id is not None and tenant_id in self.tenants)

    def own_entries(self, by_tenant: Mapping[str, T]) -> dict[str, T]:
        """The entries of a table keyed by tenant (the token budgets, a limit's weights) this
        principal may read: all of them for a principal of every tenant, else its tenants'
        only (a tenant's name is its own: no other tenant learns it)."""
        return {tenant: value for tenant, value in by_tenant.items() if self.sees(tenant)}

    def tenant_for_submit(self, tenant_id: str | None) -> str | None:
        """The tenant a submit gets: the one asked for, which must be the principal's; a
        principal of exactly one tenant submits into it when none is asked for."""
        if tenant_id is None and self.tenants is not None and len(self.tenants) == 1:
            (tenant_id,) = self.tenants
        if not self.sees(tenant_id):
            raise Forbidden(f"token {self.name!r} cannot submit for tenant {tenant_id!r}")
        return tenant_id


def bound_tenants(stored: Iterable[str] | None) -> frozenset[str] | None:
    """The tenants a stored token is limited to (None: every tenant). A blank tenant names
    nobody (retry_config.names): refused since, but a token stored with one before is limited
    to the others it names, and to none if it names no other: it sees less, never more (the
    rollups' and usage rows of no tenant, ``''``, are never a limited token's)."""
    if stored is None:
        return None
    return frozenset(tenant for tenant in stored if tenant_refusal(tenant) is None)


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


class PrincipalNameError(OrchestratorError):
    """A name a principal cannot have: empty, too long, or with a character nobody sees."""

    code = "PRINCIPAL_NAME_INVALID"


#: The longest name, in characters of its normal form (orc_api_tokens.name allows 100).
MAX_NAME = 100

#: Characters that show nothing but are no format character (Unicode's Default_Ignorable_Code_Point
#: outside category Cf: fillers, variation selectors) and the blank braille pattern.
_BLANK = frozenset(
    "\u034f\u115f\u1160\u17b4\u17b5\u180b\u180c\u180d\u180e\u180f\u2800\u3164\uffa0"
    + "".join(map(chr, range(0xFE00, 0xFE10)))
    + "".join(map(chr, range(0xE0100, 0xE01F0)))
)

#: Control, format (zero-width spaces and joiners, direction marks, the BOM), surrogate,
#: private-use, unassigned and line/paragraph separators.
_HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def _hidden(ch: str) -> bool:
    return ch in _BLANK or unicodedata.category(ch) in _HIDDEN_CATEGORIES


def canonical(text: str) -> str:
    """The normal form of any text naming a principal, stored or typed, never refused: NFKC,
    hidden characters dropped, trimmed, inner whitespace collapsed to one space, case-folded."""
    text = "".join(ch for ch in unicodedata.normalize("NFKC", text) if not _hidden(ch))
    return unicodedata.normalize("NFKC", " ".join(text.split()).casefold())


def name_of(raw: str) -> str:
    """The normal form of a new name (a token's, a command line's ``--by``), or
    PrincipalNameError saying what is wrong with it."""
    for ch in raw.strip():
        if _hidden(ch):
            what = unicodedata.name(ch, unicodedata.category(ch))
            raise PrincipalNameError(
                f"the name {raw!r} contains an invisible or control character"
                f" (U+{ord(ch):04X} {what}); names are plain visible text"
            )
    name = canonical(raw)
    if not name:
        raise PrincipalNameError("a name cannot be empty")
    if len(name) > MAX_NAME:
        raise PrincipalNameError(f"a name has at most {MAX_NAME} characters, not {len(name)}")
    return name


#: Unicode's confusables (confusables.txt, UTS #39) for the letters of Cyrillic and Greek that
#: look like a Latin letter, each case, and the digits 0 and 1 (like o and l). Mapped before case
#: folding, where Greek Nu (N) and nu (v) still differ. orc_principal_person_v1 (migration
#: 0022) holds the same table.
CONFUSABLES: dict[str, str] = {
    # Cyrillic capitals, then small letters
    "\u0410": "A", "\u0412": "B", "\u0415": "E", "\u041a": "K", "\u041c": "M",
    "\u041d": "H", "\u041e": "O", "\u0420": "P", "\u0421": "C", "\u0422": "T",
    "\u0423": "Y", "\u0425": "X", "\u0405": "S", "\u0406": "I", "\u0408": "J",
    "\u04ae": "Y", "\u051a": "Q", "\u051c": "W", "\u04c0": "l", "\u0417": "3",
    "\u0430": "a", "\u0435": "e", "\u043e": "o", "\u0440": "p", "\u0441": "c",
    "\u0443": "y", "\u0445": "x", "\u0455": "s", "\u0456": "i", "\u0458": "j",
    "\u04bb": "h", "\u0501": "d", "\u051b": "q", "\u051d": "w", "\u04cf": "l",
    "\u0433": "r", "\u043f": "n", "\u0432": "b", "\u043a": "k", "\u043c": "m",
    "\u043d": "h", "\u0442": "t",
    # Greek capitals, then small letters
    "\u0391": "A", "\u0392": "B", "\u0395": "E", "\u0396": "Z", "\u0397": "H",
    "\u0399": "I", "\u039a": "K", "\u039c": "M", "\u039d": "N", "\u039f": "O",
    "\u03a1": "P", "\u03a4": "T", "\u03a5": "Y", "\u03a7": "X",
    "\u03b1": "a", "\u03b3": "y", "\u03b9": "i", "\u03ba": "k", "\u03bd": "v",
    "\u03bf": "o", "\u03c1": "p", "\u03c5": "u", "\u03c7": "x",
    # digits
    "0": "o", "1": "l",
}  # fmt: skip
_CONFUSABLE_TABLE = str.maketrans(CONFUSABLES)


def skeleton(name: str) -> str:
    """What a name looks like: two names with one skeleton are one person."""
    return canonical(unicodedata.normalize("NFKC", name).translate(_CONFUSABLE_TABLE))


_CLI_ACTOR = re.compile(r"(.*) \(cli:[^()]*\)", re.DOTALL)


def person_of(recorded: str) -> str:
    """The person a recorded actor is, whatever its kind: ``token:NAME`` (the API, the
    dashboard), ``NAME (cli:OS_USER)`` (the command line), or a bare ``NAME`` (the previous
    release's command line: its ``--by`` as typed). orc_principal_person_v1 is the database's
    copy, which fills orc_dead_letters' ``*_person`` columns for every writer."""
    if recorded.startswith("token:"):
        name = recorded.removeprefix("token:")
    elif (cli := _CLI_ACTOR.fullmatch(recorded)) is not None:
        name = cli.group(1)
    else:
        name = recorded
    return skeleton(name)
