"""The shape of the code, read from its own source: layers that depend one way, packages that
import on their own, a public surface that is what it says, and dependencies used through their
public API only (no private member of procrastinate, psycopg or psycopg_pool is touched)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import orchestrator

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("orchestrator", "checkpoints", "tasks", "retry_config", "demo")
DEPENDENCIES = ("procrastinate", "psycopg", "psycopg_pool")
#: Underscored names that are public all the same.
PUBLIC_UNDERSCORED = {"os._exit"}  # the standard library's documented exit without clean-up

#: Each layer, and the layers it may import (docs/architecture.md draws them).
LAYERS: dict[str, set[str]] = {
    "config": set(),  # retry_config: the per-type config model, standing alone
    "settings": set(),  # orchestrator.settings: deployment settings
    "domain": {"config"},  # the state machine and pure policy
    "storage": {"domain", "settings", "config"},  # SQL, migrations, stores
    "checkpoints": {"domain", "storage"},  # durable steps and the ledger
    "runtime": {"checkpoints", "storage", "domain", "settings", "config"},  # the worker
    "services": {"checkpoints", "storage", "domain", "settings", "config"},  # maintenance
    "app": {"runtime", "services", "checkpoints", "storage", "domain", "settings", "config"},
    "interfaces": {
        "app",
        "runtime",
        "services",
        "checkpoints",
        "storage",
        "domain",
        "settings",
        "config",
    },
    "tasks": {"app", "runtime", "checkpoints", "domain", "config"},  # built-in job types
    "demo": {
        "interfaces",
        "app",
        "tasks",
        "checkpoints",
        "storage",
        "domain",
        "settings",
        "config",
    },
}


def layer_of(module: str) -> str | None:
    """The layer of one of this project's modules; None for anything else."""
    top, _, rest = module.partition(".")
    if top == "retry_config":
        return "config"
    if top in ("checkpoints", "tasks", "demo"):
        return top
    if top != "orchestrator":
        return None
    head = rest.split(".")[0]
    if head == "__main__":  # python -m orchestrator: the command line
        return "interfaces"
    if head in ("settings", "domain", "storage", "runtime", "services", "interfaces"):
        return head
    return "app"  # the Orchestrator, and the public surface the package re-exports


def sources() -> Iterator[tuple[str, Path]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def imports_of(path: Path, module: str) -> Iterator[tuple[str, int]]:
    """Every module ``path`` imports (at any depth, type-checking blocks included)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing package
                package = module.split(".")[: -node.level or None]
                base = ".".join([*package, base] if base else package)
            yield base, node.lineno
            for alias in node.names:  # `from orchestrator import app` names a module too
                yield f"{base}.{alias.name}", node.lineno


@pytest.mark.parametrize(
    "statement",
    [f"import {package}" for package in PACKAGES] + ["from checkpoints import Reconciled"],
)
def test_each_package_imports_first_in_a_fresh_interpreter(statement: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", statement], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


def test_layers_depend_one_way() -> None:
    wrong = []
    for module, path in sources():
        source = layer_of(module)
        assert source in LAYERS, f"{module}: in no layer"
        for imported, line in imports_of(path, module):
            target = layer_of(imported)
            if target is None or target == source:
                continue
            if target not in LAYERS[source]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {source} imports {target}")
    assert wrong == []


def test_nothing_below_the_interfaces_imports_them() -> None:
    users = {name for name, allowed in LAYERS.items() if "interfaces" in allowed}
    assert users == {"demo"}


#: The parts of the interfaces layer, and the parts each may import: the entry point (start)
#: loads the command line (cli), whose ``serve`` runs the application (server) that mounts the
#: dashboard (ui) on the API (api), which knows nothing of it; the API, the dashboard and the
#: command line (``tail``) wait for jobs through the one watch of the database (watch).
INTERFACE_PARTS: dict[str, set[str]] = {
    "render": set(),
    "watch": set(),
    "api": {"render", "watch"},
    "ui": {"api", "render", "watch"},
    "server": {"api", "ui"},
    "cli": {"render", "server", "watch"},
    "start": {"cli"},
}


def interface_part(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["orchestrator", "interfaces"] and len(parts) > 2 else None


def test_the_interfaces_depend_one_way() -> None:
    wrong = []
    for module, path in sources():
        source = interface_part(module)
        if source is None:
            continue
        assert source in INTERFACE_PARTS, f"{module}: in no part of the interfaces"
        for imported, line in imports_of(path, module):
            target = interface_part(imported)
            if target is not None and target != source and target not in INTERFACE_PARTS[source]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {source} imports {target}")
    assert wrong == []


def test_the_public_surface_is_what_it_says() -> None:
    assert sorted(orchestrator.__all__) == sorted(orchestrator._HOME_OF)
    for name in orchestrator.__all__:
        assert getattr(orchestrator, name) is not None
    with pytest.raises(AttributeError):
        _ = orchestrator.Worker  # type: ignore[attr-defined]


def test_no_private_member_of_a_dependency_is_touched() -> None:
    """Every ``x._name`` in the code is on ``self`` or ``cls``; and a class that extends a
    dependency's class reads no private member it did not define itself."""
    wrong = []
    for module, path in sources():
        tree = ast.parse(path.read_text())
        extended = _dependency_bases(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                owner = node.value.id if isinstance(node.value, ast.Name) else None
                if owner not in ("self", "cls") and ast.unparse(node) not in PUBLIC_UNDERSCORED:
                    wrong.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
            elif _by_name(node):  # getattr(x, "_name") and its kin reach past the dot
                wrong.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
        for cls, bases in extended.items():
            own = _assigned_privates(cls)
            for node in ast.walk(cls):
                if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
                    wrong.append(f"{module}:{node.lineno}: {cls.name}({bases}).{node.attr}")
    assert wrong == []


def test_the_issue_grep_finds_only_own_members() -> None:
    """The review's check, as written: ``grep -rnE "\\._[a-z]"`` over the packages."""
    done = subprocess.run(
        ["grep", "-rnE", r"\._[a-z]", "orchestrator", "tasks", "checkpoints", "retry_config",
         "--include=*.py"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    hits = [line for line in done.stdout.splitlines() if line]
    others = [
        line
        for line in hits
        if not all(
            m in ("self", "cls") or f"{m}._{a}" in PUBLIC_UNDERSCORED
            for m, a in _owners(line.split(":", 2)[2])
        )
    ]
    assert others == []


def test_the_check_sees_a_private_member_reached_by_name() -> None:
    call = ast.parse('getattr(worker, "_running_jobs")').body[0]
    assert isinstance(call, ast.Expr) and _by_name(call.value)
    assert not _by_name(ast.parse('getattr(worker, "name")').body[0].value)  # type: ignore[attr-defined]


def test_the_code_and_docs_cite_only_what_the_repository_holds() -> None:
    """Contracts are restated in docs/contracts.md; no comment or page sends a reader to a
    source document the repository does not hold. Applied migrations are left as they were
    applied (their checksums are recorded in every database)."""
    citation = re.compile(r"\bseed\s*0\d\d|\bseeds?/|open question \d", re.IGNORECASE)
    found = []
    for path in [*ROOT.glob("*.md"), *(ROOT / "docs").rglob("*.md"), *_code_files()]:
        if "migrations" in path.parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if citation.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == []


def test_the_architecture_diagram_names_every_module_in_its_layer() -> None:
    diagram = (ROOT / "docs" / "architecture.md").read_text().split("```mermaid")[1]
    boxes = dict(re.findall(r'^\s*(\w+)\["([^"]*)"\]', diagram.split("```")[0], re.MULTILINE))
    missing = []
    for module, _ in sources():
        parts = module.split(".")
        if parts[0] == "orchestrator" and len(parts) == 3:
            box, name = boxes[parts[1]], parts[2]
        elif parts[0] == "checkpoints" and len(parts) == 2:
            box, name = boxes["checkpoints"], parts[1]
        else:
            continue
        if not re.search(rf"\b{name}\b", box):
            missing.append(module)
    assert missing == []


def test_the_conftest_index_names_every_test_module() -> None:
    index = (ROOT / "tests" / "conftest.py").read_text().split('"""')[1]
    missing = [p.stem for p in sorted((ROOT / "tests").glob("test_*.py")) if p.stem not in index]
    assert missing == []


def _code_files() -> Iterator[Path]:
    for top in (*PACKAGES, "bench", "k8s", "tests"):
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in (".py", ".sql", ".yaml", ".toml", ".js") and "node_modules" not in (
                path.parts
            ):
                yield path


def _by_name(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
        and _private(node.args[1].value)
    )


def _owners(code: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in re.finditer(r"(\w+)\._([a-z]\w*)", code)]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _dependency_bases(tree: ast.Module) -> dict[ast.ClassDef, str]:
    """Classes of this module whose bases come from a dependency."""
    imported: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                imported[alias.asname or alias.name] = alias.name
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                head = ast.unparse(base).split(".")[0].split("[")[0]
                origin = imported.get(head, "")
                if origin.split(".")[0] in DEPENDENCIES:
                    found[node] = ast.unparse(base)
    return found


def _assigned_privates(cls: ast.ClassDef) -> set[str]:
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _private(node.name):
            names.add(node.name)
        targets = (
            node.targets if isinstance(node, ast.Assign)
            else [node.target] if isinstance(node, ast.AnnAssign)
            else []
        )  # fmt: skip
        for target in targets:
            if isinstance(target, ast.Attribute) and _private(target.attr):
                names.add(target.attr)
            elif isinstance(target, ast.Name) and _private(target.id):
                names.add(target.id)
    return names
