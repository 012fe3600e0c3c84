"""The Kubernetes manifests as the tests read them: k8s/check.py (loaded from its file, as
operators run it) and the base's documents, with small finders."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "k8s" / "base"


def _load_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("k8s_check", ROOT / "k8s" / "check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


check = _load_check()
DEFAULTS = check.project_defaults()
BASE_DOCS: list[dict[str, Any]] = check.load_resources(BASE)


def find(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def container(doc: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = doc["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def env(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container(doc).get("env", [])}
