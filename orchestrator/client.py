"""A Python client of the HTTP API (docs/api.md), on httpx, in two flavours of one shape:
:class:`Client` (blocking) and :class:`AsyncClient`.

    from orchestrator.client import Client

    with Client("http://127.0.0.1:8000", token) as api:
        job_id = api.submit("summarise", {"url": "https://example.com"})
        outcome = api.wait(job_id, seconds=30)
        for chunk in api.output(job_id):  # its live output, until it has finished
            print(chunk.offset, chunk.attempt, chunk.kind, chunk.body)

Each method builds its request once (``_Call``); the two clients only send it. An error
answer raises :class:`ApiError` with the API's stable ``code`` (``JOB_NOT_FOUND``,
``WF_STATE_TRANSITION_INVALID``, ...), its HTTP status and its detail. ``output`` makes
several requests (a stream, opened again where it dropped; pages); ``_Output`` says which,
and the two clients send them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Generic, TypeVar
from urllib.parse import quote
from uuid import UUID

import httpx

from orchestrator.domain.backoff import doubling_delay
from orchestrator.domain.dead_letters import BulkReview
from orchestrator.domain.errors import OrchestratorError
from orchestrator.domain.flow import FlowKey
from orchestrator.domain.models import DeadLetter, Job, JobEvent
from orchestrator.domain.output import OutputChunk

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


#: A dropped output stream is opened again after 0.5 s, doubling up to 5 s, for as long as the
#: caller's ``reconnect_seconds`` allow, counted from the first failure in a row.
RECONNECT_FIRST_SECONDS = 0.5
RECONNECT_MAX_SECONDS = 5.0
#: Answers tried again as a dropped connection is: the server, or a proxy before it, is away.
UNAVAILABLE = frozenset({502, 503, 504})
#: ``output(final=True)`` waits for the job's end in long-polls of this many seconds.
FINAL_WAIT_SECONDS = 30.0
OUTPUT_PAGE = 500


class _Cut(Exception):
    """An output stream ended without its ``end`` event: the server ended it before the job's
    end (its database lost, the caller's token revoked), so it is opened again."""


class _Output:
    """What ``output()`` does, but the sending: the request to make next, what each answer
    holds, and whether a failure is tried again.

    Live: a stream (Server-Sent Events) from the next offset, until its ``end`` event (the job
    has finished, and every chunk was sent). ``final``: the job's end is waited for
    (long-polls), then its final output is read in pages. A dropped connection, a stream cut
    short, or a server away (502, 503, 504) is tried again from the offset after the last chunk
    given, for ``reconnect_seconds`` from the first failure in a row; any other error answer is
    raised (ApiError: a revoked token's 401, an unknown job's 404)."""

    def __init__(
        self, job_id: UUID | str, offset: int, *, final: bool, reconnect_seconds: float
    ) -> None:
        self.path = f"/api/v1/jobs/{job_id}"
        self.offset, self.final, self.reconnect_seconds = offset, final, reconnect_seconds
        self.step = "wait" if final else "stream"
        self.failures = 0
        self.failing_since = 0.0

    @property
    def streaming(self) -> bool:
        return self.step == "stream"

    def next_call(self) -> _Call[list[OutputChunk]] | None:
        """The next request (None: the output has ended). A stream's answer is read by lines
        (:class:`_Events`), then handed to :meth:`streamed`."""
        if self.step == "stream":
            return _Call(
                "GET", f"{self.path}/output", lambda a: [], params={"offset": self.offset},
                headers={"Accept": "text/event-stream"},
            )  # fmt: skip
        if self.step == "wait":
            return _Call(
                "GET", f"{self.path}/wait", self._waited,
                params={"timeout": FINAL_WAIT_SECONDS}, timeout=FINAL_WAIT_SECONDS,
            )  # fmt: skip
        if self.step == "pages":
            params = {"offset": self.offset, "limit": OUTPUT_PAGE, "final": self.final}
            return _Call("GET", f"{self.path}/output", self._paged, params=params)
        return None

    def answered(self) -> None:
        """An answer came (a stream opened): the next failure is the first in a row."""
        self.failures = 0

    def given(self, chunk: OutputChunk) -> OutputChunk:
        self.offset = chunk.offset + 1
        return chunk

    def streamed(self, events: _Events) -> None:
        """The stream has ended: with its ``end`` event, so has the output; _Cut otherwise."""
        if events.end is None:
            raise _Cut(f"{self.path}/output ended before the job did")
        self.step = "done"

    def _waited(self, answer: Any) -> list[OutputChunk]:
        self.answered()
        if answer["finished"]:
            self.step = "pages"
        return []

    def _paged(self, answer: Any) -> list[OutputChunk]:
        self.answered()
        chunks = [self.given(OutputChunk.model_validate(c)) for c in answer["chunks"]]
        if not chunks:
            self.step = "done"
        return chunks

    def retry_after(self, exc: httpx.TransportError | ApiError | _Cut) -> float:
        """Seconds to wait before trying again after ``exc``; ``exc`` raised again when it is
        an answer of the API's own (not the connection's) or ``reconnect_seconds`` have passed
        since the first failure in a row."""
        now = time.monotonic()
        self.failures += 1
        if self.failures == 1:
            self.failing_since = now
        away = not isinstance(exc, ApiError) or exc.status in UNAVAILABLE
        if not away or now - self.failing_since >= self.reconnect_seconds:
            raise exc
        return doubling_delay(
            self.failures, first=RECONNECT_FIRST_SECONDS, cap=RECONNECT_MAX_SECONDS
        )


class _Events:
    """One connection's Server-Sent Events, a line at a time: each event's ``data`` is a chunk
    as JSON (its ``id`` and ``event`` fields, its offset and kind, are in it too), or the
    ``end`` event's, the job's ``{"status"}``; comments (the keep-alive ``: ping``) are
    skipped, and an event the connection cut short is lost with it (its chunk comes again on
    the next connection)."""

    def __init__(self) -> None:
        self.event = ""
        self.data: list[str] = []
        self.end: dict[str, Any] | None = None  # the end event's data, once it came

    def line(self, line: str) -> OutputChunk | None:
        """The chunk whose event ``line`` ends (a blank line), else None."""
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "event":
            self.event = value
        elif field == "data":
            self.data.append(value)
        if line or not self.data:
            return None
        data, event = "\n".join(self.data), self.event
        self.data, self.event = [], ""
        if event == "end":
            self.end = json.loads(data)
            return None
        return OutputChunk.model_validate_json(data)


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

    def output(
        self, job_id: UUID | str, offset: int = 0, *, final: bool = False,
        reconnect_seconds: float = 60.0,
    ) -> Iterator[OutputChunk]:  # fmt: skip
        """The job's output (docs/output.md) from ``offset`` on, each chunk as it is written,
        until the job has finished and all of it was given; ``final``: once the job has
        finished, its final output only. A dropped connection resumes after the last chunk
        given (``_Output``)."""
        reading = _Output(job_id, offset, final=final, reconnect_seconds=reconnect_seconds)
        while (call := reading.next_call()) is not None:
            try:
                if not reading.streaming:
                    yield from self.send(call)
                    continue
                response = self.http.send(_request(self.http, call), stream=True)
                try:
                    if response.is_error:
                        response.read()
                        _answer(call, response)
                    reading.answered()
                    events = _Events()
                    for line in response.iter_lines():
                        if (chunk := events.line(line)) is not None:
                            yield reading.given(chunk)
                finally:
                    response.close()
                reading.streamed(events)
            except (httpx.TransportError, ApiError, _Cut) as exc:
                time.sleep(reading.retry_after(exc))

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

    async def output(
        self, job_id: UUID | str, offset: int = 0, *, final: bool = False,
        reconnect_seconds: float = 60.0,
    ) -> AsyncIterator[OutputChunk]:  # fmt: skip
        """As :meth:`Client.output`: ``async for chunk in api.output(job_id)``."""
        reading = _Output(job_id, offset, final=final, reconnect_seconds=reconnect_seconds)
        while (call := reading.next_call()) is not None:
            try:
                if not reading.streaming:
                    for paged in await self.send(call):
                        yield paged
                    continue
                response = await self.http.send(_request(self.http, call), stream=True)
                try:
                    if response.is_error:
                        await response.aread()
                        _answer(call, response)
                    reading.answered()
                    events = _Events()
                    async for line in response.aiter_lines():
                        if (chunk := events.line(line)) is not None:
                            yield reading.given(chunk)
                finally:
                    await response.aclose()
                reading.streamed(events)
            except (httpx.TransportError, ApiError, _Cut) as exc:
                await asyncio.sleep(reading.retry_after(exc))

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
