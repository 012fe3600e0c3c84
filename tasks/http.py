"""``http_request`` and ``webhook_dispatch``: one HTTP call, classified by the status table.

``webhook_dispatch`` POSTs an event as JSON with an ``idempotency-key`` (the job id, the same in
every attempt, so a receiver can drop a retried delivery it already has) and, given the name of
a signing secret, an ``x-webhook-signature: sha256=<HMAC of the body>``.

The call goes through ``ctx.http``: the job type's connect and total timeouts (see
orchestrator.runtime.calls), httpx's own retries off, so the orchestrator's two layers are the only
retries. A non-2xx response raises ``httpx.HTTPStatusError``, which the classifier maps by
status and ``Retry-After``. The output is ``{status, headers, body}``: the body parsed when the
response says it is JSON, its text otherwise, None when empty. A body that claims to be JSON
and is not is INVALID_OUTPUT (terminal, the text kept in the job's ``last_error``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any, Literal

import httpx
from pydantic import AnyHttpUrl, BaseModel, Field

from orchestrator import InvalidOutput, JobContext, Orchestrator
from tasks.payload import Payload


class HttpRequest(Payload):
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
    return HttpResponse(
        status=response.status_code, headers=dict(response.headers), body=_body(response)
    )


def _body(response: httpx.Response) -> Any:
    if not response.content:
        return None  # HEAD, 204, and empty bodies of any type
    if not _declares_json(response.headers.get("content-type", "")):
        return response.text
    try:
        return response.json()
    except ValueError as exc:
        raise InvalidOutput(
            f"{response.request.method} {response.request.url} answered "
            f"{response.status_code} with a body that is not the JSON it declares: {exc}",
            output=response.text,
        ) from None


def _declares_json(content_type: str) -> bool:
    """application/json, and the +json family (application/problem+json, ...)."""
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


class Webhook(Payload):
    url: AnyHttpUrl
    event: str = Field(min_length=1, max_length=200)
    data: Any = None
    headers: dict[str, str] = Field(default_factory=dict)
    signing_secret: str | None = None  # the name of the secret, never its value


def webhook_request(ctx: JobContext, hook: Webhook) -> HttpRequest:
    body = json.dumps(
        {"id": str(ctx.job_id), "event": hook.event, "data": hook.data}, separators=(",", ":")
    )
    headers = {
        **hook.headers,
        "content-type": "application/json",
        "idempotency-key": str(ctx.job_id),
        "x-webhook-event": hook.event,
    }
    if hook.signing_secret:
        key = ctx.secrets.get(hook.signing_secret).encode()
        digest = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
        headers["x-webhook-signature"] = f"sha256={digest}"
    return HttpRequest(method="POST", url=hook.url, headers=headers, body=body)


def register(orc: Orchestrator) -> None:
    @orc.job_type("http_request")
    async def http_request(ctx: JobContext, payload: HttpRequest) -> HttpResponse:
        return await perform(ctx, payload)

    @orc.job_type("webhook_dispatch")
    async def webhook_dispatch(ctx: JobContext, hook: Webhook) -> HttpResponse:
        return await perform(ctx, webhook_request(ctx, hook))
