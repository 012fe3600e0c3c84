"""The operator's side of the metrics (k8s/monitoring/): the alert rules, checked and unit-tested
by the real promtool, the PrometheusRule that carries them, the Grafana dashboard, and every
expression of either naming only metrics and labels the project exports, counters through
rate() or increase() and gauges never."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import tools
from tests.support.metrics_catalogue import Series, exported, series
from tests.support.promql import analyse

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "k8s" / "monitoring"
RULES: dict[str, Any] = yaml.safe_load((MONITORING / "rules.yaml").read_text())
RULE_TESTS: dict[str, Any] = yaml.safe_load((MONITORING / "rules_test.yaml").read_text())
DASHBOARD: dict[str, Any] = json.loads((MONITORING / "dashboard.json").read_text())
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()
#: Labels Prometheus gives every scraped series, whatever the scrape configuration.
TARGET_LABELS = frozenset({"job", "instance"})
SEVERITIES = ("P1", "P2", "P3")


@pytest.fixture(scope="module")
def promtool() -> str:
    return tools.find("promtool")


def run(*args: str, cwd: Path = MONITORING) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, check=False, timeout=120)


def rules() -> list[dict[str, Any]]:
    return [rule for group in RULES["groups"] for rule in group["rules"]]


def alerts() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for rule in rules() if "alert" in rule}


# -- the rules, through promtool ---------------------------------------------------------------


def test_promtool_checks_the_rules_file(promtool: str) -> None:
    done = run(promtool, "check", "rules", "rules.yaml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout


def test_promtool_unit_tests_pass(promtool: str) -> None:
    done = run(promtool, "test", "rules", "rules_test.yaml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_alert_has_input_that_fires_it_and_input_that_must_not() -> None:
    cases: dict[str, set[bool]] = {name: set() for name in alerts()}
    for case in RULE_TESTS["tests"]:
        for check in case["alert_rule_test"]:
            cases[check["alertname"]].add(bool(check["exp_alerts"]))
    assert {name: seen for name, seen in cases.items() if seen != {True, False}} == {}


@pytest.mark.parametrize("broken", ["never fires", "always fires"])
@pytest.mark.parametrize("name", sorted(alerts()))
def test_the_unit_tests_catch_an_alert_that(
    name: str, broken: str, promtool: str, tmp_path: Path
) -> None:
    """Each alert's unit tests fail when its rule is replaced by one that never fires, or by
    one that always does: they can fail."""
    mutated = yaml.safe_load((MONITORING / "rules.yaml").read_text())
    for group in mutated["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == name:
                rule["expr"] = "vector(1) < 0" if broken == "never fires" else "vector(1)"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(mutated))
    own = [
        case
        for case in RULE_TESTS["tests"]
        if any(check["alertname"] == name for check in case["alert_rule_test"])
    ]
    (tmp_path / "rules_test.yaml").write_text(yaml.safe_dump({**RULE_TESTS, "tests": own}))
    done = run(promtool, "test", "rules", "rules_test.yaml", cwd=tmp_path)
    assert done.returncode == 1, done.stdout
    assert f"alertname: {name}," in done.stderr


def test_the_prometheusrule_carries_the_rules_file() -> None:
    docs = list(yaml.safe_load_all((MONITORING / "prometheusrule.yaml").read_text()))
    assert len(docs) == 1
    (rule,) = docs
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert set(rule) == {"apiVersion", "kind", "metadata", "spec"}
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", rule["metadata"]["name"])
    assert rule["spec"] == RULES


def test_each_rule_has_the_fields_prometheus_and_the_operator_accept() -> None:
    assert set(RULES) == {"groups"}
    duration = re.compile(r"([0-9]+(ms|[smhdwy]))+")
    for group in RULES["groups"]:
        assert set(group) <= {"name", "interval", "rules", "limit"}
        for rule in group["rules"]:
            assert ("alert" in rule) != ("record" in rule), rule
            allowed = {"alert", "expr", "for", "labels", "annotations"}
            assert set(rule) <= (allowed if "alert" in rule else {"record", "expr", "labels"})
            assert duration.fullmatch(rule.get("for", "0s")), rule


@pytest.mark.parametrize("name", sorted(alerts()))
def test_each_alert_has_a_severity_a_summary_and_a_runbook_in_the_operations_guide(
    name: str,
) -> None:
    rule = alerts()[name]
    severity = rule["labels"]["severity"]
    assert severity in SEVERITIES and set(rule["labels"]) == {"severity"}
    assert set(rule["annotations"]) == {"summary", "runbook"}
    assert rule["annotations"]["runbook"] == f"docs/operations.md#{name.lower()}"
    section = OPERATIONS.split(f"\n### {name}\n", 1)[1].split("\n#", 1)[0].strip()
    assert section.startswith(f"**{severity}**"), section[:80]
    assert "Runbook:" in section


def test_the_specs_three_alerts_are_there() -> None:
    every = alerts()
    retrying = every["OrchestratorRetryingShareHigh"]
    assert "orchestrator_jobs_retrying_ratio" in retrying["expr"] and retrying["for"] == "15m"
    growing = every["OrchestratorDeadLettersGrowing"]["expr"]
    assert "growth_1h[1d] offset 1h" in growing  # against the tenant's own recent rate
    refused = every["OrchestratorTransitionsRefused"]
    assert 'orchestrator_transitions_refused_total{refused_by="database"}' in refused["expr"]
    assert refused["labels"]["severity"] == "P1"


def test_every_runbook_command_is_a_real_cli_command() -> None:
    from orchestrator.interfaces.cli import build_parser

    section = OPERATIONS.split("\n## Alerts\n", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"`orchestrator ([^`]+)`", section)
    assert len(commands) >= 5
    for command in commands:
        words = command.replace("ID", "01a1fd7a-e744-74fa-993d-cbf93082d8a1").split()
        build_parser().parse_args(words)  # SystemExit (2) on anything it does not know


# -- every expression names exported metrics ---------------------------------------------------


def problems(expr: str, known: dict[str, Series], legend: str = "") -> list[str]:
    """What is wrong with the metrics and labels an expression (or its legend) names."""
    found = analyse(expr)
    wrong, labels = [], set(TARGET_LABELS)
    for selector in found.selectors:
        metric = known.get(selector.name or "")
        if metric is None:
            wrong.append(f"{selector.name} is not exported")
            continue
        labels |= metric.labels
        unknown = selector.matchers - metric.labels - TARGET_LABELS
        if unknown:
            wrong.append(f"{selector.name} has no label {sorted(unknown)}")
        if metric.counts and not selector.in_rate:
            wrong.append(f"{selector.name} is a {metric.kind} read without rate() or increase()")
        if not metric.counts and selector.in_rate:
            wrong.append(f"{selector.name} is a gauge read through rate() or increase()")
    named = found.grouping | set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
    if named - labels:
        wrong.append(f"no series here has the label(s) {sorted(named - labels)}")
    return wrong


def known_series() -> dict[str, Series]:
    """The exported series, and the rules' recorded ones (with the labels their expressions
    keep)."""
    known = series(exported())
    for rule in rules():
        if "record" in rule:
            found = analyse(rule["expr"])
            labels = frozenset().union(*(known[s.name or ""].labels for s in found.selectors))
            known[rule["record"]] = Series(rule["record"], "gauge", labels, False)
    return known


def test_the_catalogue_names_counters_with_total_and_nothing_else() -> None:
    for name, metric in exported().items():
        assert name.startswith("orchestrator_")
        assert name.endswith("_total") == (metric.kind == "counter"), name


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r.get("alert") or r["record"])
def test_each_rule_names_exported_metrics_and_labels(rule: dict[str, Any]) -> None:
    assert problems(rule["expr"], known_series()) == []


def test_the_check_finds_each_kind_of_mistake() -> None:
    known = known_series()
    assert problems('sum by (tenant) (orchestrator_dead_letters{state="recorded"})', known) == []
    assert problems("orchestrator_dead_letter", known) == [
        "orchestrator_dead_letter is not exported"
    ]
    assert problems('orchestrator_jobs{tennant="a"}', known) == [
        "orchestrator_jobs has no label ['tennant']"
    ]
    assert problems("orchestrator_attempts_started_total > 0", known) == [
        "orchestrator_attempts_started_total is a counter read without rate() or increase()"
    ]
    assert problems("rate(orchestrator_queue_depth[5m])", known) == [
        "orchestrator_queue_depth is a gauge read through rate() or increase()"
    ]
    assert problems("sum by (le) (orchestrator_attempt_duration_seconds_count)", known) == [
        "orchestrator_attempt_duration_seconds_count is a histogram read without rate() or increase()",
        "no series here has the label(s) ['le']",
    ]
    assert problems("max by (queue) (orchestrator_zombies)", known, "{{pod}}") == [
        "no series here has the label(s) ['pod', 'queue']"
    ]
    assert problems("orchestrator_attempt_duration_seconds", known) == [
        "orchestrator_attempt_duration_seconds is not exported"  # a histogram: _bucket and co.
    ]


# -- the dashboard -----------------------------------------------------------------------------


def dashboard_targets() -> list[tuple[str, str, str]]:
    """(panel title, expression, legend) of every query of the dashboard."""
    return [
        (panel["title"], target["expr"], target.get("legendFormat", ""))
        for panel in DASHBOARD["panels"]
        for target in panel.get("targets", [])
    ]


def as_promql(expr: str) -> str:
    """A dashboard query with Grafana's variables replaced: $__rate_interval and its kin by a
    duration, the dashboard's own (inside regex matchers) by a regex."""
    return re.sub(r"\$\{?(\w+)\}?", lambda m: "5m" if m[1].startswith("__") else ".*", expr)


def test_the_dashboard_is_grafana_json_with_unique_panels_on_the_datasource_variable() -> None:
    assert DASHBOARD["uid"] and DASHBOARD["title"] and DASHBOARD["schemaVersion"] >= 36
    ids = [panel["id"] for panel in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    (source,) = [v for v in DASHBOARD["templating"]["list"] if v["type"] == "datasource"]
    assert source["query"] == "prometheus"
    for panel in DASHBOARD["panels"]:
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": f"${{{source['name']}}}"}
            assert panel["targets"], panel["title"]
    variables = {v["name"] for v in DASHBOARD["templating"]["list"]}
    for _, expr, _ in dashboard_targets():
        assert set(re.findall(r"\$\{?(\w+)", expr)) <= variables | {"__rate_interval"}, expr


def test_promtool_parses_every_dashboard_query(promtool: str, tmp_path: Path) -> None:
    records = [
        {"record": f"dashboard:query_{n}", "expr": as_promql(expr)}
        for n, (_, expr, _) in enumerate(dashboard_targets())
    ]
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]}))
    done = run(promtool, "check", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("title", "expr", "legend"), dashboard_targets(), ids=[t[0] for t in dashboard_targets()]
)
def test_each_dashboard_query_names_exported_metrics_and_labels(
    title: str, expr: str, legend: str
) -> None:
    assert problems(as_promql(expr), series(exported()), legend) == []


def test_each_dashboard_variable_reads_an_exported_label() -> None:
    known = series(exported())
    for variable in DASHBOARD["templating"]["list"]:
        if variable["type"] == "query":
            metric, label = re.fullmatch(
                r"label_values\((\w+), (\w+)\)", variable["query"]["query"]
            ).groups()
            assert label in known[metric].labels, variable["name"]


def test_the_dashboard_shows_what_the_fleet_needs() -> None:
    """Queue depth, throughput, retry share, dead letters per tenant, attempt latency, tokens
    per model: each is read by some panel."""
    exprs = [expr for _, expr, _ in dashboard_targets()]

    def shown(pattern: str) -> bool:
        return any(re.search(pattern, expr) for expr in exprs)

    assert shown(r"orchestrator_queue_depth\b")
    assert shown(r"rate\(orchestrator_attempts_finished_total\b")
    assert shown(r"orchestrator_jobs_retrying_ratio")
    assert shown(r"sum by \(tenant\) \(.*orchestrator_dead_letters\b")
    assert shown(r"histogram_quantile\(.*orchestrator_attempt_duration_seconds_bucket")
    assert shown(r"by \(model, kind\) \(rate\(orchestrator_llm_tokens_total")
