"""The string rule (orchestrator.domain.storable) for what a URL carries: every query parameter
and path parameter of every request, API or dashboard, is checked once, before any route reads
it (app.StorableParameters); text PostgreSQL cannot store is a 400 naming the parameter.

Bodies are checked by their models (their text fields are ``storable.Text``), which is why only
the URL is read here.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from starlette.datastructures import QueryParams

from orchestrator.domain.storable import refusal


def refused(scope: MutableMapping[str, Any]) -> str | None:
    """What PostgreSQL could not store in the request's URL, naming the query parameter (or
    showing the path); None when it could store all of it."""
    for name, value in QueryParams(scope.get("query_string", b"")).multi_items():
        reason = refusal(value) or refusal(name)
        if reason is not None:
            return f"query parameter {_shown(name)}: {reason}"
    reason = refusal(scope["path"])
    if reason is not None:
        return f"path {scope['path']!r}: {reason}"
    return None


def _shown(name: str) -> str:
    return name if refusal(name) is None else repr(name)
