"""The named-query home: every statement the project runs lives in ``sql/queries.sql``.

The file holds blocks of the form::

    -- query_name --
    -- What it does and why (any number of comment lines).
    SELECT ...

and is parsed once at import. Code refers to a query by name (``QUERIES["claim_job"]``), so all
SQL can be read, reviewed and EXPLAINed in one place.
"""

from __future__ import annotations

import re
from importlib import resources
from typing import LiteralString, cast

_BLOCK = re.compile(r"(?:\n|^)-- ([a-z0-9_]+) --\n(?:--.*\n)*", re.MULTILINE)


def parse(text: str) -> dict[str, LiteralString]:
    parts = _BLOCK.split(text)
    queries: dict[str, LiteralString] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice")
        queries[name] = cast(LiteralString, body.strip())
    return queries


QUERIES = parse(
    (resources.files("orchestrator.storage") / "sql" / "queries.sql").read_text("utf-8")
)
