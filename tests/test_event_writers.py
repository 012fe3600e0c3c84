"""Each kind of event has one writer of its payload, the one docs/architecture.md ("Event
payloads") names: every statement in our SQL that writes the kind calls it (or, for a kind shaped
in Python, takes its payload as given, adding only the ties to its rows), and nothing else in
the SQL or the Python builds the kind's keys. Read from the sources: no database."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

import pytest

from tests.support.harness import ROOT

SQL = ROOT / "orchestrator" / "storage" / "sql"
FUNCTIONS = SQL / "functions"
EVENTS_PY = ROOT / "orchestrator" / "domain" / "events.py"
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()
CONTRACTS = (ROOT / "docs" / "contracts.md").read_text()
#: What a statement adds to a payload shaped in Python: its ties to the rows it writes (a
#: failure's max_attempts, from the job's row: orc_max_attempts_after_v1).
TIES = {"dead_letter_id", "expires_at", "available_at", "max_attempts"}
KIND = re.compile(r"'(job\.[a-z_]+)'")
BUILT = re.compile(r"\bjsonb_build_object\s*\(")
SQL_WRITER = re.compile(r"\borc_[a-z0-9_]+_event_v\d+\b")


def sql_sources() -> dict[str, str]:
    """Every SQL file a release runs (not the generated schema.sql, nor the migrations, which
    hold no function body), by its path under orchestrator/storage."""
    files = [*FUNCTIONS.glob("*.sql"), SQL / "graphile_worker.sql", *SQL.parent.glob("*.sql")]
    return {str(f.relative_to(SQL.parent)): f.read_text() for f in sorted(files)}


def home(where: str) -> str:
    """A SQL file the table names (under orchestrator/storage/sql), as sql_sources names it."""
    return f"sql/{where}"


def python_sources() -> dict[str, str]:
    files = [*(ROOT / "orchestrator").rglob("*.py"), *(ROOT / "checkpoints").rglob("*.py")]
    return {str(f.relative_to(ROOT)): f.read_text() for f in sorted(files)}


def table() -> dict[str, tuple[str, str]]:
    """Kind -> (its writer, the file it is in), from docs/architecture.md."""
    part = ARCHITECTURE[ARCHITECTURE.index("## Event payloads") :]
    part = part[: part.index("\n## ", 1)]
    writers = {}
    for row in part.splitlines():
        cells = [c.strip() for c in row.split("|")]
        if len(cells) != 5 or not cells[2].startswith("`"):
            continue
        writer, where = cells[2].strip("`"), cells[3].strip("`")
        for kind in re.findall(r"`(job\.[a-z_]+|last_error)`", cells[1]):
            writers[kind] = (writer, where)
    return writers


def contract_keys() -> dict[str, set[str]]:
    """Kind -> its keys, from the events table of docs/contracts.md."""
    part = CONTRACTS[CONTRACTS.index("| Kind | Payload keys |") : CONTRACTS.index("- The counters")]
    keys = {}
    for row in part.splitlines()[2:]:
        cells = row.split("|")
        if len(cells) < 3:
            continue
        for kind in re.findall(r"`(job\.[a-z_]+)`", cells[1]):
            keys[kind] = set(re.findall(r"`([a-z_]+)`", cells[2]))
    return keys


def balanced(text: str, start: int) -> str:
    """The text from ``start`` (just after an opening parenthesis) to its closing one."""
    depth, i = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    return text[start : i - 1]


def built_objects(text: str) -> Iterator[tuple[int, set[str]]]:
    """Each jsonb_build_object in ``text``: where, and the literal keys it (and what it nests)
    builds."""
    for match in BUILT.finditer(text):
        body = balanced(text, match.end())
        yield match.start(), set(re.findall(r"'([a-z_]+)'\s*,", body))


def statements(text: str) -> Iterator[tuple[int, str]]:
    """Each statement that inserts into orc_job_events: where it starts, and its text (to its
    semicolon, the parenthesis closing its CTE, or the blank line ending its named block)."""
    for match in re.finditer(r"INSERT INTO orc_job_events\b", text):
        depth, i = 0, match.start()
        while i < len(text) and text[i] != ";" and not text.startswith("\n\n", i):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            if depth < 0:
                break
            i += 1
        yield match.start(), text[match.start() : i]


def definitions() -> dict[str, list[tuple[str, int, int]]]:
    """SQL function name -> where each definition of it is: file, start and end of its text."""
    found: dict[str, list[tuple[str, int, int]]] = {}
    for path, text in sql_sources().items():
        for match in re.finditer(r"CREATE (?:OR REPLACE )?FUNCTION ([a-z0-9_.]+)\(", text):
            end = text.index("$$;", text.index("$$", match.end()) + 2)
            found.setdefault(match[1], []).append((path, match.start(), end))
    return found


def python_writers() -> set[str]:
    tree = ast.parse(EVENTS_PY.read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


def test_the_table_names_every_kind_of_the_contract_and_of_events_py() -> None:
    docstring = ast.get_docstring(ast.parse(EVENTS_PY.read_text())) or ""
    documented = set(table()) - {"last_error"}
    assert documented == set(contract_keys())
    assert documented == set(re.findall(r"\bjob\.[a-z_]+", docstring))


def test_each_writer_is_where_the_table_says_and_defined_once() -> None:
    defined = definitions()
    in_python = python_writers()
    for kind, (writer, where) in table().items():
        if where == "domain/events.py":
            assert writer in in_python, f"{kind}: events.py has no {writer}"
            continue
        assert where.startswith("functions/"), f"{kind}: {where} is neither events.py nor SQL"
        assert [d[0] for d in defined.get(writer, [])] == [home(where)], (
            f"{kind}: {writer} must be defined once, in {where}: {defined.get(writer)}"
        )
        short = kind.removeprefix("job.")
        assert short not in in_python, f"{kind} is shaped in SQL, yet events.py has {short}()"


def test_every_statement_that_writes_an_event_calls_its_kinds_writer() -> None:
    writers = table()
    defined = definitions()
    seen = set()
    for path, text in sql_sources().items():
        for at, statement in statements(text):
            where = f"{path}, at {text[:at].count(chr(10)) + 1}"
            extra = set().union(*(keys for _, keys in built_objects(statement)))
            assert extra <= TIES, f"{where} builds {extra - TIES} into an event itself"
            for kind in KIND.findall(statement):
                assert kind in writers, f"{where} writes {kind}, which the table lacks"
                seen.add(kind)
                writer, home = writers[kind]
                if home == "domain/events.py":
                    assert not SQL_WRITER.search(statement), f"{where}: {kind} is Python's"
                    continue
                inside = any(f == path and start <= at < end for f, start, end in defined[writer])
                assert f"{writer}(" in statement or inside, f"{where}: {kind} not by {writer}"
    sql_kinds = {k for k, (_, home) in writers.items() if home.startswith("functions/")}
    assert sql_kinds <= seen, f"never written: {sql_kinds - seen}"


@pytest.mark.parametrize("kind", [k for k, (w, home) in table().items() if SQL_WRITER.fullmatch(w)])
def test_no_copy_of_a_kind_shaped_in_sql(kind: str) -> None:
    """Its keys are built nowhere but in its writer: in no other SQL object (with others or
    not), no Python dict (of just those keys)."""
    keys = contract_keys()[kind]
    writer = table()[kind][0]
    (path, start, end), = definitions()[writer]  # fmt: skip
    for file, text in sql_sources().items():
        for at, built in built_objects(text):
            assert not (keys <= built) or (file == path and start <= at < end), (
                f"{file}, at {text[:at].count(chr(10)) + 1}, builds {kind}'s keys"
            )
    for file, source in python_sources().items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Dict):
                literal = {k.value for k in node.keys if isinstance(k, ast.Constant)}
                assert keys != literal, f"{file}, at {node.lineno}, builds {kind}'s keys"


#: The counters every failure reports; a copy of a kind's shape is told by its other keys.
COUNTERS = {"attempt", "max_attempts", "run", "max_runs", "retry_count", "max_retries"}
#: The one copy left of a payload shaped in Python (docs/architecture.md, "Event payloads"):
#: the failure no attempt held (orc_fail_unheld_v1, which Graphile Worker's permanently_fail_jobs
#: and a job without its flow key at its claim end through), held equal to events.failed by
#: test_graphile_compat (a job.failed has every key of a job.retry_scheduled).
LEFT = {kind: "orc_fail_unheld_v1" for kind in ("job.failed", "job.retry_scheduled")}


@pytest.mark.parametrize(
    "kind", [k for k, (w, home) in table().items() if home == "domain/events.py" and "." in k]
)
def test_no_sql_copy_of_a_kind_shaped_in_python(kind: str) -> None:
    keys = contract_keys()[kind] - TIES - COUNTERS
    allowed = [d for name, ds in definitions().items() if name == LEFT.get(kind) for d in ds]
    copies = [
        f"{file}, at {text[:at].count(chr(10)) + 1}"
        for file, text in sql_sources().items()
        for at, built in built_objects(text)
        if keys <= built and not any(f == file and s <= at < e for f, s, e in allowed)
    ]
    assert not copies, f"{kind}'s keys built in SQL: {copies}"
    if kind in LEFT:
        assert f"`{LEFT[kind]}`" in ARCHITECTURE, "the copy left is documented"
