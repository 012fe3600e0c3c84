"""Autoscaling (k8s/autoscaling/): a KEDA ScaledObject with the fields KEDA reads, scaling the
base's worker Deployment on a query that is fleet.sql's scaling_load, word for word, and that
counts, on a real database, the jobs due and waiting plus the jobs running."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from typing import Any

import psycopg
import yaml

from orchestrator.settings import Settings
from orchestrator.storage.queries import QUERIES
from tests.support import manifests, tools

AUTOSCALING = manifests.ROOT / "k8s" / "autoscaling"
SCALED: dict[str, Any] = yaml.safe_load((AUTOSCALING / "scaledobject.yaml").read_text())
#: KEDA 2.x: ScaledObjectSpec and ScaleTriggers (apis/keda/v1alpha1), and the PostgreSQL
#: scaler's metadata (keda.sh/docs/latest/scalers/postgresql).
SPEC_FIELDS = {
    "scaleTargetRef", "pollingInterval", "initialCooldownPeriod", "cooldownPeriod",
    "idleReplicaCount", "minReplicaCount", "maxReplicaCount", "advanced", "triggers", "fallback",
}  # fmt: skip
TARGET_FIELDS = {"name", "apiVersion", "kind", "envSourceContainerName"}
TRIGGER_FIELDS = {"type", "name", "useCachedMetrics", "metadata", "authenticationRef", "metricType"}
POSTGRESQL_METADATA = {
    "query", "targetQueryValue", "activationTargetQueryValue", "connectionFromEnv",
    "host", "port", "userName", "dbName", "sslmode", "passwordFromEnv",
}  # fmt: skip
#: Connections a worker holds besides its pool: fetch, completions, heartbeats, listener
#: (docs/configuration.md, ORCHESTRATOR_POOL_MIN_SIZE).
OWN_CONNECTIONS = 4
#: PostgreSQL's default max_connections, less its superuser_reserved_connections.
DEFAULT_CONNECTIONS = 100 - 3


def trigger() -> dict[str, Any]:
    (only,) = SCALED["spec"]["triggers"]
    return dict(only)


def test_the_scaledobject_has_only_fields_keda_reads() -> None:
    assert (SCALED["apiVersion"], SCALED["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert set(SCALED) == {"apiVersion", "kind", "metadata", "spec"}
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", SCALED["metadata"]["name"])
    assert set(SCALED["spec"]) <= SPEC_FIELDS
    assert set(SCALED["spec"]["scaleTargetRef"]) <= TARGET_FIELDS
    assert set(trigger()) <= TRIGGER_FIELDS and trigger()["type"] == "postgresql"
    metadata = trigger()["metadata"]
    assert {"query", "targetQueryValue", "connectionFromEnv"} <= set(metadata)
    assert set(metadata) <= POSTGRESQL_METADATA
    # The CRD declares metadata as map[string]string: a bare number is refused.
    assert all(isinstance(value, str) for value in metadata.values())
    assert float(metadata["targetQueryValue"]) > 0


def test_the_scale_down_behaviour_is_a_valid_autoscaling_v2_behaviour() -> None:
    """KEDA hands advanced.horizontalPodAutoscalerConfig.behavior to the HPA it creates: it is
    validated here against Kubernetes' own schema."""
    spec = SCALED["spec"]
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "keda-hpa-" + SCALED["metadata"]["name"]},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x"},
            "minReplicas": spec["minReplicaCount"],
            "maxReplicas": spec["maxReplicaCount"],
            "behavior": spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
        },
    }
    assert manifests.check.schema_problems(hpa) == []
    (policy,) = hpa["spec"]["behavior"]["scaleDown"]["policies"]
    assert (policy["type"], policy["value"]) == ("Pods", 1)  # one drain at a time


def test_it_scales_the_worker_deployment_and_reads_the_workers_database_url() -> None:
    deployment = manifests.find(manifests.BASE_DOCS, "Deployment")
    target = SCALED["spec"]["scaleTargetRef"]
    assert target["name"] == deployment["metadata"]["name"]
    assert target.get("kind", "Deployment") == "Deployment"
    # KEDA resolves connectionFromEnv in the target's (first) container: the worker.
    assert manifests.container(deployment)["name"] == "worker"
    assert trigger()["metadata"]["connectionFromEnv"] in manifests.env(deployment)
    assert manifests.env(deployment)["DATABASE_URL"]["valueFrom"]["secretKeyRef"]


def test_one_worker_per_concurrency_worth_of_load() -> None:
    deployment = manifests.find(manifests.BASE_DOCS, "Deployment")
    assert "ORCHESTRATOR_WORKER_CONCURRENCY" not in manifests.env(deployment)
    assert "--concurrency" not in manifests.container(deployment)["args"]
    per_worker = float(trigger()["metadata"]["targetQueryValue"])
    assert per_worker == Settings().worker_concurrency
    assert trigger().get("metricType", "AverageValue") == "AverageValue"  # load / workers


def test_the_replica_bounds_keep_the_maintenance_and_fit_the_database() -> None:
    spec, settings = SCALED["spec"], Settings()
    pdb = manifests.find(manifests.BASE_DOCS, "PodDisruptionBudget")
    assert spec["minReplicaCount"] > pdb["spec"]["maxUnavailable"]  # a worker through a drain
    assert "idleReplicaCount" not in spec  # never 0: the sweep runs in the workers
    assert spec["minReplicaCount"] <= spec["maxReplicaCount"]
    per_worker = settings.pool_max_size + OWN_CONNECTIONS
    assert spec["maxReplicaCount"] * per_worker <= DEFAULT_CONNECTIONS


def test_the_query_is_the_named_query_word_for_word() -> None:
    assert trigger()["metadata"]["query"] == QUERIES["scaling_load"]


def test_the_overlay_renders_the_base_without_replicas_and_passes_the_check() -> None:
    docs = manifests.check.render(AUTOSCALING, tools.find("kubectl"))
    problems, summary = manifests.check.check(docs, manifests.DEFAULTS)
    assert problems == []
    assert summary.endswith("; no schema, not validated: ScaledObject/orchestrator-worker")
    deployment = manifests.find(docs, "Deployment")
    assert "replicas" not in deployment["spec"]  # applying never resets the autoscaler's choice
    assert manifests.find(docs, "ScaledObject") == SCALED
    assert sorted(d["kind"] for d in docs) == sorted(
        [*(d["kind"] for d in manifests.BASE_DOCS), "ScaledObject"]
    )


# -- the query, on a real database -------------------------------------------------------------

INSERT = """
INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts, max_retries, trace_id,
                      run_at, next_retry_at, lease_token, heartbeat_at, finished_at)
SELECT gen_random_uuid(), 'sleeper', %(status)s, '1', %(queue)s, 3, 3, 't',
       now() + %(due_in)s, CASE WHEN %(status)s = 'RETRY' THEN now() + %(due_in)s END,
       CASE WHEN %(status)s = 'RUNNING' THEN gen_random_uuid() END,
       CASE WHEN %(status)s = 'RUNNING' THEN now() - %(stale)s END,
       CASE WHEN %(status)s IN ('COMPLETED', 'FAILED', 'CANCELLED') THEN now() END
  FROM generate_series(1, %(n)s)
"""
DUE, LATER = timedelta(minutes=-5), timedelta(hours=1)
#: (status, how many, due in, heartbeat age, counted)
JOBS = [
    ("PENDING", 3, DUE, timedelta(0), True),
    ("PENDING", 4, LATER, timedelta(0), False),  # scheduled for later
    ("RETRY", 5, DUE, timedelta(0), True),
    ("RETRY", 6, LATER, timedelta(0), False),  # backing off
    ("RUNNING", 7, DUE, timedelta(0), True),
    ("RUNNING", 2, DUE, timedelta(hours=1), True),  # zombies, until the sweep moves them
    ("WAITING_APPROVAL", 8, DUE, timedelta(0), False),  # waits for a human, in no slot
    ("COMPLETED", 9, DUE, timedelta(0), False),
    ("FAILED", 10, DUE, timedelta(0), False),
    ("CANCELLED", 11, DUE, timedelta(0), False),
]


async def load(db: psycopg.AsyncConnection[Any]) -> int:
    cur = await db.execute(trigger()["metadata"]["query"])
    (value,) = await cur.fetchall()
    return int(value[0])


async def test_the_query_counts_jobs_due_and_waiting_plus_jobs_running(
    db: psycopg.AsyncConnection[Any],
) -> None:
    assert await load(db) == 0
    for n, (status, count, due_in, stale, _) in enumerate(JOBS):
        params = {"status": status, "n": count, "due_in": due_in, "stale": stale}
        await db.execute(INSERT, {**params, "queue": f"q{n % 3}"})  # every queue counts
    assert await load(db) == sum(count for _, count, _, _, counted in JOBS if counted) == 17
    await db.execute("UPDATE orc_jobs SET status = 'RUNNING', lease_token = gen_random_uuid() "
                     "WHERE status = 'PENDING' AND run_at > now()")  # fmt: skip
    assert await load(db) == 17 + 4  # the later ones were claimed: they run now


async def test_the_query_can_read_only_the_partial_indexes_of_live_jobs(
    db: psycopg.AsyncConnection[Any],
) -> None:
    """With sequential scans off, each count scans a partial index that leaves out COMPLETED
    jobs, the bulk of the table (bench/scaling_load.py times it among 1,000,000 finished jobs:
    index-only scans of the first three)."""
    async with db.transaction():
        await db.execute("SET LOCAL enable_seqscan = off")
        cur = await db.execute(f"EXPLAIN (FORMAT JSON) {trigger()['metadata']['query']}")
        (row,) = await cur.fetchall()
    plan = json.dumps(row[0])
    assert "Seq Scan" not in plan
    assert len(re.findall(r'"Index Name"', plan)) == 3
    assert set(re.findall(r'"Index Name": "(\w+)"', plan)) <= {
        "orc_jobs_pending_run_at", "orc_jobs_retry_due", "orc_jobs_running_heartbeat",
        "orc_jobs_unfinished_status_id",  # (status, id) WHERE status NOT IN (RUNNING, COMPLETED)
    }  # fmt: skip
