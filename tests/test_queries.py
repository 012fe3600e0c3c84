"""The named queries (orchestrator/storage/queries.py): each store's statements in a file beside
it, all of them read into one mapping, and a name defined once across the files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from orchestrator.storage.queries import QUERIES, load, parse

STORAGE = Path(__file__).resolve().parent.parent / "orchestrator" / "storage"
ONE = "-- one --\nSELECT 1\n\n"
TWO = "-- two --\nSELECT 2\n\n"


def test_every_file_beside_the_stores_is_read() -> None:
    files = sorted(STORAGE.glob("*.sql"))
    assert set(QUERIES) == {name for f in files for name in parse(f.read_text())}


def test_each_file_sits_beside_the_module_that_runs_it() -> None:
    lonely = [f.name for f in sorted(STORAGE.glob("*.sql")) if not f.with_suffix(".py").exists()]
    assert lonely == ["checkpoints.sql"]  # checkpoints/store.py's: a layer above storage


def test_a_block_is_its_statement_without_its_comments() -> None:
    assert parse("-- header\n\n-- one --\n-- why\nSELECT 1\n\n-- two --\nSELECT 2\n") == {
        "one": "SELECT 1",
        "two": "SELECT 2",
    }


@pytest.mark.parametrize(
    ("files", "named"),
    [
        ({"a.sql": ONE, "b.sql": TWO + ONE}, "a.sql and b.sql"),
        ({"a.sql": ONE + ONE}, "a.sql and a.sql"),
    ],
    ids=["in two files", "in one file"],
)
def test_a_name_defined_twice_is_refused_with_both_files_named(
    files: dict[str, str], named: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(f"'one' is defined twice: in {named}")):
        load(files)
