"""Classification is total, and each source of errors maps as docs/contracts.md says."""

import asyncio
import errno
import socket
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import anthropic
import httpx
import httpx2
import pydantic
import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.domain.classification import (
    RATE_LIMITS,
    Classified,
    ErrorClass,
    body_retry_after,
    classify,
    classify_http_status,
    ratelimit_reset,
    retry_hint,
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


# -- rate-limit hints and throttling ----------------------------------------------------------

NOW = datetime(2026, 11, 26, 12, 0, 0, tzinfo=UTC)


def _rfc3339(seconds: float) -> str:
    return (NOW + timedelta(seconds=seconds)).isoformat().replace("+00:00", "Z")


def test_hint_precedence_retry_after_ms_then_retry_after_then_resets_then_body() -> None:
    resets = {
        "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-requests-reset": _rfc3339(7),
    }
    body = {"error": {"type": "rate_limit_error", "retry_after": 9}}
    every = {"retry-after-ms": "1500", "retry-after": "4", **resets}
    assert retry_hint(every, body, now=NOW) == 1.5
    assert retry_hint({"retry-after": "4", **resets}, body, now=NOW) == 4
    assert retry_hint(resets, body, now=NOW) == 7
    assert retry_hint({}, body, now=NOW) == 9
    assert retry_hint({}, None, now=NOW) is None
    # An unreadable value gives way to the next source.
    assert retry_hint({"retry-after-ms": "soon", "retry-after": "4"}, now=NOW) == 4
    assert retry_hint({"retry-after": "whenever", **resets}, now=NOW) == 7
    bad_reset = {"anthropic-ratelimit-tokens-reset": "tomorrow"}
    assert retry_hint(bad_reset, {"retry_after": 2}, now=NOW) == 2


def test_the_latest_reset_among_the_exhausted_limits() -> None:
    headers = {
        "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-requests-reset": _rfc3339(5),
        "anthropic-ratelimit-tokens-remaining": "0",
        "anthropic-ratelimit-tokens-reset": _rfc3339(30),
        # Room left: not why the request was refused, however late its reset.
        "anthropic-ratelimit-input-tokens-remaining": "4000",
        "anthropic-ratelimit-input-tokens-reset": _rfc3339(90),
        # No remaining reported: counted as exhausted.
        "anthropic-ratelimit-output-tokens-reset": _rfc3339(12),
    }
    assert ratelimit_reset(headers, now=NOW) == 30
    del headers["anthropic-ratelimit-tokens-reset"]
    assert ratelimit_reset(headers, now=NOW) == 12
    assert ratelimit_reset({"anthropic-ratelimit-requests-reset": _rfc3339(-3)}, now=NOW) == 0
    offset = {"anthropic-ratelimit-tokens-reset": "2026-11-26T13:00:02+01:00"}
    assert ratelimit_reset(offset, now=NOW) == 2
    naive = {"anthropic-ratelimit-tokens-reset": "2026-11-26T12:00:06"}  # read as UTC
    assert ratelimit_reset(naive, now=NOW) == 6
    room = {
        "anthropic-ratelimit-requests-remaining": "3",
        "anthropic-ratelimit-requests-reset": _rfc3339(5),
    }
    assert ratelimit_reset(room, now=NOW) is None


SKEWS = st.floats(min_value=-86_400, max_value=86_400)


@given(
    sent=st.floats(min_value=0, max_value=0.999),
    way=st.floats(min_value=0, max_value=1),
    skew=SKEWS,
    wait=st.integers(min_value=0, max_value=3_600),
    how=st.sampled_from(["http-date", "reset"]),
)
def test_an_absolute_hint_is_read_against_the_reply_s_date_whatever_the_worker_s_clock(
    sent: float, way: float, skew: float, wait: int, how: str
) -> None:
    """The provider sends its reply ``sent`` into the second its ``Date`` names, asking to wait
    ``wait`` seconds (an HTTP-date ``retry-after``, whole seconds as the ``Date``; or a spent
    limit's reset, in milliseconds); the worker reads it ``way`` seconds later, its clock off by
    ``skew``. The seconds it reads are the true wait left within the ``Date``'s slack: never
    more than 2 s short, never longer than the reply's age. (Against the worker's clock, an hour
    fast turned any of them into 0, an hour slow into an hour more.)"""
    date = NOW
    provider = date + timedelta(seconds=sent)  # the true instant the reply was sent
    if how == "http-date":
        until = date + timedelta(seconds=wait)
        said = {"retry-after": format_datetime(until, usegmt=True)}
    else:
        until = provider + timedelta(seconds=wait)
        said = {"anthropic-ratelimit-requests-remaining": "0",
                "anthropic-ratelimit-requests-reset": until.isoformat().replace("+00:00", "Z")}  # fmt: skip
    headers = {"date": format_datetime(date, usegmt=True), **said}
    read_at = provider + timedelta(seconds=way)  # true time
    worker = read_at + timedelta(seconds=skew)
    hint = retry_hint(headers, now=worker)
    assert hint is not None
    left = (until - read_at).total_seconds()  # the true wait left
    assert max(0.0, left - 2) - 1e-6 <= hint <= max(0.0, left + sent + way) + 1e-6


def test_without_a_date_an_absolute_hint_is_read_against_the_worker_s_clock() -> None:
    resets = {"anthropic-ratelimit-requests-remaining": "0",
              "anthropic-ratelimit-requests-reset": _rfc3339(30)}  # fmt: skip
    until = format_datetime(NOW + timedelta(seconds=30), usegmt=True)
    for said in (resets, {"retry-after": until}):
        assert retry_hint(said, now=NOW) == 30
        assert retry_hint({"date": "yesterday", **said}, now=NOW) == 30  # a Date unread
        hour_early = format_datetime(NOW - timedelta(hours=1), usegmt=True)
        assert retry_hint({"date": hour_early, **said}, now=NOW) == 3_630  # the provider's
        assert retry_hint({"date": format_datetime(NOW, usegmt=True), **said},
                          now=NOW + timedelta(seconds=1.5)) == 28.5  # fmt: skip
    # A wait given in seconds is a length: no clock reads it.
    assert retry_hint({"date": hour_early, "retry-after": "7"}, now=NOW) == 7


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"type": "error", "error": {"type": "rate_limit_error", "retry_after": 3}}, 3),
        ({"retry_after": 2.5}, 2.5),
        ({"retry_after": "4"}, 4),
        ({"error": {"retry_after": 1}, "retry_after": 8}, 1),  # the error object's first
        ({"error": {"message": "slow down"}, "retry_after": 8}, 8),
        ({"error": "text", "retry_after": 8}, 8),
        ({"retry_after": -5}, 0),
        ({"retry_after": True}, None),
        ({"retry_after": None}, None),
        ({"retry_after": "NaN"}, None),
        ({"retry_after": float("inf")}, None),
        ({"retry_after": [3]}, None),
        ("retry_after: 3", None),
        ([{"retry_after": 3}], None),
        (None, None),
    ],
)
def test_retry_after_in_the_body(body: object, expected: float | None) -> None:
    assert body_retry_after(body) == expected


def _httpx2_status_error(
    status: int, headers: dict[str, str] | None = None, json: object = None
) -> httpx2.HTTPStatusError:
    response = httpx2.Response(status, headers=headers, json=json, request=ANTHROPIC_REQUEST)
    return httpx2.HTTPStatusError("boom", request=ANTHROPIC_REQUEST, response=response)


def _anthropic_with_body(
    cls: type[anthropic.APIStatusError], status: int, body: object, **headers: str
) -> BaseException:
    response = httpx2.Response(status, headers=headers, json=body, request=ANTHROPIC_REQUEST)
    return cls("error", response=response, body=body)


def test_every_source_reads_the_reset_headers_and_the_body() -> None:
    in_body = {"type": "error", "error": {"type": "rate_limit_error", "retry_after": 3}}
    reset = {
        "anthropic-ratelimit-tokens-remaining": "0",
        "anthropic-ratelimit-tokens-reset": (datetime.now(UTC) + timedelta(seconds=60)).isoformat(),
    }
    request = httpx.Request("POST", "http://127.0.0.1/v1/messages")
    raw = httpx.HTTPStatusError(
        "boom", request=request, response=httpx.Response(429, json=in_body, request=request)
    )
    assert classify(raw) == Classified(APP, "HTTP_429", retry_after=3)
    assert classify(_httpx2_status_error(529, json=in_body)) == Classified(
        APP, "HTTP_529", retry_after=3
    )
    sdk = _anthropic_with_body(anthropic.RateLimitError, 429, in_body)
    assert classify(sdk) == Classified(APP, "LLM_RATE_LIMITED", retry_after=3)
    from_headers = classify(_anthropic_with_body(anthropic.RateLimitError, 429, None, **reset))
    assert from_headers.retry_after is not None and 55 < from_headers.retry_after <= 60
    # An error event inside a stream that began with 200: its body's hint, not the headers'.
    in_stream = _anthropic_with_body(anthropic.APIStatusError, 200, in_body, **reset)
    assert classify(in_stream) == Classified(APP, "LLM_RATE_LIMITED", retry_after=3)
    # An unread streamed response has no body to read: no hint, no error.
    unread = httpx.Response(429, request=request, stream=httpx.ByteStream(b"{}"))
    assert (
        classify(httpx.HTTPStatusError("x", request=request, response=unread)).retry_after is None
    )


THROTTLED = [
    (_httpx_status_error(429), "rate_limited"),
    (_httpx_status_error(529), "overloaded"),
    (_httpx2_status_error(429), "rate_limited"),
    (_httpx2_status_error(529), "overloaded"),
    (_anthropic(anthropic.RateLimitError, 429), "rate_limited"),
    (_anthropic(anthropic.OverloadedError, 529), "overloaded"),
    (_anthropic(anthropic.APIStatusError, 429), "rate_limited"),
    (_anthropic(anthropic.APIStatusError, 529), "overloaded"),
    (_anthropic_with_body(anthropic.APIStatusError, 200,
                          {"error": {"type": "overloaded_error"}}), "overloaded"),
    (_anthropic_with_body(anthropic.APIStatusError, 200,
                          {"error": {"type": "rate_limit_error"}}), "rate_limited"),
    (type("ToolError", (Exception,), {"status_code": 429})(), "rate_limited"),
]  # fmt: skip


@pytest.mark.parametrize(("exc", "throttle"), THROTTLED)
def test_rate_limits_and_overloads_are_throttled(exc: BaseException, throttle: str) -> None:
    classified = classify(exc)
    assert classified.throttled
    assert classified.throttle == throttle
    assert classified.error_class is APP


@pytest.mark.parametrize(
    "exc",
    [
        _httpx_status_error(503),
        _httpx_status_error(408),
        _httpx_status_error(500),
        _httpx_status_error(400),
        _httpx2_status_error(503),
        _anthropic(anthropic.ServiceUnavailableError, 503),
        _anthropic(anthropic.InternalServerError, 500),
        _anthropic(anthropic.AuthenticationError, 401),
        anthropic.APITimeoutError(request=ANTHROPIC_REQUEST),
        anthropic.APIConnectionError(request=ANTHROPIC_REQUEST),
        httpx.ReadTimeout("r", request=REQ),
        RetryLater(3),
        TimeoutError(),
        ValueError("429"),
    ],
)
def test_other_failures_are_not_throttled(exc: BaseException) -> None:
    classified = classify(exc)
    assert not classified.throttled
    assert classified.throttle is None


header_values = st.one_of(
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30),
    st.integers(-(10**6), 10**6).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.integers(-3600, 3600).map(lambda s: _rfc3339(s)),
)
header_names = st.sampled_from(
    ["retry-after", "retry-after-ms"]
    + [f"anthropic-ratelimit-{limit}-{part}" for limit in RATE_LIMITS
       for part in ("limit", "remaining", "reset")]
)  # fmt: skip
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["retry_after", "error", "type"]), inner, max_size=3)
    ),
    max_leaves=8,
)


@given(st.dictionaries(header_names, header_values), json_values)
def test_hints_are_total_and_never_negative(headers: dict[str, str], body: object) -> None:
    hint = retry_hint(headers, body, now=NOW)
    assert hint is None or (hint >= 0 and hint == hint and hint != float("inf"))


@given(st.dictionaries(header_names, header_values), json_values,
       st.floats(0, 1e6), st.floats(0, 1e6))  # fmt: skip
def test_a_readable_header_hint_always_wins(
    headers: dict[str, str], body: object, millis: float, seconds: float
) -> None:
    assert retry_hint({**headers, "retry-after-ms": repr(millis)}, body, now=NOW) == millis / 1_000
    without_ms = {k: v for k, v in headers.items() if k != "retry-after-ms"}
    assert retry_hint({**without_ms, "retry-after": repr(seconds)}, body, now=NOW) == seconds


@given(st.lists(st.tuples(st.sampled_from(RATE_LIMITS), st.integers(0, 5),
                          st.integers(-100, 3600)), max_size=4), json_values)  # fmt: skip
def test_resets_win_over_the_body_and_name_the_latest_exhausted(
    limits: list[tuple[str, int, int]], body: object
) -> None:
    headers: dict[str, str] = {}
    for limit, remaining, seconds in limits:
        headers[f"anthropic-ratelimit-{limit}-remaining"] = str(remaining)
        headers[f"anthropic-ratelimit-{limit}-reset"] = _rfc3339(seconds)
    exhausted = {
        limit: seconds
        for limit, remaining, seconds in limits
        if headers[f"anthropic-ratelimit-{limit}-remaining"] == "0"
        and headers[f"anthropic-ratelimit-{limit}-reset"] == _rfc3339(seconds)
    }
    if exhausted:
        assert retry_hint(headers, body, now=NOW) == max(0, max(exhausted.values()))
    else:
        assert retry_hint(headers, body, now=NOW) == body_retry_after(body)


@given(st.integers(100, 599), st.dictionaries(header_names, header_values), json_values)
def test_throttled_exactly_for_429_and_529(
    status: int, headers: dict[str, str], body: object
) -> None:
    for exc in (
        _httpx_status_error(status, headers),
        _httpx2_status_error(status, headers),
        _anthropic_with_body(anthropic.APIStatusError, status, body, **headers)
        if status >= 300 else _httpx_status_error(status, headers),
    ):  # fmt: skip
        classified = classify(exc)
        assert classified.throttled is (status in (429, 529))
        if classified.error_class is not APP:
            assert classified.retry_after is None
