"""``http_request``: one HTTP call, classified by seed 004's table.

The call goes through ``ctx.http``: the job type's connect and total timeouts (see
orchestrator.calls), httpx's own retries off, so the orchestrator's two layers are the only
retries. A non-2xx response raises ``httpx.HTTPStatusError``, which the classifier maps by
status and ``Retry-After``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AnyHttpUrl, BaseModel, Field

from orchestrator import JobContext, Orchestrator


class HttpRequest(BaseModel):
    method: Literal["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"] = "GET"
    url: AnyHttpUrl
    headers: dict[str, str] = Field(default_factory=dict)
    json_body: Any = None
    body: str | None = None


class HttpResponse(BaseModel):
    status: int
    headers: dict[str, str]
    body: Any


async def perform(ctx: JobContext, request: HttpRequest) -> HttpResponse:
    response = await ctx.http.request(
        request.method,
        str(request.url),
        headers={"x-orchestrator-job-id": str(ctx.job_id), **request.headers},
        json=request.json_body,
        content=request.body,
    )
    response.raise_for_status()
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    return HttpResponse(status=response.status_code, headers=dict(response.headers), body=body)


def register(orc: Orchestrator) -> None:
    @orc.job_type("http_request")
    async def http_request(ctx: JobContext, payload: HttpRequest) -> HttpResponse:
        return await perform(ctx, payload)
