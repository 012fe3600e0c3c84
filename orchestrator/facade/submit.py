"""A submit: the job spec (Graphile Worker's ``addJob`` options), the row it becomes, checked
against the job types and the retry config in effect, and the write of the rows."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

import psycopg
from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from orchestrator.domain import dependencies, events
from orchestrator.domain.dependencies import MAX_PARENTS, ParentRef
from orchestrator.domain.errors import ConfigError, InvalidPayload, SubmitError, UnknownJobType
from orchestrator.domain.flow import Flow, flow_of
from orchestrator.domain.ids import uuid7
from orchestrator.domain.job_types import JobType
from orchestrator.domain.models import SubmitResult
from orchestrator.domain.schedules import KEY_PREFIX, key_refusal
from orchestrator.domain.states import CLAIMABLE, Status
from orchestrator.domain.storable import Text
from orchestrator.domain.traceparent import normalized, trace_id_of
from orchestrator.facade.lifecycle import Lifecycle
from orchestrator.settings import Settings
from orchestrator.storage.applications import application_of
from orchestrator.storage.jobs import TASK_PREFIX
from orchestrator.storage.producers import Producers
from retry_config import MAX_VALUE, FlowLimit, LiveConfig
from retry_config.names import (
    MAX_TENANT,
    named_tenant,
    open_queue,
    queue_refusal,
    tenant_refusal,
)

if TYPE_CHECKING:
    from orchestrator.runtime.tracing import Tracing

JobKeyMode = Literal["replace", "preserve_run_at", "unsafe_dedupe"]
#: The longest queue name and job key a submit takes (Graphile Worker's API reads them too).
MAX_QUEUE = 128
MAX_JOB_KEY = 512


#: A W3C traceparent, as version 00 writes it (orchestrator.domain.traceparent).
Traceparent = Annotated[Text, AfterValidator(normalized)]


def _not_a_tick(key: str) -> str:
    """``key``, or ValueError when it is a schedule's tick's (a pydantic validator)."""
    reason = key_refusal(key)
    if reason is not None:
        raise ValueError(reason)
    return key


class JobSpec(BaseModel):
    """One job to submit; the options follow Graphile Worker's ``addJob``. Every bound is what
    the job table's columns hold, so nothing valid here can fail in the database."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_type: Text
    payload: Any = None
    agent_id: Text | None = Field(None, max_length=200)
    run_at: AwareDatetime | None = None
    priority: int = Field(0, ge=-(2**31) + 1, le=2**31 - 1, description="Lower runs first.")
    #: Not one the orchestrator reserves (retry_config.names: the maintenance queue).
    queue: Annotated[Text, AfterValidator(open_queue)] | None = Field(
        None, min_length=1, max_length=MAX_QUEUE
    )
    max_retries: int | None = Field(None, ge=0, le=MAX_VALUE)
    #: Not in the schedules' namespace (``schedule/...``): a tick's key is its schedule's own.
    job_key: Annotated[Text, AfterValidator(_not_a_tick)] | None = Field(
        None, min_length=1, max_length=MAX_JOB_KEY
    )
    job_key_mode: JobKeyMode = "replace"
    timeout_seconds: int | None = Field(None, gt=0, le=MAX_VALUE)
    trace_id: Text | None = Field(None, min_length=1, max_length=200)
    #: Whose job it is (docs/contracts.md, "Tenants"); none by default; never empty or blank.
    tenant_id: Annotated[Text, AfterValidator(named_tenant)] | None = Field(
        None, min_length=1, max_length=MAX_TENANT
    )
    #: The W3C trace context the job continues: its trace id becomes the job's trace_id.
    traceparent: Traceparent | None = None
    #: What the job costs in its limit's units (e.g. tokens; docs/flow-control.md); unset: its
    #: type's estimate, or 1.
    cost: int | None = Field(None, ge=0, le=MAX_VALUE)
    #: The most tokens the job's LLM calls may spend, all kinds counted; past it the next call
    #: fails the job with TOKEN_BUDGET_EXHAUSTED (docs/configuration.md). None: no budget.
    token_budget: int | None = Field(None, gt=0, le=2**63 - 1)
    #: The jobs this one waits for (docs/workflows.md): job ids, indexes of earlier jobs of
    #: the same batch, or either with its policy (``{"job": ..., "on_failure": "run"}``).
    depends_on: tuple[ParentRef, ...] = Field((), max_length=MAX_PARENTS)

    @model_validator(mode="after")
    def _one_trace(self) -> JobSpec:
        if self.trace_id and self.traceparent and self.trace_id != trace_id_of(self.traceparent):
            raise ValueError("trace_id differs from the trace id of traceparent")
        return self


def job_spec(**options: Any) -> JobSpec:
    """A JobSpec from keyword options; what is wrong with them, all of it, as one SubmitError."""
    try:
        return JobSpec(**options)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
            for e in exc.errors(include_url=False)
        )
        raise SubmitError(f"invalid submit options: {problems}") from None


class JobRows:
    """A spec becomes the row the job store writes. No I/O: the notifier's notices and the
    schedules' runs are built into rows before the database is open, and checked at start-up."""

    def __init__(
        self, job_types: dict[str, JobType], config: LiveConfig, settings: Settings
    ) -> None:
        self._job_types = job_types
        self._config = config
        self._settings = settings

    def row(self, spec: JobSpec) -> dict[str, Any]:
        job_type = self._job_types.get(spec.job_type)
        if job_type is None:
            raise UnknownJobType(spec.job_type, list(self._job_types))
        retry_config = self._config.current
        config = retry_config.for_type(spec.job_type)
        queue = self._queue_of(spec, job_type)
        payload = job_type.payload_json(spec.payload)
        flow = _flow_of(spec, job_type, payload, retry_config.limit_of(spec.job_type))
        size = len(json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode())
        if size > self._settings.max_payload_bytes:
            raise InvalidPayload(
                spec.job_type,
                f"payload: {size} bytes, over the limit of {self._settings.max_payload_bytes} "
                "(ORCHESTRATOR_MAX_PAYLOAD_BYTES)",
            )
        return {
            "id": str(uuid7()),
            "job_type": spec.job_type,
            "payload": payload,
            "queue": queue,
            "priority": spec.priority,
            "run_at": spec.run_at.isoformat() if spec.run_at else None,
            "max_attempts": config.worker_max_attempts,
            "max_retries": config.app_max_retries if spec.max_retries is None else spec.max_retries,
            "job_key": spec.job_key,
            "job_key_mode": spec.job_key_mode,
            "agent_id": spec.agent_id,
            "trace_id": spec.trace_id
            or (trace_id_of(spec.traceparent) if spec.traceparent else None)
            or uuid.uuid4().hex,
            "traceparent": spec.traceparent,
            "tenant_id": spec.tenant_id,
            # Stored effective, so the claim can stamp the attempt's deadline (the backstop).
            "timeout_seconds": spec.timeout_seconds or config.job_timeout_seconds,
            "flow_limit": flow and flow.limit,
            "flow_template": flow and flow.template,
            "flow_share_by": flow and flow.share_by,
            "flow_cost": flow and flow.cost,
        }

    def children(
        self, specs: Sequence[JobSpec | dict[str, Any]], tenant_id: str | None, trace_id: str
    ) -> list[dict[str, Any]]:
        """A step's child specs as rows (checkpoints.children): of the parent's tenant (a spec
        naming another is refused) and, unless a spec says, of its trace, each with its token
        budget (None: none). A child's identity is its step's, so a spec may not bring a job
        key."""
        checked = []
        for n, given in enumerate(specs):
            spec = given if isinstance(given, JobSpec) else job_spec(**given)
            if spec.tenant_id is not None and spec.tenant_id != tenant_id:
                raise SubmitError(
                    f"child {n}: tenant_id {spec.tenant_id!r} is not its parent's; a child is of "
                    "its parent's tenant"
                )
            if spec.job_key is not None:
                raise SubmitError(f"child {n}: a spawned job takes no job_key")
            traced = spec.trace_id is None and spec.traceparent is None
            update = {"tenant_id": tenant_id, **({"trace_id": trace_id} if traced else {})}
            checked.append(spec.model_copy(update=update))
        rows = [{**self.row(spec), "token_budget": spec.token_budget} for spec in checked]
        if any(spec.depends_on for spec in checked):
            self.depend(rows, checked)
        return rows

    def depend(self, rows: list[dict[str, Any]], specs: Sequence[JobSpec]) -> None:
        """Each row's parents (``depends_on``), a batch's indexes resolved to its jobs' ids,
        each policy its type's unless the spec's (SubmitError when a spec names them wrong)."""
        resolved = dependencies.edges(
            [spec.depends_on for spec in specs],
            [row["id"] for row in rows],
            [spec.job_key is not None for spec in specs],
            [self._job_types[spec.job_type].on_parent_failure for spec in specs],
        )
        for row, parents in zip(rows, resolved, strict=True):
            row["depends_on"] = parents

    def _queue_of(self, spec: JobSpec, job_type: JobType) -> str:
        """An external type's jobs stay on its queue, and no other job goes there: in-process
        workers never take those queues, external workers take only them. No job goes on a
        queue the orchestrator reserves, not even by its type's (the spec's own is checked by
        JobSpec; a type's, by the config's check at start-up and at each reload: this is the
        last guard, for a submit before either ran)."""
        own = self._config.current.queue_of(spec.job_type)
        reserved = queue_refusal(spec.queue or own)
        if reserved is not None:
            whose = "" if spec.queue else f" (the queue of job type {spec.job_type!r})"
            raise SubmitError(f"queue: {reserved}{whose}")
        if spec.queue is None or spec.queue == own:
            return own
        if job_type.is_external:
            raise SubmitError(
                f"queue: job type {spec.job_type!r} is external; its jobs go on its own queue "
                f"{own!r}"
            )
        external = {q: name for name, q in self._config.current.external.items()}
        if spec.queue in external:
            raise SubmitError(
                f"queue: {spec.queue!r} is the queue of the external job type "
                f"{external[spec.queue]!r}"
            )
        return spec.queue

    def producers(self) -> Producers:
        """What ``migrate`` publishes for producers writing in SQL: every job type with the
        defaults a submit gives its jobs, and Graphile Worker's API's settings when it is on
        (docs/graphile.md)."""
        current = self._config.current
        types = []
        for name, job_type in sorted(self._job_types.items()):
            config = current.for_type(name)
            types.append({
                "job_type": name, "queue": current.queue_of(name),
                "max_attempts": config.worker_max_attempts, "max_retries": config.app_max_retries,
                "timeout_seconds": config.job_timeout_seconds, "external": job_type.is_external,
            })  # fmt: skip
        return Producers(
            types,
            self._graphile() if self._settings.graphile_compat else None,
            application_of(self._settings),
        )

    def _graphile(self) -> dict[str, Any]:
        """What Graphile Worker's API reads of this code: the tenant its jobs get, the payload
        limit, the state machine's names, the dispatches' task prefix, the schedules' keys, the
        longest error message a failure stores, the longest queue name and job key."""
        tenant = self._settings.graphile_tenant
        reason = None if tenant is None else tenant_refusal(tenant)
        if reason is not None:
            raise ConfigError(f"ORCHESTRATOR_GRAPHILE_TENANT: {reason}")
        return {
            "tenant_id": tenant,
            "max_payload_bytes": self._settings.max_payload_bytes,
            "initial_status": Status.PENDING.value,
            "waiting": sorted(s.value for s in CLAIMABLE),
            "cancelled": Status.CANCELLED.value,
            "completed": Status.COMPLETED.value,
            "failed": Status.FAILED.value,
            "task_prefix": TASK_PREFIX,
            "reserved_key_prefix": KEY_PREFIX,
            "max_message": events.MAX_MESSAGE,
            "max_queue": MAX_QUEUE,
            "max_job_key": MAX_JOB_KEY,
        }


class Submitter:
    """Writes the specs' rows: each spec becomes a row before anything is sent, so one that is
    wrong stops the batch; with tracing, each job gets a span of its own."""

    def __init__(self, rows: JobRows, lifecycle: Lifecycle, tracing: Tracing | None) -> None:
        self._rows = rows
        self._lifecycle = lifecycle
        self._tracing = tracing

    async def submit(
        self, specs: Sequence[JobSpec], connection: psycopg.AsyncConnection[Any] | None
    ) -> list[SubmitResult]:
        rows = [self._rows.row(spec) for spec in specs]
        if not rows:
            return []
        if any(spec.depends_on for spec in specs):
            self._rows.depend(rows, specs)
        budgets = [spec.token_budget for spec in specs]
        if self._tracing is None:
            return await self._write(rows, budgets, connection)
        chosen = [spec.trace_id is not None or spec.traceparent is not None for spec in specs]
        with self._tracing.submits(rows, chosen) as spans:
            results = await self._write(rows, budgets, connection)
            self._tracing.submitted(spans, results)
        return results

    async def _write(
        self,
        rows: list[dict[str, Any]],
        budgets: list[int | None],
        connection: psycopg.AsyncConnection[Any] | None,
    ) -> list[SubmitResult]:
        """The jobs, and the token budgets of those given one, in one transaction (a job a
        keyed submit deduplicated keeps its own)."""
        stores = self._lifecycle.stores
        if all(b is None for b in budgets):
            return await stores.jobs.submit(rows, connection)

        async def with_budgets(conn: psycopg.AsyncConnection[Any]) -> list[SubmitResult]:
            results = await stores.jobs.submit(rows, conn)
            given = [
                (r.job_id, b)
                for r, b in zip(results, budgets, strict=True)
                if b is not None and r.outcome != "deduplicated"
            ]
            if given:
                ids, tokens = zip(*given, strict=True)
                await stores.usage.set_budgets(ids, tokens, conn)
            return results

        if connection is not None:
            return await with_budgets(connection)
        return await stores.queries.in_transaction(with_budgets)


def _flow_of(
    spec: JobSpec, job_type: JobType, payload: Any, limit: tuple[str, FlowLimit] | None
) -> Flow | None:
    """The job's flow under its type's limit (None: no limit), its cost declared or estimated;
    its key is rendered by the submit's statement, which refuses a payload lacking a field the
    template names (InvalidPayload, from the job store)."""
    if limit is None:
        return None
    cost = spec.cost if spec.cost is not None else job_type.cost_of(payload)
    return flow_of(*limit, cost)
