"""``send_notification`` and ``approval_notify``: messages to people, over channel adapters.

Channels (the payload's ``channel`` picks one):

    webhook    POST {url} a JSON body {notification_id, text, about_job_id}; optional bearer
               token (the secret named by ``token_secret``); ``idempotency-key`` is the job id
    telegram   Telegram's Bot API (a chat-style API): POST {base_url}/bot<token>/sendMessage
               {chat_id, text}; the token is the secret named by ``token_secret``. Its errors
               come as {"ok": false, "error_code", "description", "parameters": {retry_after}}:
               429 is retried after ``retry_after``, other 4xx are PERMANENT

Both types have a fallback (orchestrator.domain.degradation): when a notification fails
for good, its content is logged and recorded in the job's ``job.degraded`` event, and no further
notification is attempted. They are also where human notifications of other failed jobs go
(``ORCHESTRATOR_ESCALATION_TARGET`` holds a ``send_notification`` payload without its text).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal
from uuid import UUID

import httpx
from pydantic import AnyHttpUrl, BaseModel, Field

from orchestrator import JobContext, Orchestrator, PermanentError, RetryLater
from tasks.payload import Payload


class Webhook(Payload):
    channel: Literal["webhook"]
    url: AnyHttpUrl
    token_secret: str | None = None  # name of the secret sent as a bearer token


class Telegram(Payload):
    channel: Literal["telegram"]
    chat_id: int | str
    base_url: AnyHttpUrl = AnyHttpUrl("https://api.telegram.org")
    token_secret: str = "TELEGRAM_BOT_TOKEN"


Target = Annotated[Webhook | Telegram, Field(discriminator="channel")]


class WebhookNotification(Webhook):
    text: str = Field(min_length=1)
    about_job_id: str | None = None  # the failed job a human notification is about


class TelegramNotification(Telegram):
    text: str = Field(min_length=1, max_length=4096)
    about_job_id: str | None = None


Notification = Annotated[WebhookNotification | TelegramNotification, Field(discriminator="channel")]


class ApprovalNotice(Payload):
    target: Target
    approval_id: UUID
    question: str = Field(min_length=1)
    job_id: UUID | None = None

    def text(self) -> str:
        return (
            f"Approval needed: {self.question}\n"
            f"approve: orchestrator approvals approve {self.approval_id} --by <you>\n"
            f"reject:  orchestrator approvals reject {self.approval_id} --by <you> --reason ..."
        )


class Delivered(BaseModel):
    channel: str
    status: int
    message_id: str | None = None


async def deliver(
    ctx: JobContext, target: Webhook | Telegram, text: str, about: str | None
) -> Delivered:
    if isinstance(target, Webhook):
        headers = {"idempotency-key": str(ctx.job_id)}
        if target.token_secret:
            headers["authorization"] = f"Bearer {ctx.secrets.get(target.token_secret)}"
        body = {"notification_id": str(ctx.job_id), "text": text, "about_job_id": about}
        response = await ctx.http.post(str(target.url), json=body, headers=headers)
        response.raise_for_status()
        return Delivered(channel="webhook", status=response.status_code)
    token = ctx.secrets.get(target.token_secret)
    url = f"{str(target.base_url).rstrip('/')}/bot{token}/sendMessage"
    response = await ctx.http.post(url, json={"chat_id": target.chat_id, "text": text})
    answer = _json(response)
    if response.status_code == 200 and answer.get("ok") is True:
        message_id = (answer.get("result") or {}).get("message_id")
        return Delivered(channel="telegram", status=200, message_id=str(message_id))
    code, description = answer.get("error_code", response.status_code), answer.get("description")
    retry_after = (answer.get("parameters") or {}).get("retry_after")
    if code == 429 and isinstance(retry_after, int | float):
        raise RetryLater(float(retry_after), f"telegram: {description}")
    if 400 <= code < 500 and code != 429:
        raise PermanentError(f"telegram {code}: {description}", code=f"TELEGRAM_{code}")
    response.raise_for_status()  # 5xx and friends: classified by status
    raise PermanentError(f"telegram answered {code} without ok: {description}")


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        value = response.json()
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def log_notification_content(payload: Any) -> Any:
    """The fallback: keep what was to be said, and to whom (secrets are only named here)."""
    return payload


#: What a notification that spent its retries says it did instead (the retry spec's wording).
UNDELIVERED = "Notification delivery failed after all retries. Content logged."


def register(orc: Orchestrator) -> None:
    @orc.job_type(
        "send_notification", fallback=log_notification_content, exhausted_message=UNDELIVERED
    )
    async def send_notification(ctx: JobContext, notification: Notification) -> Delivered:
        return await deliver(ctx, notification, notification.text, notification.about_job_id)

    @orc.job_type(
        "approval_notify", fallback=log_notification_content, exhausted_message=UNDELIVERED
    )
    async def approval_notify(ctx: JobContext, notice: ApprovalNotice) -> Delivered:
        about = str(notice.job_id) if notice.job_id else None
        return await deliver(ctx, notice.target, notice.text(), about)
