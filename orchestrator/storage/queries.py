"""Every statement the project runs, by name, read once at import from the ``*.sql`` files beside
the stores that run them (``jobs.sql`` beside ``jobs.py``), so a store and its SQL are read and
reviewed together. ``sql/migrations/`` holds the schema, not named statements. Statements no
store of this package runs sit beside their nearest owner: ``checkpoints.sql`` (checkpoints/
store.py), ``database.sql`` (connections).

A file holds blocks of the form::

    -- query_name --
    -- What it does and why (any number of comment lines).
    SELECT ...

Code refers to a query by name (``QUERIES["claim_dispatch"]``, or the name given to a
:class:`~orchestrator.storage.runner.Queries` method), so a name is defined once, across all
the files.

Conventions: status writes are conditional on ``status = ANY(%(sources)s)``, whose value comes
from orchestrator/domain/states.py; writes made on behalf of an attempt are also fenced by its
``lease_token``. A write that matches no row changed nothing, and the caller finds out why. A
read that a partial index serves writes out the status its predicate names (``status =
'RETRY'``): a parameter cannot match a predicate in a generic plan (tests/test_plans.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from importlib import resources
from typing import LiteralString, cast

_BLOCK = re.compile(r"(?:\n|^)-- ([a-z0-9_]+) --\n(?:--.*\n)*", re.MULTILINE)


def parse(text: str) -> dict[str, LiteralString]:
    """The statements of one file's text, by name."""
    return load({"the text": text})


def load(files: Mapping[str, str]) -> dict[str, LiteralString]:
    """The statements of these files (name -> text), by name; a name defined twice, in one
    file or in two, is refused with both files named."""
    queries: dict[str, LiteralString] = {}
    homes: dict[str, str] = {}
    for file, text in files.items():
        parts = _BLOCK.split(text)
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in homes:
                raise ValueError(f"query {name!r} is defined twice: in {homes[name]} and {file}")
            homes[name] = file
            queries[name] = cast(LiteralString, body.strip())
    return queries


def _beside_the_stores() -> dict[str, str]:
    """The ``*.sql`` files of this package's own folder, by file name, in name order."""
    folder = resources.files("orchestrator.storage")
    return {
        f.name: f.read_text("utf-8")
        for f in sorted(folder.iterdir(), key=lambda f: f.name)
        if f.name.endswith(".sql")
    }


QUERIES = load(_beside_the_stores())
