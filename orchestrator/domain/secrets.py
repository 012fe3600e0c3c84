"""Secrets (API keys, bot tokens): read by name, never logged, redacted from what is stored.

``Secrets.get("ANTHROPIC_API_KEY")`` reads the environment variable of that name, else the file
of that name in the secrets directory (a Kubernetes Secret mounted as files; see
``Settings.secrets_dir``). Every value read is remembered in this process, and :func:`redact`
replaces it, wherever it appears, with ``[REDACTED:<name>]``: the errors and events the
orchestrator stores pass through it (an API error may echo a key, a URL may carry a bot
token), and so do log records once :class:`RedactingFilter` is on the handlers (the CLI puts it
there). Payloads name secrets; they never carry them.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

from orchestrator.domain.errors import PermanentError
from orchestrator.domain.log_records import extra_names

#: Values shorter than this are not redacted: replacing "1" everywhere would garble text.
MIN_REDACTED = 6

_known: dict[str, str] = {}  # secret value -> its name
_lock = threading.Lock()


class SecretMissing(PermanentError):
    def __init__(self, name: str, directory: Path) -> None:
        super().__init__(
            f"secret {name!r} is not set: neither an environment variable {name} nor a file "
            f"{directory / name}",
            code="SECRET_MISSING",
        )


class Secrets:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def get(self, name: str) -> str:
        """The secret ``name``, from the environment or the secrets directory; raises
        :class:`SecretMissing` (PERMANENT: retrying will not make it appear)."""
        value = os.environ.get(name)
        if value is None:
            try:
                value = (self.directory / name).read_text().strip()
            except OSError:
                raise SecretMissing(name, self.directory) from None
        remember(name, value)
        return value


def remember(name: str, value: str) -> None:
    """Redact ``value`` from now on."""
    if len(value) >= MIN_REDACTED:
        with _lock:
            _known[value] = name


def redact(text: str) -> str:
    for value, name in list(_known.items()):
        if value in text:
            text = text.replace(value, f"[REDACTED:{name}]")
    return text


def redact_json(value: Any) -> Any:
    """``value`` (JSON-like) with every known secret redacted from its strings."""
    if not _known:
        return value
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {redact_json(k): redact_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_json(v) for v in value]
    return value


class RedactingFilter(logging.Filter):
    """A handler filter: the formatted message, the traceback and the ``extra`` fields of each
    record, redacted (whichever format writes them out)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _known:
            return True
        record.msg, record.args = redact(record.getMessage()), None
        if record.exc_info:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        fields = vars(record)
        for name in extra_names(record):
            fields[name] = redact_json(fields[name])
        return True
