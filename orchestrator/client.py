"""A Python client of the HTTP API (docs/api.md), on httpx, in two flavours of one shape:
:class:`Client` (blocking) and :class:`AsyncClient`.

    from orchestrator.client import Client

    with Client("http://127.0.0.1:8000", token) as api:
        job_id = api.submit("summarise", {"url": "https://example.com"})
        outcome = api.wait(job_id, seconds=30)

Each method builds its request once (``_Call``); the two clients only send it. An error
answer raises :class:`ApiError` with the API's stable ``code`` (``JOB_NOT_FOUND``,
``WF_STATE_TRANSITION_INVALID``, ...), its HTTP status and its detail.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Generic, TypeVar
from urllib.parse import quote
from uuid import UUID

import httpx

from orchestrator.domain.dead_letters import BulkReview
from orchestrator.domain.errors import OrchestratorError
from orchestrator.domain.flow import FlowKey
from orchestrator.domain.models import DeadLetter, Job, JobEvent

T = TypeVar("T")
__all__ = ["ApiError", "AsyncClient", "Client", "Outcome"]


def _segment(key: str) -> str:
    """A flow key as one path segment (docs/api.md, "Flow keys in a path"): every character but
    letters, digits, ``-``, ``_`` and ``~`` percent-encoded, ``/`` and ``.`` included, so that
    no client or proxy reads a slash or a ``..`` in the key as the path's own."""
    return quote(key, safe="").replace(".", "%2E")


class ApiError(OrchestratorError):
    def __init__(self, status: int, code: str, detail: str) -> None:
        self.status, self.code, self.detail = status, code, detail
        super().__init__(f"{code} ({status}): {detail}")


@dataclass(frozen=True)
class Outcome:
    """A job after a wait; ``finished`` is False when the wait ran out first."""

    finished: bool
    job: Job


@dataclass(frozen=True)
class _Call(Generic[T]):
    method: str
    path: str
    parse: Callable[[Any], T]
    params: dict[str, Any] = field(default_factory=dict)
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    timeout: float | None = None  # beyond the client's own, for long-polls


def _job_id(answer: Any) -> UUID:
    return UUID(answer["job_id"])


def _params(**values: Any) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, UUID) else v) for k, v in values.items() if v is not None}


class _Calls:
    """The API's operations, as requests and the parsing of their answers."""

    @staticmethod
    def submit(job_type: str, payload: Any = None, idempotency_key: str | None = None,
               **options: Any) -> _Call[UUID]:  # fmt: skip
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        body = {"job_type": job_type, "payload": payload, **options}
        return _Call("POST", "/api/v1/jobs", _job_id, body=body, headers=headers)

    @staticmethod
    def submit_many(jobs: list[dict[str, Any]]) -> _Call[list[UUID]]:
        return _Call(
            "POST", "/api/v1/jobs/batch", lambda a: [_job_id(j) for j in a["jobs"]],
            body={"jobs": jobs},
        )  # fmt: skip

    @staticmethod
    def get_job(job_id: UUID | str) -> _Call[Job]:
        return _Call("GET", f"/api/v1/jobs/{job_id}", Job.model_validate)

    @staticmethod
    def list_jobs(**filters: Any) -> _Call[tuple[list[Job], UUID | None]]:
        def page(a: Any) -> tuple[list[Job], UUID | None]:
            cursor = a["next_cursor"]
            return [Job.model_validate(j) for j in a["jobs"]], UUID(cursor) if cursor else None

        return _Call("GET", "/api/v1/jobs", page, params=_params(**filters))

    @staticmethod
    def events(job_id: UUID | str, after: int = 0, limit: int = 100) -> _Call[list[JobEvent]]:
        return _Call(
            "GET", f"/api/v1/jobs/{job_id}/events",
            lambda a: [JobEvent.model_validate(e) for e in a["events"]],
            params={"after": after, "limit": limit},
        )  # fmt: skip

    @staticmethod
    def steps(job_id: UUID | str) -> _Call[list[dict[str, Any]]]:
        return _Call("GET", f"/api/v1/jobs/{job_id}/steps", lambda a: list(a["steps"]))

    @staticmethod
    def cancel(job_id: UUID | str, reason: str = "") -> _Call[Job]:
        return _Call(
            "POST", f"/api/v1/jobs/{job_id}/cancel", Job.model_validate, body={"reason": reason}
        )

    @staticmethod
    def wait(job_id: UUID | str, seconds: float = 30.0) -> _Call[Outcome]:
        return _Call(
            "GET", f"/api/v1/jobs/{job_id}/wait",
            lambda a: Outcome(a["finished"], Job.model_validate(a["job"])),
            params={"timeout": seconds}, timeout=seconds,
        )  # fmt: skip

    @staticmethod
    def dead_letters(**filters: Any) -> _Call[list[DeadLetter]]:
        return _Call(
            "GET", "/api/v1/dead-letters",
            lambda a: [DeadLetter.model_validate(d) for d in a["dead_letters"]],
            params=_params(**filters),
        )  # fmt: skip

    @staticmethod
    def dead_letter(dead_letter_id: UUID | str) -> _Call[DeadLetter]:
        return _Call("GET", f"/api/v1/dead-letters/{dead_letter_id}", DeadLetter.model_validate)

    @staticmethod
    def requeue(dead_letter_id: UUID | str) -> _Call[UUID]:
        return _Call("POST", f"/api/v1/dead-letters/{dead_letter_id}/requeue", _job_id)

    @staticmethod
    def request_discard(dead_letter_id: UUID | str, reason: str) -> _Call[DeadLetter]:
        return _Call(
            "POST", f"/api/v1/dead-letters/{dead_letter_id}/discard-request",
            DeadLetter.model_validate, body={"reason": reason},
        )  # fmt: skip

    @staticmethod
    def confirm_discard(dead_letter_id: UUID | str) -> _Call[DeadLetter]:
        return _Call(
            "POST", f"/api/v1/dead-letters/{dead_letter_id}/discard-confirm",
            DeadLetter.model_validate,
        )  # fmt: skip

    @staticmethod
    def review(action: str, ids: Sequence[UUID | str] | None, **body: Any) -> _Call[BulkReview]:
        """A bulk action (``requeue``, ``discard-request``, ``discard-confirm``): on these
        letters, or (no ids) on those the filters in ``body`` match."""
        chosen = {"dead_letter_ids": [str(i) for i in ids]} if ids is not None else {}
        return _Call(
            "POST", f"/api/v1/dead-letters/{action}", BulkReview.model_validate,
            body={**chosen, **_params(**body)},
        )  # fmt: skip

    @staticmethod
    def approvals(status: str = "pending", limit: int = 50) -> _Call[list[dict[str, Any]]]:
        return _Call(
            "GET", "/api/v1/approvals", lambda a: list(a["approvals"]),
            params={"status": status, "limit": limit},
        )  # fmt: skip

    @staticmethod
    def decide(approval_id: UUID | str, decision: str, reason: str) -> _Call[dict[str, Any]]:
        return _Call(
            "POST", f"/api/v1/approvals/{approval_id}/{decision}", dict, body={"reason": reason}
        )

    @staticmethod
    def flow_keys() -> _Call[list[FlowKey]]:
        return _Call(
            "GET", "/api/v1/flow/keys", lambda a: [FlowKey.model_validate(k) for k in a["keys"]]
        )

    @staticmethod
    def flow_key(key: str) -> _Call[FlowKey]:
        return _Call("GET", f"/api/v1/flow/keys/{_segment(key)}", FlowKey.model_validate)

    @staticmethod
    def pause_flow_key(key: str, seconds: float, reason: str = "") -> _Call[FlowKey]:
        return _Call(
            "POST", f"/api/v1/flow/keys/{_segment(key)}/pause", FlowKey.model_validate,
            body={"seconds": seconds, "reason": reason},
        )  # fmt: skip

    @staticmethod
    def resume_flow_key(key: str) -> _Call[FlowKey]:
        return _Call("POST", f"/api/v1/flow/keys/{_segment(key)}/resume", FlowKey.model_validate)

    @staticmethod
    def usage(by: str = "tenant,model", **filters: Any) -> _Call[dict[str, Any]]:
        """LLM calls and tokens over a range (``since``, ``until``; ``tenant_id``,
        ``agent_id``, ``model``, ``job_type``, ``limit``), grouped ``by``, as JSON."""
        return _Call("GET", "/api/v1/usage", dict, params=_params(by=by, **filters))

    @staticmethod
    def job_usage(job_id: UUID | str) -> _Call[dict[str, Any]]:
        return _Call("GET", f"/api/v1/jobs/{job_id}/usage", dict)

    @staticmethod
    def get(path: str, **params: Any) -> _Call[Any]:
        """Any other read (``/api/v1/config``, ``/api/v1/queues``), as JSON."""
        return _Call("GET", path, lambda a: a, params=_params(**params))

    @staticmethod
    def post(path: str, body: Any = None, **params: Any) -> _Call[Any]:
        """Any other action (the external workers' endpoints), as JSON."""
        return _Call("POST", path, lambda a: a, params=_params(**params), body=body)


def _answer(call: _Call[T], response: httpx.Response) -> T:
    if response.is_error:
        try:
            problem = response.json()
            raise ApiError(response.status_code, problem["code"], problem["detail"])
        except (ValueError, KeyError, TypeError):
            raise ApiError(response.status_code, "HTTP_ERROR", response.text[:500]) from None
    return call.parse(response.json() if response.content else None)


def _request(client: httpx.Client | httpx.AsyncClient, call: _Call[Any]) -> httpx.Request:
    return client.build_request(
        call.method, call.path, params=call.params, json=call.body, headers=call.headers,
        timeout=None if call.timeout is None else call.timeout + 30,
    )  # fmt: skip


class Client:
    """The API, blocking."""

    def __init__(self, base_url: str, token: str, *, timeout: float = 30.0, **httpx_options: Any):
        self.http = httpx.Client(
            base_url=base_url, timeout=timeout,
            headers={"Authorization": f"Bearer {token}"}, **httpx_options,
        )  # fmt: skip

    def send(self, call: _Call[T]) -> T:
        return _answer(call, self.http.send(_request(self.http, call)))

    def submit(
        self, job_type: str, payload: Any = None, idempotency_key: str | None = None, **options: Any
    ) -> UUID:
        return self.send(_Calls.submit(job_type, payload, idempotency_key, **options))

    def submit_many(self, jobs: list[dict[str, Any]]) -> list[UUID]:
        return self.send(_Calls.submit_many(jobs))

    def get_job(self, job_id: UUID | str) -> Job:
        return self.send(_Calls.get_job(job_id))

    def list_jobs(self, **filters: Any) -> tuple[list[Job], UUID | None]:
        return self.send(_Calls.list_jobs(**filters))

    def events(self, job_id: UUID | str, after: int = 0, limit: int = 100) -> list[JobEvent]:
        return self.send(_Calls.events(job_id, after, limit))

    def steps(self, job_id: UUID | str) -> list[dict[str, Any]]:
        return self.send(_Calls.steps(job_id))

    def cancel(self, job_id: UUID | str, reason: str = "") -> Job:
        return self.send(_Calls.cancel(job_id, reason))

    def wait(self, job_id: UUID | str, seconds: float = 30.0) -> Outcome:
        return self.send(_Calls.wait(job_id, seconds))

    def dead_letters(self, **filters: Any) -> list[DeadLetter]:
        return self.send(_Calls.dead_letters(**filters))

    def dead_letter(self, dead_letter_id: UUID | str) -> DeadLetter:
        return self.send(_Calls.dead_letter(dead_letter_id))

    def requeue(self, dead_letter_id: UUID | str) -> UUID:
        return self.send(_Calls.requeue(dead_letter_id))

    def request_discard(self, dead_letter_id: UUID | str, reason: str) -> DeadLetter:
        return self.send(_Calls.request_discard(dead_letter_id, reason))

    def confirm_discard(self, dead_letter_id: UUID | str) -> DeadLetter:
        return self.send(_Calls.confirm_discard(dead_letter_id))

    def requeue_many(self, ids: Sequence[UUID | str] | None = None, **filters: Any) -> BulkReview:
        """These letters, or (no ids) the open ones ``filters`` (job_type, tenant_id, error)
        match: at most 500 a call, each letter's outcome."""
        return self.send(_Calls.review("requeue", ids, **filters))

    def request_discards(
        self, reason: str, ids: Sequence[UUID | str] | None = None, **filters: Any
    ) -> BulkReview:
        return self.send(_Calls.review("discard-request", ids, reason=reason, **filters))

    def confirm_discards(
        self, ids: Sequence[UUID | str] | None = None, **filters: Any
    ) -> BulkReview:
        return self.send(_Calls.review("discard-confirm", ids, **filters))

    def approvals(self, status: str = "pending", limit: int = 50) -> list[dict[str, Any]]:
        return self.send(_Calls.approvals(status, limit))

    def decide(self, approval_id: UUID | str, decision: str, reason: str) -> dict[str, Any]:
        return self.send(_Calls.decide(approval_id, decision, reason))

    def flow_keys(self) -> list[FlowKey]:
        return self.send(_Calls.flow_keys())

    def flow_key(self, key: str) -> FlowKey:
        return self.send(_Calls.flow_key(key))

    def pause_flow_key(self, key: str, seconds: float, reason: str = "") -> FlowKey:
        return self.send(_Calls.pause_flow_key(key, seconds, reason))

    def resume_flow_key(self, key: str) -> FlowKey:
        return self.send(_Calls.resume_flow_key(key))

    def usage(self, by: str = "tenant,model", **filters: Any) -> dict[str, Any]:
        return self.send(_Calls.usage(by, **filters))

    def job_usage(self, job_id: UUID | str) -> dict[str, Any]:
        return self.send(_Calls.job_usage(job_id))

    def get(self, path: str, **params: Any) -> Any:
        return self.send(_Calls.get(path, **params))

    def post(self, path: str, body: Any = None, **params: Any) -> Any:
        return self.send(_Calls.post(path, body, **params))

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncClient:
    """The API, for asyncio: the same operations as :class:`Client`, awaited."""

    def __init__(self, base_url: str, token: str, *, timeout: float = 30.0, **httpx_options: Any):
        self.http = httpx.AsyncClient(
            base_url=base_url, timeout=timeout,
            headers={"Authorization": f"Bearer {token}"}, **httpx_options,
        )  # fmt: skip

    async def send(self, call: _Call[T]) -> T:
        return _answer(call, await self.http.send(_request(self.http, call)))

    async def submit(
        self, job_type: str, payload: Any = None, idempotency_key: str | None = None, **options: Any
    ) -> UUID:
        return await self.send(_Calls.submit(job_type, payload, idempotency_key, **options))

    async def submit_many(self, jobs: list[dict[str, Any]]) -> list[UUID]:
        return await self.send(_Calls.submit_many(jobs))

    async def get_job(self, job_id: UUID | str) -> Job:
        return await self.send(_Calls.get_job(job_id))

    async def list_jobs(self, **filters: Any) -> tuple[list[Job], UUID | None]:
        return await self.send(_Calls.list_jobs(**filters))

    async def events(self, job_id: UUID | str, after: int = 0, limit: int = 100) -> list[JobEvent]:
        return await self.send(_Calls.events(job_id, after, limit))

    async def steps(self, job_id: UUID | str) -> list[dict[str, Any]]:
        return await self.send(_Calls.steps(job_id))

    async def cancel(self, job_id: UUID | str, reason: str = "") -> Job:
        return await self.send(_Calls.cancel(job_id, reason))

    async def wait(self, job_id: UUID | str, seconds: float = 30.0) -> Outcome:
        return await self.send(_Calls.wait(job_id, seconds))

    async def dead_letters(self, **filters: Any) -> list[DeadLetter]:
        return await self.send(_Calls.dead_letters(**filters))

    async def dead_letter(self, dead_letter_id: UUID | str) -> DeadLetter:
        return await self.send(_Calls.dead_letter(dead_letter_id))

    async def requeue(self, dead_letter_id: UUID | str) -> UUID:
        return await self.send(_Calls.requeue(dead_letter_id))

    async def request_discard(self, dead_letter_id: UUID | str, reason: str) -> DeadLetter:
        return await self.send(_Calls.request_discard(dead_letter_id, reason))

    async def confirm_discard(self, dead_letter_id: UUID | str) -> DeadLetter:
        return await self.send(_Calls.confirm_discard(dead_letter_id))

    async def requeue_many(
        self, ids: Sequence[UUID | str] | None = None, **filters: Any
    ) -> BulkReview:
        return await self.send(_Calls.review("requeue", ids, **filters))

    async def request_discards(
        self, reason: str, ids: Sequence[UUID | str] | None = None, **filters: Any
    ) -> BulkReview:
        return await self.send(_Calls.review("discard-request", ids, reason=reason, **filters))

    async def confirm_discards(
        self, ids: Sequence[UUID | str] | None = None, **filters: Any
    ) -> BulkReview:
        return await self.send(_Calls.review("discard-confirm", ids, **filters))

    async def approvals(self, status: str = "pending", limit: int = 50) -> list[dict[str, Any]]:
        return await self.send(_Calls.approvals(status, limit))

    async def decide(self, approval_id: UUID | str, decision: str, reason: str) -> dict[str, Any]:
        return await self.send(_Calls.decide(approval_id, decision, reason))

    async def flow_keys(self) -> list[FlowKey]:
        return await self.send(_Calls.flow_keys())

    async def flow_key(self, key: str) -> FlowKey:
        return await self.send(_Calls.flow_key(key))

    async def pause_flow_key(self, key: str, seconds: float, reason: str = "") -> FlowKey:
        return await self.send(_Calls.pause_flow_key(key, seconds, reason))

    async def resume_flow_key(self, key: str) -> FlowKey:
        return await self.send(_Calls.resume_flow_key(key))

    async def usage(self, by: str = "tenant,model", **filters: Any) -> dict[str, Any]:
        return await self.send(_Calls.usage(by, **filters))

    async def job_usage(self, job_id: UUID | str) -> dict[str, Any]:
        return await self.send(_Calls.job_usage(job_id))

    async def get(self, path: str, **params: Any) -> Any:
        return await self.send(_Calls.get(path, **params))

    async def post(self, path: str, body: Any = None, **params: Any) -> Any:
        return await self.send(_Calls.post(path, body, **params))

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
