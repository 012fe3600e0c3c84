#!/usr/bin/env python3
"""Check Kubernetes manifests offline: their schemas, and the worker's shutdown timing.

    python k8s/check.py [DIR]                                   # default: k8s/base
    kubectl kustomize k8s/overlays/prod | python k8s/check.py -

DIR is rendered with ``kubectl kustomize`` when kubectl is installed; without it, the files of
its kustomization's ``resources`` and ``configMapGenerator`` are read as they are.

Every document is validated against the Kubernetes schemas bundled with kubernetes-validate
(strict: an unknown field is an error). Every worker Deployment (one with a container named
``worker``) must fit the shutdown timeline of docs/contracts.md, with the worker's own defaults
for what its env does not set:

    terminationGracePeriodSeconds >= preStop sleep + ORCHESTRATOR_DRAIN_SECONDS
                                     + orchestrator.runtime.drain.EXIT_GRACE + 10 s of margin

and probe GET /readyz (readiness) and /healthz (liveness) on ORCHESTRATOR_HEALTH_PORT. Each
problem is one line naming the object and the field; the exit code is 1 if there is any.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "k8s" / "base"
KUBERNETES_VERSION = "1.30"  # the oldest version the manifests must be valid for
SAFETY_MARGIN = 10.0
WORKER = "worker"
DEFAULT_GRACE = 30  # Kubernetes' terminationGracePeriodSeconds when unset
# Kustomization fields the kubectl-less fallback may skip: they change neither validity nor timing.
_SKIPPABLE = {"apiVersion", "kind", "labels", "commonLabels", "images"}

Doc = dict[str, Any]


class RenderError(Exception):
    """The manifests cannot be read or rendered."""


@dataclass(frozen=True)
class Defaults:
    """What the worker uses when its env is silent, taken from the code so they cannot drift."""

    drain_seconds: float
    health_port: int
    exit_grace: float


def project_defaults() -> Defaults:
    from orchestrator.runtime.drain import EXIT_GRACE
    from orchestrator.settings import Settings

    fields = Settings.model_fields
    return Defaults(fields["drain_seconds"].default, fields["health_port"].default, EXIT_GRACE)


# -- reading ---------------------------------------------------------------------------------


def parse(text: str) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def render(directory: Path, kubectl: str | None) -> list[Doc]:
    if kubectl is None:
        return load_resources(directory)
    done = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RenderError(f"kubectl kustomize {directory}: {done.stderr.strip()}")
    return parse(done.stdout)


def load_resources(directory: Path) -> list[Doc]:
    """Without kubectl: the listed files and generated ConfigMaps, untransformed (no labels,
    image tags or name hashes). A field it cannot honour is refused rather than ignored."""
    path = directory / "kustomization.yaml"
    try:
        kustomization = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise RenderError(f"{path}: {exc.strerror or exc}") from None
    unknown = sorted(set(kustomization) - _SKIPPABLE - {"resources", "configMapGenerator"})
    if unknown:
        raise RenderError(f"{path}: {', '.join(unknown)} needs kubectl kustomize to render")
    docs: list[Doc] = []
    for name in kustomization.get("resources", []):
        if not (directory / name).is_file():
            raise RenderError(f"{path}: resource {name!r} is not a file; rendering needs kubectl")
        docs.extend(parse((directory / name).read_text(encoding="utf-8")))
    for generator in kustomization.get("configMapGenerator", []):
        extra = sorted(set(generator) - {"name", "files", "literals", "options"})
        # No hash suffix is what this reading does anyway; any other option needs kubectl.
        if generator.get("options", {}) not in ({}, {"disableNameSuffixHash": True}):
            extra.append("options")
        if extra:
            raise RenderError(f"{path}: configMapGenerator {', '.join(extra)} needs kubectl")
        data = {}
        for entry in generator.get("files", []):
            key, _, file = entry.partition("=") if "=" in entry else (Path(entry).name, "", entry)
            data[key] = (directory / file).read_text(encoding="utf-8")
        for entry in generator.get("literals", []):
            key, _, value = entry.partition("=")
            data[key] = value
        metadata = {"name": generator["name"]}
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data})
    return docs


# -- checks (pure: parsed documents in, problem lines out) -----------------------------------


def name_of(doc: Doc) -> str:
    return f"{doc.get('kind', '?')}/{(doc.get('metadata') or {}).get('name', '?')}"


def schema_problems(doc: Doc, version: str = KUBERNETES_VERSION) -> list[str]:
    """Raises kubernetes_validate.SchemaNotFoundError for a kind it has no schema of."""
    if "apiVersion" not in doc or "kind" not in doc:
        return [f"{name_of(doc)}: a document without apiVersion or kind"]
    return list(_schema_problems(json.dumps(doc, sort_keys=True), version))


@functools.lru_cache(maxsize=256)
def _schema_problems(doc_json: str, version: str) -> tuple[str, ...]:
    # Cached because kubernetes-validate parses its 1 MB of definitions on every call, and
    # the tests check many variants of the same few documents.
    doc = json.loads(doc_json)
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        field = ".".join(str(part) for part in exc.path) or "(top level)"
        return (f"{name_of(doc)}: {field}: {exc.message} (Kubernetes {exc.version}, strict)",)
    return ()


def is_worker(doc: Doc) -> bool:
    return doc.get("kind") == "Deployment" and any(
        c.get("name") == WORKER for c in _pod(doc).get("containers") or []
    )


def worker_problems(deployment: Doc, defaults: Defaults) -> list[str]:
    who = name_of(deployment)
    pod = _pod(deployment)
    container = next(c for c in pod["containers"] if c.get("name") == WORKER)
    at = f"spec.template.spec.containers[{WORKER}]"
    problems: list[str] = []

    def say(field: str, text: str) -> None:
        problems.append(f"{who}: {field} {text}")

    env = {e.get("name"): e for e in container.get("env") or []}
    numbers: dict[str, float] = {}
    for var, default in (
        ("ORCHESTRATOR_DRAIN_SECONDS", defaults.drain_seconds),
        ("ORCHESTRATOR_HEALTH_PORT", defaults.health_port),
    ):
        entry = env.get(var, {"value": default})
        try:
            numbers[var] = float(entry["value"])
        except (KeyError, TypeError, ValueError):
            say(f"{at}.env.{var}", "must be a literal number, so the timing can be checked")

    command = (((container.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get(
        "command"
    )
    sleep = _sleep_seconds(command)
    if sleep is None:
        say(f"{at}.lifecycle.preStop", f'must be exec ["sleep", N], got {command!r}')

    grace = pod.get("terminationGracePeriodSeconds", DEFAULT_GRACE)
    drain = numbers.get("ORCHESTRATOR_DRAIN_SECONDS")
    if isinstance(grace, int | float) and sleep is not None and drain is not None:
        need = sleep + drain + defaults.exit_grace + SAFETY_MARGIN
        if grace < need:
            say(
                "spec.template.spec.terminationGracePeriodSeconds",
                f"is {grace}, below preStop sleep {sleep:g} + drain {drain:g} "
                f"(ORCHESTRATOR_DRAIN_SECONDS) + exit grace {defaults.exit_grace:g} "
                f"+ margin {SAFETY_MARGIN:g} = {need:g} s",
            )

    port = numbers.get("ORCHESTRATOR_HEALTH_PORT")
    ports = {p.get("name"): p.get("containerPort") for p in container.get("ports") or []}
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = (container.get(probe) or {}).get("httpGet")
        if get is None:
            say(f"{at}.{probe}", f"is missing or not an httpGet (want GET {path})")
            continue
        if get.get("path") != path:
            say(f"{at}.{probe}.httpGet.path", f"is {get.get('path')!r}, want {path!r}")
        named = get.get("port")
        target = ports.get(named) if isinstance(named, str) else named
        if isinstance(named, str) and target is None:
            say(f"{at}.{probe}.httpGet.port", f"{named!r} names no port of the container")
        elif port is not None and target != port:
            say(
                f"{at}.{probe}.httpGet.port",
                f"is {named!r}, not ORCHESTRATOR_HEALTH_PORT {port:g}"
                + (f" (it names port {target})" if target != named else ""),
            )
    return problems


def check(
    docs: list[Doc], defaults: Defaults, version: str = KUBERNETES_VERSION
) -> tuple[list[str], str]:
    """Every problem of the documents, and a one-line summary."""
    problems: list[str] = []
    skipped: list[str] = []
    for doc in docs:
        try:
            problems += schema_problems(doc, version)
        except kubernetes_validate.SchemaNotFoundError:
            skipped.append(name_of(doc))
    workers = [doc for doc in docs if is_worker(doc)]
    if not workers:
        problems.append(f"no Deployment with a container named {WORKER!r} to check the timing of")
    for deployment in workers:
        problems += worker_problems(deployment, defaults)
    summary = (
        f"ok: {len(docs) - len(skipped)} documents valid for Kubernetes {version} (strict), "
        f"{len(workers)} worker Deployment(s) fit preStop + drain + exit grace "
        f"{defaults.exit_grace:g} s + margin {SAFETY_MARGIN:g} s"
    )
    if skipped:
        summary += f"; no schema, not validated: {', '.join(skipped)}"
    return problems, summary


def _pod(doc: Doc) -> Doc:
    spec: Doc = ((doc.get("spec") or {}).get("template") or {}).get("spec") or {}
    return spec


def _sleep_seconds(command: Any) -> float | None:
    if not isinstance(command, list) or len(command) != 2:
        return None
    if str(command[0]).rsplit("/", 1)[-1] != "sleep":
        return None
    try:
        return float(command[1])
    except ValueError:
        return None


# -- command line ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "source", nargs="?", default=str(BASE), help="a kustomize directory, or - for stdin"
    )
    parser.add_argument("--kubernetes-version", default=KUBERNETES_VERSION)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))  # check against the code of this checkout
    try:
        if args.source == "-":
            docs = parse(sys.stdin.read())
        else:
            docs = render(Path(args.source), shutil.which("kubectl"))
    except (RenderError, OSError, yaml.YAMLError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        problems, summary = check(docs, project_defaults(), args.kubernetes_version)
    except kubernetes_validate.utils.VersionNotSupportedError as exc:
        print(f"error: no schemas for Kubernetes {exc.version}", file=sys.stderr)
        return 2
    for problem in problems:
        print(problem)
    if not problems:
        print(summary)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
