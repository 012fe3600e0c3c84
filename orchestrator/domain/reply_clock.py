"""The instant a provider's reply is read against: what its absolute times (an HTTP-date
``Retry-After``, a rate limit's ``reset``) are measured from, to turn them into seconds.

A pause is a length the database adds to its own clock (docs/flow-control.md, "Pauses"), so
only this conversion could bring a worker's clock in: measured against a worker an hour fast, a
reset 30 s away is already past (no pause at all); an hour slow, it is an hour away. So the
reference is the reply's own ``Date`` header, the provider's clock, which every HTTP server with
a clock sends (RFC 9110, 6.6.1). Its resolution is a whole second, and the reply took a while to
arrive, so the worker's clock is taken instead when it reads within ``AGREEMENT_SECONDS`` after
the ``Date``: the clocks agree, and the worker's is the finer. A reply without a ``Date`` (or
with one that does not parse) is measured against the worker's clock.

Pure: the worker's clock is an argument.
"""

from __future__ import annotations

import email.utils
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta

#: How long after a reply's ``Date`` the worker's clock may read and still agree with it: the
#: ``Date``'s whole second, and the reply's way to the worker.
AGREEMENT_SECONDS = 2.0


def reply_now(headers: Mapping[str, str], *, now: datetime) -> datetime:
    """The instant to measure the reply's absolute times from: its ``Date`` (a ``date`` header,
    case-insensitive as httpx gives them; a plain dict needs the lower-case name), or ``now``,
    the worker's clock, when it agrees with that ``Date`` or the reply has none."""
    date = http_date(headers.get("date"))
    if date is None or date <= now < date + timedelta(seconds=AGREEMENT_SECONDS):
        return now
    return date


def http_date(value: object) -> datetime | None:
    """An HTTP-date (``Sun, 06 Nov 1994 08:49:37 GMT``), as an aware datetime; None if it is
    not one."""
    if not isinstance(value, str):
        return None
    try:
        when = email.utils.parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)
