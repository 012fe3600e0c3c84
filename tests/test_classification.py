"""Classification is total, and each source of errors maps as docs/contracts.md says."""

import asyncio
import errno
import socket

import anthropic
import httpx
import httpx2
import pydantic
import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.domain.classification import (
    Classified,
    ErrorClass,
    classify,
    classify_http_status,
)
from orchestrator.domain.errors import InvalidOutput, PermanentError, RetryLater

INFRA, APP = ErrorClass.TRANSIENT_INFRA, ErrorClass.TRANSIENT_APP
PERMANENT, INVALID = ErrorClass.PERMANENT, ErrorClass.INVALID_OUTPUT
FAILURES = {INFRA, APP, PERMANENT, INVALID}


def seed_table(status: int) -> ErrorClass:
    """The design's classifyHttpStatus, transcribed line by line."""
    if 200 <= status < 300:
        return ErrorClass.VALID
    if status == 429:
        return APP
    if status == 408:
        return APP
    if status == 502:
        return INFRA
    if status == 503:
        return APP
    if status == 504:
        return INFRA
    if status == 529:
        return APP
    if 400 <= status < 500:
        return PERMANENT
    if status >= 500:
        return INFRA
    return PERMANENT


@pytest.mark.parametrize("status", range(100, 600))
def test_http_status_table_matches_the_design(status: int) -> None:
    assert classify_http_status(status) == seed_table(status)


def _httpx_status_error(
    status: int, headers: dict[str, str] | None = None
) -> httpx.HTTPStatusError:
    request = httpx.Request("GET", "http://127.0.0.1/x")
    response = httpx.Response(status, headers=headers, request=request)
    return httpx.HTTPStatusError("boom", request=request, response=response)


def test_httpx_status_errors_use_the_table_and_the_retry_after_header() -> None:
    assert classify(_httpx_status_error(429, {"Retry-After": "12"})) == Classified(
        APP, "HTTP_429", retry_after=12
    )
    assert classify(_httpx_status_error(503)) == Classified(APP, "HTTP_503")
    assert classify(_httpx_status_error(502)) == Classified(INFRA, "HTTP_502")
    assert classify(_httpx_status_error(404)) == Classified(PERMANENT, "HTTP_404")
    # A hint on a permanent error is not a reason to wait.
    assert classify(_httpx_status_error(400, {"Retry-After": "5"})).retry_after is None


REQ = httpx.Request("GET", "http://127.0.0.1/")


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (httpx.ConnectTimeout("t", request=REQ), (INFRA, "CONNECT_TIMEOUT")),
        (httpx.ConnectError("c", request=REQ), (INFRA, "CONNECT_ERROR")),
        (httpx.ReadTimeout("r", request=REQ), (APP, "RESPONSE_TIMEOUT")),
        (httpx.WriteTimeout("w", request=REQ), (APP, "RESPONSE_TIMEOUT")),
        (httpx.PoolTimeout("p", request=REQ), (INFRA, "POOL_TIMEOUT")),
        (httpx.ReadError("r", request=REQ), (INFRA, "TRANSPORT_ERROR")),
        (httpx.RemoteProtocolError("r", request=REQ), (INFRA, "TRANSPORT_ERROR")),
        (httpx.UnsupportedProtocol("u", request=REQ), (PERMANENT, "UNSUPPORTED_PROTOCOL")),
        (httpx.TooManyRedirects("t", request=REQ), (PERMANENT, "TOO_MANY_REDIRECTS")),
        (httpx.DecodingError("d", request=REQ), (INVALID, "DECODING_ERROR")),
        (httpx.InvalidURL("bad"), (PERMANENT, "INVALID_URL")),
    ],
)
def test_httpx_transport_errors(exc: BaseException, expected: tuple[ErrorClass, str]) -> None:
    # Connect-phase failures are infrastructure; response timeouts are the app's (the timeout tree).
    assert (classify(exc).error_class, classify(exc).code) == expected


def _anthropic(cls: type[anthropic.APIStatusError], status: int, **headers: str) -> BaseException:
    request = httpx2.Request("POST", "http://127.0.0.1/v1/messages")
    response = httpx2.Response(status, headers=headers, request=request)
    return cls("error", response=response, body=None)


ANTHROPIC_REQUEST = httpx2.Request("POST", "http://127.0.0.1/v1/messages")


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (_anthropic(anthropic.RateLimitError, 429), APP),
        (_anthropic(anthropic.OverloadedError, 529), APP),
        (_anthropic(anthropic.AuthenticationError, 401), PERMANENT),
        (_anthropic(anthropic.BadRequestError, 400), PERMANENT),
        (_anthropic(anthropic.InternalServerError, 500), INFRA),
        (_anthropic(anthropic.ServiceUnavailableError, 503), APP),
        (_anthropic(anthropic.GatewayTimeoutError, 504), INFRA),
        (_anthropic(anthropic.NotFoundError, 404), PERMANENT),
        (_anthropic(anthropic.APIStatusError, 418), PERMANENT),
        (anthropic.APIConnectionError(request=ANTHROPIC_REQUEST), INFRA),
        (anthropic.APITimeoutError(request=ANTHROPIC_REQUEST), APP),
    ],
)
def test_anthropic_errors_by_class(exc: BaseException, expected: ErrorClass) -> None:
    assert classify(exc).error_class is expected


def test_anthropic_retry_hints_are_read_from_the_response() -> None:
    assert (
        classify(_anthropic(anthropic.RateLimitError, 429, **{"retry-after": "20"})).retry_after
        == 20
    )
    hinted = _anthropic(anthropic.OverloadedError, 529, **{"retry-after-ms": "1500"})
    assert classify(hinted).retry_after == 1.5


@pytest.mark.parametrize(
    ("name", "expected"),
    [("ECONNRESET", INFRA), ("ECONNREFUSED", INFRA), ("ECONNABORTED", INFRA), ("EPIPE", INFRA),
     ("ETIMEDOUT", INFRA), ("ENETUNREACH", INFRA), ("EHOSTUNREACH", INFRA),
     ("ENOENT", PERMANENT), ("EACCES", PERMANENT)],
)  # fmt: skip
def test_os_errors_by_errno_name(name: str, expected: ErrorClass) -> None:
    number = getattr(errno, name)
    result = classify(OSError(number, "x"))
    assert (result.error_class, result.code) == (expected, name)
    assert classify(ConnectionResetError(errno.ECONNRESET, "reset")).code == "ECONNRESET"


def test_dns_failures() -> None:
    assert classify(socket.gaierror(socket.EAI_AGAIN, "try again")).error_class is INFRA
    assert classify(socket.gaierror(socket.EAI_NONAME, "unknown host")) == Classified(
        PERMANENT, "ENOTFOUND"
    )


def test_timeouts_and_cancellation_are_transient_app() -> None:
    assert classify(TimeoutError()).error_class is APP  # asyncio.timeout, wait_for
    assert (
        classify(asyncio.CancelledError()).error_class is APP
    )  # drain: an AbortError in the design


def test_task_signals() -> None:
    assert classify(RetryLater(2.5)) == Classified(APP, "RETRY_LATER", retry_after=2.5)
    assert classify(PermanentError("no", code="QUOTA")) == Classified(PERMANENT, "QUOTA")
    assert classify(PermanentError("no")).code == "PERMANENT_ERROR"
    assert classify(InvalidOutput("bad shape")).error_class is INVALID
    with pytest.raises(ValueError):
        RetryLater(-1)


def test_pydantic_validation_errors_are_invalid_output() -> None:
    class Out(pydantic.BaseModel):
        status: int

    with pytest.raises(pydantic.ValidationError) as info:
        Out.model_validate({"status": "two hundred"})
    assert classify(info.value).error_class is INVALID


def test_objects_with_a_status_attribute_use_the_table() -> None:
    class ToolError(Exception):
        status_code = 429

    assert classify(ToolError()).error_class is APP


def test_unknown_errors_are_transient_infra() -> None:
    assert classify(ValueError("?")) == Classified(INFRA, "UNKNOWN:ValueError")
    assert classify(KeyError("k")).error_class is INFRA


@pytest.mark.logs_errors(
    r"orchestrator\.domain\.classification: classifier <function .*broken at \w+> failed; ignoring it"
)
def test_user_classifiers_run_first_in_order_and_may_decline() -> None:
    class Quota(Exception):
        pass

    def declines(exc: BaseException) -> Classified | None:
        return None

    def quota(exc: BaseException) -> Classified | None:
        return Classified(PERMANENT, "QUOTA") if isinstance(exc, Quota) else None

    def broken(exc: BaseException) -> Classified | None:
        raise RuntimeError("classifier bug")

    assert classify(Quota(), [declines, broken, quota]) == Classified(PERMANENT, "QUOTA")
    assert classify(ValueError(), [declines, broken, quota]).error_class is INFRA


class Hostile(Exception):
    def __getattribute__(self, name: str) -> object:
        if name in {"status_code", "status", "errno", "response"}:
            raise RuntimeError("no attributes for you")
        return super().__getattribute__(name)


exceptions = st.one_of(
    st.builds(Exception, st.text()),
    st.builds(OSError, st.integers(-5, 200), st.text()),
    st.builds(TimeoutError),
    st.builds(lambda s: type("E", (Exception,), {"status": s})(), st.integers(-1000, 1000)),
    st.builds(lambda s: type("E", (Exception,), {"status_code": s})(), st.integers(100, 999)),
    st.builds(lambda s: _httpx_status_error(s), st.integers(100, 599)),
    st.builds(lambda d: RetryLater(d), st.floats(0, 1e9)),
    st.builds(Hostile),
)


@pytest.mark.logs_errors(
    r"classifying <class 'tests\.test_classification\.Hostile'> failed; treating it as"
)
@given(exceptions)
def test_classification_is_total(exc: BaseException) -> None:
    result = classify(exc)
    assert result.error_class in FAILURES
    assert result.code
    assert result.retry_after is None or result.retry_after >= 0
