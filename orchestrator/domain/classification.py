"""Error classification: every failure of an attempt maps to exactly one class
(docs/contracts.md, "Error classification").

    TRANSIENT_INFRA  re-raised; Procrastinate retries the same dispatch with Graphile's exp(n)
    TRANSIENT_APP    caught; the job goes to RETRY with the type's backoff (server hint honoured)
    PERMANENT        caught; FAILED, no retry at either layer
    INVALID_OUTPUT   caught; FAILED, the offending output is kept in ``last_error``

:func:`classify` is total: it never raises and never answers ``VALID`` for an exception.
User classifiers run first, in registration order; the first non-``None`` answer wins.

A TRANSIENT_APP failure carries the server's hint when it gave one (:func:`retry_hint`), read in
this order, the first present wins:

1. ``retry-after-ms`` (milliseconds; the SDK's header), then ``retry-after`` (seconds or an
   HTTP-date);
2. the ``anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-reset`` headers (RFC
   3339): the latest reset among the exhausted limits (``-remaining`` 0, or not reported), as
   seconds from the reply's instant;
3. a ``retry_after`` field (seconds) in the JSON error body, in its ``error`` object or at its
   top level.

An absolute time (an HTTP-date ``retry-after``, a reset) is measured from the reply's own
``Date``, the provider's clock, not the worker's (orchestrator.domain.reply_clock): a worker's
skewed clock can neither cancel nor stretch the pause it asks for.

:attr:`Classified.throttled` is True exactly for a provider's rate limit (429) or overload (529):
the status of an HTTP error (httpx, httpx2, the anthropic SDK's RateLimitError, OverloadedError or
APIStatusError), or the same error type sent inside a stream; :attr:`Classified.throttle` says
which (``rate_limited`` or ``overloaded``), as the LLM calls metric's outcome does.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import math
import socket
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal

import httpx
import pydantic

from orchestrator.domain.backoff import parse_retry_after
from orchestrator.domain.errors import InvalidOutput, PermanentError, RetryLater, TimedOut
from orchestrator.domain.reply_clock import reply_now

logger = logging.getLogger(__name__)


class ErrorClass(StrEnum):
    VALID = "VALID"
    TRANSIENT_INFRA = "TRANSIENT_INFRA"
    TRANSIENT_APP = "TRANSIENT_APP"
    PERMANENT = "PERMANENT"
    INVALID_OUTPUT = "INVALID_OUTPUT"


@dataclass(frozen=True)
class Classified:
    error_class: ErrorClass
    code: str
    retry_after: float | None = None  # seconds the server (or the task) asked us to wait

    @property
    def throttle(self) -> Throttle | None:
        """``rate_limited`` (429), ``overloaded`` (529), or None for any other failure."""
        return _THROTTLES.get(self.code)

    @property
    def throttled(self) -> bool:
        """A provider's rate limit or overload: what pauses a key rather than a job."""
        return self.code in _THROTTLES


Throttle = Literal["rate_limited", "overloaded"]
#: The codes of a provider's rate limit and overload, whichever source classified them.
_THROTTLES: dict[str, Throttle] = {
    "HTTP_429": "rate_limited",
    "LLM_RATE_LIMITED": "rate_limited",
    "HTTP_529": "overloaded",
    "LLM_OVERLOADED": "overloaded",
}


Classifier = Callable[[BaseException], Classified | None]

INFRA, APP = ErrorClass.TRANSIENT_INFRA, ErrorClass.TRANSIENT_APP
PERMANENT, INVALID = ErrorClass.PERMANENT, ErrorClass.INVALID_OUTPUT


def classify_http_status(status: int) -> ErrorClass:
    """The design's status table."""
    if 200 <= status < 300:
        return ErrorClass.VALID
    if status in (408, 429, 503, 529):
        return APP
    if status in (502, 504):
        return INFRA
    if 400 <= status < 500:
        return PERMANENT
    if status >= 500:
        return INFRA
    return PERMANENT


# Every other errno (ECONNRESET, ECONNREFUSED, ETIMEDOUT, EPIPE, ENETUNREACH, ...) is transient.
_PERMANENT_ERRNO = frozenset({"ENOENT", "EACCES", "EPERM", "EISDIR", "ENOTDIR", "EROFS"})


# httpx (and httpx2, its fork under the anthropic SDK, whose errors surface raw while a stream
# is read): connect-phase failures are infrastructure, response-phase timeouts are the app's
# (the timeout decision tree). Most specific class first.
def _httpx_table(h: Any) -> tuple[tuple[type[BaseException], ErrorClass, str], ...]:
    return (
        (h.ConnectTimeout, INFRA, "CONNECT_TIMEOUT"),
        (h.PoolTimeout, INFRA, "POOL_TIMEOUT"),
        (h.ReadTimeout, APP, "RESPONSE_TIMEOUT"),
        (h.WriteTimeout, APP, "RESPONSE_TIMEOUT"),
        (h.TimeoutException, APP, "RESPONSE_TIMEOUT"),
        (h.ConnectError, INFRA, "CONNECT_ERROR"),
        (h.LocalProtocolError, PERMANENT, "LOCAL_PROTOCOL_ERROR"),
        (h.UnsupportedProtocol, PERMANENT, "UNSUPPORTED_PROTOCOL"),
        (h.TransportError, INFRA, "TRANSPORT_ERROR"),
        (h.TooManyRedirects, PERMANENT, "TOO_MANY_REDIRECTS"),
        (h.DecodingError, INVALID, "DECODING_ERROR"),
        (h.InvalidURL, PERMANENT, "INVALID_URL"),
    )


_HTTPX = _httpx_table(httpx)


# An error the API sends inside a stream that had begun with 200 (an SSE `error` event): its
# status says nothing, its type says what happened.
_STREAM_ERROR_TYPES: dict[str, tuple[ErrorClass, str]] = {
    "overloaded_error": (APP, "LLM_OVERLOADED"),
    "rate_limit_error": (APP, "LLM_RATE_LIMITED"),
    "timeout_error": (APP, "LLM_TIMEOUT"),
    "api_error": (INFRA, "LLM_SERVER_ERROR"),
    "authentication_error": (PERMANENT, "LLM_AUTHENTICATION"),
    "permission_error": (PERMANENT, "LLM_PERMISSION"),
    "invalid_request_error": (PERMANENT, "LLM_BAD_REQUEST"),
    "not_found_error": (PERMANENT, "LLM_NOT_FOUND"),
    "request_too_large": (PERMANENT, "LLM_REQUEST_TOO_LARGE"),
}


# anthropic SDK, by class (the design's table: RateLimit, APIConnection, Authentication, BadRequest,
# InternalServer, Overloaded). Subclasses that the status table disagrees with come first. The SDK
# is looked at only once something imported it (an exception of its can exist only then), so
# whoever never calls an LLM does not pay for importing it (most of a second).
@functools.cache
def _anthropic_table() -> tuple[tuple[type[BaseException], ErrorClass, str], ...]:
    import anthropic

    return (
        (anthropic.APITimeoutError, APP, "LLM_TIMEOUT"),
        (anthropic.APIConnectionError, INFRA, "LLM_CONNECTION_ERROR"),
        (anthropic.RateLimitError, APP, "LLM_RATE_LIMITED"),
        (anthropic.OverloadedError, APP, "LLM_OVERLOADED"),
        (anthropic.ServiceUnavailableError, APP, "LLM_UNAVAILABLE"),
        (anthropic.AuthenticationError, PERMANENT, "LLM_AUTHENTICATION"),
        (anthropic.BadRequestError, PERMANENT, "LLM_BAD_REQUEST"),
        (anthropic.InternalServerError, INFRA, "LLM_SERVER_ERROR"),
        (anthropic.APIResponseValidationError, INVALID, "LLM_RESPONSE_INVALID"),
    )


def _from_anthropic(exc: BaseException, now: datetime) -> Classified | None:
    """The SDK's own errors; None for anything else."""
    anthropic = sys.modules.get("anthropic")
    if anthropic is None or not isinstance(exc, anthropic.AnthropicError):
        return None
    if isinstance(exc, anthropic.APIStatusError):
        if exc.status_code < 300:
            error_class, code = _STREAM_ERROR_TYPES.get(exc.type or "", (INFRA, "LLM_STREAM_ERROR"))
            # only the event's body can hint: the headers are the stream's, sent before it
            hint = body_retry_after(exc.body) if error_class is APP else None
            return Classified(error_class, code, retry_after=hint)
        table = _from_table(exc, _anthropic_table(), now, exc.body)
        return table or _from_status(exc.status_code, exc.response, now, exc.body)
    return _from_table(exc, _anthropic_table(), now) or Classified(INFRA, "LLM_ERROR")


def _from_httpx2(exc: BaseException, now: datetime) -> Classified | None:
    """Errors of httpx2 (the anthropic SDK's HTTP client), once it is loaded."""
    httpx2 = sys.modules.get("httpx2")
    if httpx2 is None or not isinstance(exc, httpx2.HTTPError | httpx2.InvalidURL):
        return None
    if isinstance(exc, httpx2.HTTPStatusError):
        return _from_status(exc.response.status_code, exc.response, now, _json_body(exc.response))
    return _from_table(exc, _httpx_table(httpx2), now) or Classified(INFRA, "HTTP_ERROR")


def classify(
    exc: BaseException, classifiers: Iterable[Classifier] = (), *, now: datetime | None = None
) -> Classified:
    """The class of ``exc``: the first of ``classifiers`` to answer, else the built-in rules.
    ``now``: the worker's clock, which a server's absolute hint is measured against when its
    reply has no ``Date`` (read at the call when not given)."""
    for classifier in classifiers:
        try:
            answer = classifier(exc)
        except Exception:
            logger.exception("classifier %r failed; ignoring it", classifier)
            continue
        if answer is not None and answer.error_class is not ErrorClass.VALID:
            return answer
    try:
        return _builtin(exc, now or datetime.now(UTC))
    except Exception:  # a hostile __getattr__ or property must not break totality
        logger.exception("classifying %r failed; treating it as TRANSIENT_INFRA", type(exc))
        return Classified(INFRA, "UNCLASSIFIED")


def _builtin(exc: BaseException, now: datetime) -> Classified:
    match exc:
        case RetryLater(delay=delay):
            return Classified(APP, "RETRY_LATER", retry_after=delay)
        case PermanentError():
            return Classified(PERMANENT, exc.code or "PERMANENT_ERROR")
        case InvalidOutput() | pydantic.ValidationError():
            return Classified(INVALID, "OUTPUT_INVALID")
        case TimedOut():
            return Classified(APP, exc.code)  # a step or call overran: retry, from a checkpoint
        case asyncio.CancelledError():
            return Classified(APP, "CANCELLED")  # drain or abort: an AbortError in the design
        case httpx.HTTPStatusError():
            return _from_status(
                exc.response.status_code, exc.response, now, _json_body(exc.response)
            )
        case httpx.HTTPError() | httpx.InvalidURL():
            return _from_table(exc, _HTTPX, now) or Classified(INFRA, "HTTP_ERROR")
    sdk = _from_anthropic(exc, now) or _from_httpx2(exc, now)
    if sdk is not None:
        return sdk
    match exc:
        case TimeoutError() if exc.errno is None:
            return Classified(APP, "TIMEOUT")  # asyncio.timeout / wait_for: a response timeout
        case socket.gaierror():
            if exc.errno == socket.EAI_AGAIN:
                return Classified(INFRA, "EAI_AGAIN")
            return Classified(PERMANENT, "ENOTFOUND")
        case OSError() if exc.errno is not None:
            return _from_errno(exc.errno)
    status = _status_attribute(exc)
    if status is not None:
        response = getattr(exc, "response", None)
        return _from_status(status, response, now, getattr(exc, "body", None))
    return Classified(INFRA, f"UNKNOWN:{type(exc).__name__}")


def _from_table(
    exc: BaseException,
    table: tuple[tuple[type[BaseException], ErrorClass, str], ...],
    now: datetime,
    body: object = None,
) -> Classified | None:
    for cls, error_class, code in table:
        if isinstance(exc, cls):
            response = getattr(exc, "response", None)
            hint = _hint(response, body, now) if error_class is APP else None
            return Classified(error_class, code, retry_after=hint)
    return None


def _from_status(status: int, response: Any, now: datetime, body: object = None) -> Classified:
    error_class = classify_http_status(status)
    if error_class is ErrorClass.VALID:  # an exception carrying a 2xx: nothing we understand
        return Classified(INFRA, f"HTTP_{status}")
    hint = _hint(response, body, now) if error_class is APP else None
    return Classified(error_class, f"HTTP_{status}", retry_after=hint)


def _from_errno(number: int) -> Classified:
    name = errno.errorcode.get(number, f"ERRNO_{number}")
    if name in _PERMANENT_ERRNO:
        return Classified(PERMANENT, name)
    return Classified(INFRA, name)


def _status_attribute(exc: BaseException) -> int | None:
    for attr in ("status_code", "status"):
        value = getattr(exc, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _hint(response: Any, body: object, now: datetime) -> float | None:
    headers = getattr(response, "headers", None)
    if headers is None or not hasattr(headers, "get"):
        headers = {}
    return retry_hint(headers, body, now=now)


def _json_body(response: Any) -> object:
    """The JSON body of an error response that was read (a streamed one may not be)."""
    try:
        return response.json()
    except Exception:  # not read, not JSON: no hint there
        return None


#: The limits whose ``anthropic-ratelimit-<limit>-reset`` header says when they refill.
RATE_LIMITS = ("requests", "tokens", "input-tokens", "output-tokens")


def retry_hint(headers: Mapping[str, str], body: object = None, *, now: datetime) -> float | None:
    """Seconds the server asked us to wait, from a response's ``headers`` (case-insensitive, as
    httpx gives them; a plain dict needs lower-case names) and its JSON ``body``, in the module's
    documented precedence; None when it gave no usable hint. Never negative. An absolute time
    is measured from the reply's ``Date`` (``now``, the worker's clock, without one:
    orchestrator.domain.reply_clock)."""
    millis = _number(headers.get("retry-after-ms"))
    if millis is not None:
        return max(0.0, millis / 1_000)
    value = headers.get("retry-after")
    at = reply_now(headers, now=now)
    if isinstance(value, str) and (seconds := parse_retry_after(value, now=at)) is not None:
        return seconds
    resets = ratelimit_reset(headers, now=now)
    if resets is not None:
        return resets
    return body_retry_after(body)


def ratelimit_reset(headers: Mapping[str, str], *, now: datetime) -> float | None:
    """Seconds until the latest ``anthropic-ratelimit-*-reset`` among the exhausted limits (its
    ``-remaining`` 0 or absent), from the reply's ``Date`` (``now``, the worker's clock,
    without one); None without one."""
    latest: datetime | None = None
    for limit in RATE_LIMITS:
        reset = headers.get(f"anthropic-ratelimit-{limit}-reset")
        if not isinstance(reset, str):
            continue
        remaining = _number(headers.get(f"anthropic-ratelimit-{limit}-remaining"))
        if remaining is not None and remaining > 0:
            continue  # this limit has room: it is not why we were refused
        try:
            when = datetime.fromisoformat(reset.strip())
        except ValueError:
            continue
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        if latest is None or when > latest:
            latest = when
    if latest is None:
        return None
    return max(0.0, (latest - reply_now(headers, now=now)).total_seconds())


def body_retry_after(body: object) -> float | None:
    """A ``retry_after`` (seconds) in a JSON error body: ``{"error": {"retry_after": 3}}`` first,
    else at the top level."""
    if not isinstance(body, dict):
        return None
    error = body.get("error")
    for where in (error if isinstance(error, dict) else {}, body):
        seconds = _number(where.get("retry_after"))
        if seconds is not None:
            return max(0.0, seconds)
    return None


def _number(value: object) -> float | None:
    """A finite number, from a number or a numeric string (not a bool); None otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        number = float(value)
    except (ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None
