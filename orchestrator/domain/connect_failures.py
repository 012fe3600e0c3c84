"""Why a connection to the database failed, and whether waiting can fix it.

A worker (or ``orchestrator serve``) that starts while the database is away waits for it; one
whose ``DATABASE_URL`` is wrong must fail at once with the server's reason, since no wait fixes
a bad password, an unknown database or a host name that does not exist.

libpq reports a failed connection as text only (psycopg gives no SQLSTATE for it): the server's
own refusal comes as ``FATAL:  <message>`` (``FATAL:  <SQLSTATE>: <message>`` when verbose), a
name lookup as ``failed to resolve host ...`` or ``could not translate host name ...``, and
anything else is the network's (refused, timed out, no socket, connection closed). So the kind
is read from the SQLSTATE when there is one, and from those words otherwise.
"""

from __future__ import annotations

import re
from enum import Enum


class ConnectFailure(Enum):
    """What went wrong, and whether it is worth waiting (``transient``)."""

    NO_ANSWER = ("no server answered", True)
    NOT_ACCEPTING = ("the server does not accept connections yet", True)  # 57P0x, class 53
    LOOKUP_FAILED_FOR_NOW = ("the host name could not be looked up for now", True)
    BAD_CREDENTIALS = ("the server refused the credentials", False)  # class 28
    UNKNOWN_DATABASE = ("the database does not exist", False)  # 3D000
    UNKNOWN_HOST = ("the host name does not exist", False)
    REFUSED = ("the server refused the connection", False)  # any other error of the server's

    def __init__(self, description: str, transient: bool) -> None:
        self.description = description
        self.transient = transient


#: SQLSTATEs a server starting, stopping or full answers with: it will take connections later.
WAIT_SQLSTATES = frozenset({"57P01", "57P02", "57P03"})
#: The server's messages for them (PostgreSQL's texts, in English: lc_messages' default).
NOT_ACCEPTING_TEXTS = (
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is in recovery mode",
    "the database system is not yet accepting connections",
    "the database system is not accepting connections",
    "the database system is in single-user mode",
    "sorry, too many clients already",
    "remaining connection slots are reserved",
    "terminating connection due to administrator command",
    "terminating connection due to unexpected postmaster exit",
)
CREDENTIALS_TEXTS = (
    re.compile(r"password authentication failed"),
    re.compile(r"authentication failed for user"),
    re.compile(r'role ".*" does not exist'),
    re.compile(r'role ".*" is not permitted to log in'),
    re.compile(r"no pg_hba\.conf entry"),
    re.compile(r"pg_hba\.conf rejects connection"),
    re.compile(r"permission denied for database"),
)
UNKNOWN_DATABASE_TEXT = re.compile(r'database ".*" does not exist')
#: ``FATAL:  <message>``, or ``FATAL:  <SQLSTATE>: <message>`` (libpq's verbose form).
SERVER_ERROR = re.compile(r"(?:FATAL|ERROR|PANIC):\s+(?:([0-9A-Z]{5}):\s+)?(.*)")
NAME_LOOKUP = ("failed to resolve host", "could not translate host name")
LOOKUP_FOR_NOW = ("temporary failure in name resolution",)  # EAI_AGAIN
NO_CREDENTIALS = "fe_sendauth:"  # libpq's own: the server asked for a password none gave


def connect_failure(message: str, sqlstate: str | None = None) -> ConnectFailure:
    """The kind of a failed connection, from libpq's ``message`` (and its SQLSTATE, if known)."""
    if sqlstate:
        return _by_sqlstate(sqlstate)
    errors = [m for line in message.splitlines() if (m := SERVER_ERROR.search(line))]
    if errors:
        code, text = errors[-1].groups()
        return _by_sqlstate(code) if code else _by_text(text.strip())
    lowered = message.lower()
    if NO_CREDENTIALS in lowered:
        return ConnectFailure.BAD_CREDENTIALS
    if any(words in lowered for words in NAME_LOOKUP):
        if any(words in lowered for words in LOOKUP_FOR_NOW):
            return ConnectFailure.LOOKUP_FAILED_FOR_NOW
        return ConnectFailure.UNKNOWN_HOST
    return ConnectFailure.NO_ANSWER


def _by_sqlstate(sqlstate: str) -> ConnectFailure:
    if sqlstate.startswith("08"):  # connection exception: the network's, not the server's word
        return ConnectFailure.NO_ANSWER
    if sqlstate in WAIT_SQLSTATES or sqlstate.startswith("53"):  # insufficient resources
        return ConnectFailure.NOT_ACCEPTING
    if sqlstate.startswith("28"):
        return ConnectFailure.BAD_CREDENTIALS
    if sqlstate == "3D000":
        return ConnectFailure.UNKNOWN_DATABASE
    return ConnectFailure.REFUSED


def _by_text(text: str) -> ConnectFailure:
    if any(text.startswith(words) for words in NOT_ACCEPTING_TEXTS):
        return ConnectFailure.NOT_ACCEPTING
    if any(pattern.search(text) for pattern in CREDENTIALS_TEXTS):
        return ConnectFailure.BAD_CREDENTIALS
    if UNKNOWN_DATABASE_TEXT.search(text):
        return ConnectFailure.UNKNOWN_DATABASE
    return ConnectFailure.REFUSED
