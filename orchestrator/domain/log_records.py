"""Which attributes of a log record a caller added (``extra={...}``, the attempt's fields), as
opposed to those :mod:`logging` sets itself: they are redacted and written out like the
message."""

from __future__ import annotations

import logging
from collections.abc import Iterator

#: What every LogRecord has, plus what formatting adds to it.
_OWN = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


def extra_names(record: logging.LogRecord) -> Iterator[str]:
    return (name for name in list(vars(record)) if name not in _OWN)
