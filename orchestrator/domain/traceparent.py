"""W3C trace context (``traceparent``), checked at submit whether tracing is on or not.

A caller may hand a job the trace it belongs to: ``submit(..., traceparent="00-<trace id>-<span
id>-<flags>")``. It is checked here, without OpenTelemetry, so a malformed one is refused at
submit, naming the field, rather than silently starting a new trace in a worker later.
"""

from __future__ import annotations

import re

#: version-trace id-parent id-flags (https://www.w3.org/TR/trace-context/#traceparent-header).
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_TRACE_ID = re.compile(r"[0-9a-f]{32}")


def normalized(traceparent: str) -> str:
    """``traceparent`` as version 00 writes it; ValueError (saying why) when it is not one."""
    match = _TRACEPARENT.fullmatch(traceparent.strip())
    if match is None:
        raise ValueError("not a W3C traceparent: expected 00-<32 hex>-<16 hex>-<2 hex>, lowercase")
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        raise ValueError(f"not a W3C traceparent: version {version} does not allow this form")
    if not is_trace_id(trace_id) or span_id == "0" * 16:
        raise ValueError("not a W3C traceparent: its trace id and span id may not be all zeros")
    return f"00-{trace_id}-{span_id}-{flags}"


def trace_id_of(traceparent: str) -> str:
    return traceparent.split("-")[1]


def is_trace_id(text: str) -> bool:
    """Whether a job's ``trace_id`` can be a W3C trace id (32 lowercase hex digits, not all
    zeros): the default one is; one a caller chose may not be."""
    return _TRACE_ID.fullmatch(text) is not None and text != "0" * 32
