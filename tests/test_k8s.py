"""The Kubernetes deliverables: valid offline, fitted to the worker's shutdown, and in step with
the code they deploy (retry config, CLI commands, settings)."""

from __future__ import annotations

import copy
import io
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

import retry_config
from orchestrator.interfaces.cli import build_parser
from orchestrator.settings import Settings
from tests.support import tools
from tests.support.manifests import (
    BASE,
    BASE_DOCS,
    DEFAULTS,
    ROOT,
    check,
    container,
    env,
    find,
)

WORKER = "Deployment/orchestrator-worker"
AT = "spec.template.spec.containers[worker]"


def problems_of(docs: list[dict[str, Any]]) -> list[str]:
    problems: list[str] = check.check(docs, DEFAULTS)[0]
    return problems


# -- the base as it is -----------------------------------------------------------------------


def test_defaults_come_from_the_code() -> None:
    assert (DEFAULTS.drain_seconds, DEFAULTS.health_port, DEFAULTS.exit_grace) == (45, 8080, 5)


def test_base_has_no_problem_without_kubectl() -> None:
    assert sorted(d["kind"] for d in BASE_DOCS) == [
        "ConfigMap", "Deployment", "Job", "PodDisruptionBudget",
    ]  # fmt: skip
    assert problems_of(BASE_DOCS) == []


def test_base_rendered_by_kubectl_has_no_problem() -> None:
    docs = check.render(BASE, tools.find("kubectl"))
    assert problems_of(docs) == []
    assert sorted(d["kind"] for d in docs) == sorted(d["kind"] for d in BASE_DOCS)
    deployment, configmap = find(docs, "Deployment"), find(docs, "ConfigMap")
    assert container(deployment)["image"] == "agent-orchestrator:0.1.0"
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert {"name": configmap["metadata"]["name"]} in [v.get("configMap") for v in volumes]
    # no hash suffix: an edit updates it in place, and the workers reload it without a rollout
    assert configmap["metadata"]["name"] == "orchestrator-retry-config"


def test_main_prints_a_summary_and_exits_0_on_the_base(capsys: pytest.CaptureFixture[str]) -> None:
    assert check.main([str(BASE)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ok: 4 documents valid for Kubernetes 1.30 (strict), 1 worker")
    assert out.count("\n") == 1


def test_main_reads_rendered_yaml_on_stdin_and_exits_1_per_problem(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = copy.deepcopy(BASE_DOCS)
    find(docs, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 30
    monkeypatch.setattr(sys, "stdin", io.StringIO(yaml.safe_dump_all(docs)))
    assert check.main(["-"]) == 1
    assert capsys.readouterr().out.startswith(
        f"{WORKER}: spec.template.spec.terminationGracePeriodSeconds is 30, below"
    )


# -- each mistake is named -------------------------------------------------------------------


def _set_env(name: str, entry: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    def mutate(deployment: dict[str, Any]) -> None:
        entries = container(deployment)["env"]
        entries[:] = [e for e in entries if e["name"] != name] + [{"name": name, **entry}]

    return mutate


def _pod(**fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda deployment: deployment["spec"]["template"]["spec"].update(fields)


def _container(**fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda deployment: container(deployment).update(fields)


def _drop(field: str) -> Callable[[dict[str, Any]], None]:
    return lambda deployment: container(deployment).pop(field)


def _probe_path(probe: str, path: str) -> Callable[[dict[str, Any]], None]:
    return lambda deployment: container(deployment)[probe]["httpGet"].update(path=path)


def _drop_env(name: str) -> Callable[[dict[str, Any]], None]:
    def mutate(deployment: dict[str, Any]) -> None:
        container(deployment)["env"] = [
            e for e in container(deployment)["env"] if e["name"] != name
        ]

    return mutate


def _chain(*steps: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def mutate(deployment: dict[str, Any]) -> None:
        for step in steps:
            step(deployment)

    return mutate


GRACE = f"{WORKER}: spec.template.spec.terminationGracePeriodSeconds"
MISTAKES = {
    "grace 64": (
        _pod(terminationGracePeriodSeconds=64),
        f"{GRACE} is 64, below preStop sleep 5 + drain 45 (ORCHESTRATOR_DRAIN_SECONDS) + exit grace 5 + margin 10 = 65 s",
    ),
    "drain 60 via env": (
        _set_env("ORCHESTRATOR_DRAIN_SECONDS", {"value": "60"}),
        f"{GRACE} is 65, below preStop sleep 5 + drain 60 (ORCHESTRATOR_DRAIN_SECONDS) + exit grace 5 + margin 10 = 80 s",
    ),
    "drain unset, so the Settings default 45, with grace 64": (
        _chain(_drop_env("ORCHESTRATOR_DRAIN_SECONDS"), _pod(terminationGracePeriodSeconds=64)),
        f"{GRACE} is 64, below preStop sleep 5 + drain 45 (ORCHESTRATOR_DRAIN_SECONDS) + exit grace 5 + margin 10 = 65 s",
    ),
    "grace unset, so Kubernetes' 30": (
        lambda d: d["spec"]["template"]["spec"].pop("terminationGracePeriodSeconds"),
        f"{GRACE} is 30, below preStop sleep 5 + drain 45 (ORCHESTRATOR_DRAIN_SECONDS) + exit grace 5 + margin 10 = 65 s",
    ),
    "preStop 30": (
        _container(lifecycle={"preStop": {"exec": {"command": ["sleep", "30"]}}}),
        f"{GRACE} is 65, below preStop sleep 30 + drain 45 (ORCHESTRATOR_DRAIN_SECONDS) + exit grace 5 + margin 10 = 90 s",
    ),
    "preStop through a shell": (
        _container(lifecycle={"preStop": {"exec": {"command": ["sh", "-c", "sleep 5"]}}}),
        f"""{WORKER}: {AT}.lifecycle.preStop must be exec ["sleep", N], got ['sh', '-c', 'sleep 5']""",
    ),
    "no preStop": (
        _drop("lifecycle"),
        f"""{WORKER}: {AT}.lifecycle.preStop must be exec ["sleep", N], got None""",
    ),
    "drain from a ConfigMap": (
        _set_env(
            "ORCHESTRATOR_DRAIN_SECONDS",
            {"valueFrom": {"configMapKeyRef": {"name": "x", "key": "drain"}}},
        ),
        f"{WORKER}: {AT}.env.ORCHESTRATOR_DRAIN_SECONDS must be a literal number, so the timing can be checked",
    ),
    "no liveness probe": (
        _drop("livenessProbe"),
        f"{WORKER}: {AT}.livenessProbe is missing or not an httpGet (want GET /healthz)",
    ),
    "no readiness probe": (
        _drop("readinessProbe"),
        f"{WORKER}: {AT}.readinessProbe is missing or not an httpGet (want GET /readyz)",
    ),
    "liveness on /readyz (would kill a draining pod)": (
        _probe_path("livenessProbe", "/readyz"),
        f"{WORKER}: {AT}.livenessProbe.httpGet.path is '/readyz', want '/healthz'",
    ),
    "readiness on /healthz": (
        _probe_path("readinessProbe", "/healthz"),
        f"{WORKER}: {AT}.readinessProbe.httpGet.path is '/healthz', want '/readyz'",
    ),
    "health port moved but not the container port": (
        _set_env("ORCHESTRATOR_HEALTH_PORT", {"value": "9090"}),
        [
            f"{WORKER}: {AT}.readinessProbe.httpGet.port is 'health', not ORCHESTRATOR_HEALTH_PORT 9090 (it names port 8080)",
            f"{WORKER}: {AT}.livenessProbe.httpGet.port is 'health', not ORCHESTRATOR_HEALTH_PORT 9090 (it names port 8080)",
        ],
    ),
    "probe on a port name the container lacks": (
        lambda d: container(d)["livenessProbe"]["httpGet"].update(port="healthz"),
        f"{WORKER}: {AT}.livenessProbe.httpGet.port 'healthz' names no port of the container",
    ),
    "an unknown field (strict schema)": (
        _container(imagePullPolicyy="Always"),
        f"{WORKER}: spec.template.spec.containers.0: Additional properties are not allowed ('imagePullPolicyy' was unexpected) (Kubernetes 1.30, strict)",
    ),
    "a wrong type (schema)": (
        _pod(terminationGracePeriodSeconds="65"),
        f"{WORKER}: spec.template.spec.terminationGracePeriodSeconds: '65' is not of type 'integer', 'null' (Kubernetes 1.30, strict)",
    ),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_each_mistake_is_reported_as_one_line_naming_the_object_and_field(mistake: str) -> None:
    mutate, expected = MISTAKES[mistake]
    docs = copy.deepcopy(BASE_DOCS)
    mutate(find(docs, "Deployment"))
    assert problems_of(docs) == (expected if isinstance(expected, list) else [expected])


def test_a_document_without_a_worker_is_a_problem() -> None:
    docs = copy.deepcopy(BASE_DOCS)
    container(find(docs, "Deployment"))["name"] = "main"
    assert problems_of(docs) == [
        "no Deployment with a container named 'worker' to check the timing of"
    ]


def test_an_unknown_field_in_another_kind_is_caught_too() -> None:
    docs = copy.deepcopy(BASE_DOCS)
    find(docs, "PodDisruptionBudget")["spec"]["maxUnavaliable"] = 1
    assert problems_of(docs) == [
        "PodDisruptionBudget/orchestrator-worker: spec: Additional properties are not allowed "
        "('maxUnavaliable' was unexpected) (Kubernetes 1.30, strict)"
    ]


def test_a_kind_without_a_schema_is_named_in_the_summary_not_failed() -> None:
    monitor = {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
        "metadata": {"name": "orchestrator"}, "spec": {},
    }  # fmt: skip
    problems, summary = check.check([*BASE_DOCS, monitor], DEFAULTS)
    assert problems == []
    assert summary.endswith("; no schema, not validated: ServiceMonitor/orchestrator")


def test_the_fallback_refuses_what_it_cannot_render(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: [../base]\npatches: []\n")
    with pytest.raises(check.RenderError, match="patches needs kubectl kustomize to render"):
        check.load_resources(tmp_path)
    (tmp_path / "kustomization.yaml").write_text("resources: [../base]\n")
    with pytest.raises(check.RenderError, match=r"resource '\.\./base' is not a file"):
        check.load_resources(tmp_path)
    generator = "configMapGenerator: [{name: c, literals: [a=b], options: {%s}}]\n"
    (tmp_path / "kustomization.yaml").write_text(generator % "labels: {x: y}")
    with pytest.raises(check.RenderError, match="configMapGenerator options needs kubectl"):
        check.load_resources(tmp_path)
    (tmp_path / "kustomization.yaml").write_text(generator % "disableNameSuffixHash: true")
    (made,) = check.load_resources(tmp_path)  # what this reading does anyway
    assert (made["metadata"], made["data"]) == ({"name": "c"}, {"a": "b"})


# -- in step with the code -------------------------------------------------------------------


def test_the_configmap_copy_of_the_retry_config_equals_the_default_file() -> None:
    assert (BASE / "retry_config.toml").read_bytes() == retry_config.DEFAULT_PATH.read_bytes()


def test_the_configmap_holds_a_retry_config_the_loader_accepts(tmp_path: Path) -> None:
    text = find(BASE_DOCS, "ConfigMap")["data"]["retry_config.toml"]
    assert text == retry_config.DEFAULT_PATH.read_text()
    (tmp_path / "retry_config.toml").write_text(text)
    loaded = retry_config.load(tmp_path / "retry_config.toml")
    assert loaded.job_types == retry_config.load().job_types


def test_the_worker_reads_the_retry_config_where_the_configmap_is_mounted() -> None:
    deployment, configmap = find(BASE_DOCS, "Deployment"), find(BASE_DOCS, "ConfigMap")
    path = Path(env(deployment)["ORCHESTRATOR_RETRY_CONFIG"]["value"])
    (volume,) = [
        v
        for v in deployment["spec"]["template"]["spec"]["volumes"]
        if v.get("configMap", {}).get("name") == configmap["metadata"]["name"]
    ]
    (mount,) = [m for m in container(deployment)["volumeMounts"] if m["name"] == volume["name"]]
    assert Path(mount["mountPath"]) == path.parent
    assert "subPath" not in mount  # the kubelet never updates a subPath mount: no reload
    assert path.name in configmap["data"]


def test_the_worker_states_the_drain_and_health_port_it_is_checked_against() -> None:
    values = {name: e.get("value") for name, e in env(find(BASE_DOCS, "Deployment")).items()}
    assert values["ORCHESTRATOR_DRAIN_SECONDS"] == "45"
    assert Settings(drain_seconds=values["ORCHESTRATOR_DRAIN_SECONDS"]).drain_seconds == 45
    assert values["ORCHESTRATOR_HEALTH_PORT"] == "8080"


def test_the_worker_and_the_job_run_real_cli_commands() -> None:
    worker, job = find(BASE_DOCS, "Deployment"), find(BASE_DOCS, "Job")
    assert build_parser().parse_args(container(worker)["args"]).command == "worker"
    assert container(job)["args"] == ["migrate"]
    assert build_parser().parse_args(container(job)["args"]).command == "migrate"


def test_the_migration_job_is_a_one_shot_with_the_workers_image_secret_and_security() -> None:
    worker, job = find(BASE_DOCS, "Deployment"), find(BASE_DOCS, "Job")
    assert job["spec"]["backoffLimit"] >= 1
    assert job["spec"]["ttlSecondsAfterFinished"] > 0
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    assert container(job)["image"] == container(worker)["image"]
    assert env(job)["DATABASE_URL"] == env(worker)["DATABASE_URL"]
    assert container(job)["securityContext"] == container(worker)["securityContext"]
    pod_security = [d["spec"]["template"]["spec"]["securityContext"] for d in (job, worker)]
    assert pod_security[0] == pod_security[1]


def test_the_database_url_comes_from_the_documented_secret_which_is_not_applied() -> None:
    for doc in (find(BASE_DOCS, "Deployment"), find(BASE_DOCS, "Job")):
        ref = env(doc)["DATABASE_URL"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == ("orchestrator-database", "url")
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert "secret.example.yaml" not in kustomization["resources"]
    (secret,) = check.parse((BASE / "secret.example.yaml").read_text())
    assert check.schema_problems(secret) == []
    assert (secret["metadata"]["name"], list(secret["stringData"])) == (
        "orchestrator-database", ["url"],
    )  # fmt: skip


def test_job_type_secrets_are_mounted_where_the_worker_reads_them() -> None:
    worker = find(BASE_DOCS, "Deployment")
    volumes = {v["name"]: v for v in worker["spec"]["template"]["spec"]["volumes"]}
    [mount] = [m for m in container(worker)["volumeMounts"] if m["name"] == "job-secrets"]
    assert Path(mount["mountPath"]) == Settings.model_fields["secrets_dir"].default
    assert mount["readOnly"] is True and "ORCHESTRATOR_SECRETS_DIR" not in env(worker)
    secret = volumes["job-secrets"]["secret"]
    assert secret["secretName"] == "orchestrator-job-secrets" and not secret.get("optional")
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert "job-secrets.example.yaml" not in kustomization["resources"]
    (example,) = check.parse((BASE / "job-secrets.example.yaml").read_text())
    assert check.schema_problems(example) == []
    assert example["metadata"]["name"] == "orchestrator-job-secrets"
    assert set(example["stringData"]) == {"ANTHROPIC_API_KEY", "TELEGRAM_BOT_TOKEN"}


def test_the_pdb_selects_the_workers_only() -> None:
    pdb, worker = find(BASE_DOCS, "PodDisruptionBudget"), find(BASE_DOCS, "Deployment")
    selector = pdb["spec"]["selector"]["matchLabels"]
    assert selector == worker["spec"]["selector"]["matchLabels"]
    assert selector.items() <= worker["spec"]["template"]["metadata"]["labels"].items()
    job_labels = find(BASE_DOCS, "Job")["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= job_labels.items()


def _dockerfile_final_stage() -> list[str]:
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    instructions = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    last_from = max(i for i, line in enumerate(instructions) if line.startswith("FROM "))
    return instructions[last_from:]


def test_the_image_runs_tini_as_pid_1_without_group_signals_as_a_non_root_user() -> None:
    stage = _dockerfile_final_stage()

    def instruction(keyword: str) -> str:
        (line,) = [line for line in stage if line.startswith(keyword + " ")]
        return line.removeprefix(keyword + " ")

    assert json.loads(instruction("ENTRYPOINT")) == ["tini", "--", "orchestrator"]
    assert json.loads(instruction("CMD")) == ["worker"]
    assert instruction("USER") == "10001"
    assert instruction("EXPOSE") == str(Settings().health_port)
    assert "install -y --no-install-recommends tini" in "\n".join(stage)
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "pip install -c constraints.txt .\n" in dockerfile  # pinned, no dev extras


# -- monitoring: the fleet exporter and the scrape ----------------------------------------------

MONITORING = ROOT / "k8s" / "monitoring"
MONITORING_DOCS: list[dict[str, Any]] = check.load_resources(MONITORING)


def test_monitoring_holds_the_exporter_the_scrapes_and_the_rules() -> None:
    kinds = sorted(d["kind"] for d in MONITORING_DOCS)
    assert kinds == ["Deployment", "PodMonitor", "PodMonitor", "PrometheusRule"]


def test_the_exporter_is_valid_and_runs_the_real_command_on_its_setting_s_port() -> None:
    exporter = find(MONITORING_DOCS, "Deployment")
    assert check.schema_problems(exporter) == []
    assert exporter["spec"]["replicas"] == 1
    args = build_parser().parse_args(container(exporter)["args"])
    assert args.command == "exporter" and args.port is None  # the port comes from the env
    port = int(env(exporter)["ORCHESTRATOR_EXPORTER_PORT"]["value"])
    assert port == Settings().exporter_port
    [named] = container(exporter)["ports"]
    assert (named["name"], named["containerPort"]) == ("metrics", port)
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        assert container(exporter)[probe]["httpGet"] == {"path": path, "port": "metrics"}


def test_the_exporter_has_the_workers_database_secret_and_security() -> None:
    worker, exporter = find(BASE_DOCS, "Deployment"), find(MONITORING_DOCS, "Deployment")
    assert env(exporter)["DATABASE_URL"] == env(worker)["DATABASE_URL"]
    assert container(exporter)["securityContext"] == container(worker)["securityContext"]
    assert container(exporter)["image"] == container(worker)["image"]
    pods = [d["spec"]["template"]["spec"]["securityContext"] for d in (exporter, worker)]
    assert pods[0] == pods[1]


def test_the_pod_monitors_scrape_the_ports_the_pods_name() -> None:
    worker, exporter = find(BASE_DOCS, "Deployment"), find(MONITORING_DOCS, "Deployment")
    monitors = {
        d["metadata"]["name"]: d["spec"] for d in MONITORING_DOCS if d["kind"] == "PodMonitor"
    }
    for name, pods in (("orchestrator-workers", worker), ("orchestrator-exporter", exporter)):
        spec = monitors[name]
        labels = pods["spec"]["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()
        [endpoint] = spec["podMetricsEndpoints"]
        assert endpoint["path"] == "/metrics"
        assert endpoint["port"] in [p["name"] for p in container(pods)["ports"]]


# -- the API server (k8s/api) ------------------------------------------------------------------

API_DOCS = check.load_resources(ROOT / "k8s" / "api")


@pytest.mark.parametrize("kind", ["Deployment", "Service", "PodDisruptionBudget"])
def test_the_api_manifests_are_valid(kind: str) -> None:
    assert check.schema_problems(find(API_DOCS, kind)) == []


def test_the_api_deployment_serves_on_its_port_with_probes_the_server_answers() -> None:
    deployment = find(API_DOCS, "Deployment")
    api = container(deployment)
    assert api["args"] == ["serve"]
    assert "serve" in build_parser().parse_args(["serve"]).command
    port = api["ports"][0]
    settings = {name: entry["value"] for name, entry in env(deployment).items() if "value" in entry}
    assert settings["ORCHESTRATOR_API_HOST"] == "0.0.0.0"  # reachable from the Service
    assert int(settings["ORCHESTRATOR_API_PORT"]) == port["containerPort"]
    assert Settings(**{k.removeprefix("ORCHESTRATOR_").lower(): v for k, v in settings.items()
                       if k.startswith("ORCHESTRATOR_")})  # fmt: skip
    assert api["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port["name"]}
    assert api["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port["name"]}
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    wait_max = float(settings["ORCHESTRATOR_API_WAIT_MAX_SECONDS"])
    assert grace > 5 + wait_max  # preStop, then the longest long-poll, then SIGKILL
    assert env(deployment)["DATABASE_URL"] == env(find(BASE_DOCS, "Deployment"))["DATABASE_URL"]


def test_the_api_service_and_budget_select_the_api_pods() -> None:
    labels = find(API_DOCS, "Deployment")["spec"]["template"]["metadata"]["labels"]
    service, budget = find(API_DOCS, "Service"), find(API_DOCS, "PodDisruptionBudget")
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    worker = find(BASE_DOCS, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert not service["spec"]["selector"].items() <= worker.items()  # never the workers
