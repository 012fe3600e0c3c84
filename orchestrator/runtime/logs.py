"""What a worker says, and how: its start line and each job's outcome at INFO, as plain text
(for a terminal) or one JSON object per line (``ORCHESTRATOR_LOG_FORMAT=json``, for a log
collector). Either way every record logged inside an attempt carries the attempt's fields
(orchestrator.runtime.current_attempt), and known secrets are redacted."""

from __future__ import annotations

import copy
import json
import logging
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

from orchestrator.domain.log_records import extra_names
from orchestrator.domain.secrets import RedactingFilter
from orchestrator.runtime import current_attempt

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

LogFormat = Literal["text", "json"]


class AttemptFields(logging.Filter):
    """A handler filter: each record logged inside an attempt gets the attempt's fields
    (job_id, job_type, attempt, trace_id, worker) as attributes, unless it has them already."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = current_attempt.fields()
        if fields is not None:
            own = vars(record)
            for name, value in fields.items():
                own.setdefault(name, value)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: time (UTC, ISO 8601), level, logger, message,
    exception (the traceback's text) and stack when there are, then every other field of the
    record: the attempt's, and what the code passed as ``extra``."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        fields = vars(record)
        for name in extra_names(record):
            entry.setdefault(name, fields[name])
        return json.dumps(entry, default=str)


#: Loggers that say the same thing once per attempt while the database is away: the pool's
#: (each connection attempt, about every second), the due-time refresh's (twice a second) and
#: the listeners' (each reconnection).
REPEATING = ("psycopg.pool", "orchestrator.runtime.wakeups", "orchestrator.watch")
REPEAT_SECONDS = 60.0


class QuietRepeats:
    """Which records of a REPEATING logger to write: the first, and then, while the same line
    (the same message template) keeps coming, one every ``every`` seconds. An outage is then a
    few lines, not one per attempt."""

    def __init__(self, loggers: tuple[str, ...] = REPEATING, every: float = REPEAT_SECONDS):
        self.loggers = loggers
        self.every = every
        self._last: dict[tuple[str, str], tuple[float, int]] = {}  # -> (passed at, left out)

    def left_out(self, record: logging.LogRecord) -> int | None:
        """None to hold ``record`` back; otherwise how many like it were held back since the
        last one written."""
        if not record.name.startswith(self.loggers):
            return 0
        key = (record.name, str(record.msg))
        passed_at, left_out = self._last.get(key, (-self.every, 0))
        if record.created - passed_at < self.every:
            self._last[key] = (passed_at, left_out + 1)
            return None
        self._last[key] = (record.created, 0)
        return left_out


class OrchestratorHandler(logging.StreamHandler[TextIO]):
    """The handler (to stderr) the orchestrator writes through when it sets up logging itself
    (a worker with none configured, the CLI): prepared (``prepare``), and repeated lines
    quietened (QuietRepeats). A line written after some like it were held back says how many,
    on a copy of the record: the application's other handlers see the record as it was
    logged."""

    def __init__(self, log_format: LogFormat) -> None:
        super().__init__()
        self.repeats = QuietRepeats()
        prepare(self, log_format)

    def handle(self, record: logging.LogRecord) -> Any:
        left_out = self.repeats.left_out(record)
        if left_out is None:
            return False
        if left_out:
            record = copy.copy(record)
            every = self.repeats.every
            record.msg = f"{record.msg} [{left_out} more like it in the last {every:.0f} s]"
        return super().handle(record)


def formatter(log_format: LogFormat) -> logging.Formatter:
    return JsonFormatter() if log_format == "json" else logging.Formatter(FORMAT)


def prepare(handler: logging.Handler, log_format: LogFormat) -> None:
    """Make ``handler`` (an application's own) write in ``log_format``, each record with its
    attempt's fields and secrets redacted (the fields first, so they are redacted too)."""
    handler.setFormatter(formatter(log_format))
    handler.addFilter(AttemptFields())
    handler.addFilter(RedactingFilter())


def make_visible(log_format: LogFormat = "text") -> None:
    """When the application configured no logging at all, send the orchestrator's records to
    stderr from INFO up, in ``log_format``: whoever starts a worker sees what it does. Logging
    configured by the application is left as it is."""
    ours = logging.getLogger("orchestrator")
    if logging.getLogger().handlers or ours.handlers or ours.level != logging.NOTSET:
        return
    ours.addHandler(OrchestratorHandler(log_format))
    ours.setLevel(logging.INFO)
