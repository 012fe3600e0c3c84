"""Values that JSON, as PostgreSQL's ``jsonb`` stores it, holds exactly.

Refused, with where: a number that is not finite (JSON has no NaN or infinity; serialised, it
would silently become ``null``), text PostgreSQL cannot store (a NUL character, a lone
surrogate: orchestrator.domain.storable), and nesting deeper than :data:`MAX_DEPTH` levels.
"""

from __future__ import annotations

import math
from typing import Any

from orchestrator.domain import storable

#: The deepest nesting a payload or a result may have.
MAX_DEPTH = 100


class NotJson(ValueError):
    """The value cannot be stored exactly; the message names the place (``payload.items[2]``)."""


def check(value: Any, where: str) -> None:
    """Raise :class:`NotJson` for the first part of ``value`` (plain Python data: dicts,
    lists, scalars) that ``jsonb`` cannot hold exactly."""
    stack: list[tuple[Any, str, int]] = [(value, where, 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, dict | list | tuple | set | frozenset) and depth >= MAX_DEPTH:
            raise NotJson(f"{where}: nested more than {MAX_DEPTH} levels deep")
        if isinstance(item, float) and not math.isfinite(item):
            raise NotJson(f"{path}: {item} is not a number JSON can hold")
        if isinstance(item, str):
            _text(item, path)
        elif isinstance(item, dict):
            for key in reversed(list(item)):
                _text(str(key), f"{path} (a key)")
                stack.append((item[key], f"{path}.{key}", depth + 1))
        elif isinstance(item, list | tuple | set | frozenset):
            members = list(item)
            for index in reversed(range(len(members))):
                stack.append((members[index], f"{path}[{index}]", depth + 1))


def _text(text: str, path: str) -> None:
    reason = storable.refusal(text)
    if reason is not None:
        raise NotJson(f"{path}: {reason}")
