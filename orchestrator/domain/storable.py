"""The one rule for text from outside: PostgreSQL must be able to store it.

Its ``text`` and ``jsonb`` refuse a NUL character (U+0000, ``\\u0000`` in JSON), and a lone
UTF-16 surrogate (U+D800 to U+DFFF, unpaired) has no UTF-8 form, so the database never sees it.
Every string a caller gives (a body's field, a query or path parameter, a JSON payload's strings
and keys, the Python API's submit options) is checked against this rule before it is used, and
refused naming where it was: never a database error.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator


def refusal(text: str) -> str | None:
    """Why PostgreSQL cannot store ``text``, or None when it can."""
    if "\x00" in text:
        return "text with a NUL character (\\u0000), which PostgreSQL cannot store"
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return "text with a lone surrogate, which UTF-8 (and so PostgreSQL) cannot hold"
    return None


def storable(text: str) -> str:
    """``text``, or ValueError saying why it cannot be stored (a pydantic validator)."""
    reason = refusal(text)
    if reason is not None:
        raise ValueError(reason)
    return text


#: A string PostgreSQL can store: every text field of a request body and of a submit's options.
Text = Annotated[str, AfterValidator(storable)]
