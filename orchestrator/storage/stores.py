"""One store per aggregate, each taking the query runner, built together on one pool."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.storage.applications import ApplicationStore
from orchestrator.storage.approvals import ApprovalStore
from orchestrator.storage.config_versions import ConfigVersionStore
from orchestrator.storage.dashboard import DashboardStore
from orchestrator.storage.database import Pool
from orchestrator.storage.dead_letters import DeadLetterStore
from orchestrator.storage.dispatches import DispatchStore
from orchestrator.storage.fleet import FleetStore
from orchestrator.storage.flow import FlowStore
from orchestrator.storage.graph import GraphStore
from orchestrator.storage.jobs import JobStore
from orchestrator.storage.listeners import ListenerStore
from orchestrator.storage.liveness import LivenessStore
from orchestrator.storage.output import OutputStore
from orchestrator.storage.retention import RetentionStore
from orchestrator.storage.rollups import RollupStore
from orchestrator.storage.runner import OnRefused, Queries
from orchestrator.storage.schedules import ScheduleStore
from orchestrator.storage.sessions import SessionStore
from orchestrator.storage.tokens import TokenStore
from orchestrator.storage.usage import UsageStore


@dataclass(frozen=True)
class Stores:
    queries: Queries
    jobs: JobStore
    dispatches: DispatchStore
    dead_letters: DeadLetterStore
    approvals: ApprovalStore
    liveness: LivenessStore
    fleet: FleetStore
    tokens: TokenStore
    listeners: ListenerStore
    sessions: SessionStore
    dashboard: DashboardStore
    config_versions: ConfigVersionStore
    retention: RetentionStore
    rollups: RollupStore
    schedules: ScheduleStore
    flow: FlowStore
    usage: UsageStore
    applications: ApplicationStore
    graph: GraphStore
    output: OutputStore

    @classmethod
    def on(cls, pool: Pool, *, on_refused: OnRefused | None = None) -> Stores:
        """The stores on ``pool``; ``on_refused`` hears of every status change the database's
        guard refuses."""
        queries = Queries(pool, on_refused=on_refused)
        jobs = JobStore(queries)
        applications = ApplicationStore(queries)
        usage = UsageStore(queries)
        return cls(
            queries=queries,
            jobs=jobs,
            dispatches=DispatchStore(queries, jobs),
            dead_letters=DeadLetterStore(queries),
            approvals=ApprovalStore(queries, jobs),
            liveness=LivenessStore(queries, jobs),
            fleet=FleetStore(queries),
            tokens=TokenStore(queries),
            listeners=ListenerStore(queries),
            sessions=SessionStore(queries),
            dashboard=DashboardStore(queries),
            config_versions=ConfigVersionStore(queries),
            retention=RetentionStore(queries),
            rollups=RollupStore(queries),
            schedules=ScheduleStore(queries, applications),
            flow=FlowStore(queries, applications),
            usage=usage,
            applications=applications,
            graph=GraphStore(queries, jobs, usage),
            output=OutputStore(queries),
        )
