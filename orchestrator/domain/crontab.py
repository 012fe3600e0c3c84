"""A crontab file in Graphile Worker's format, read as schedules, so a team moving from it keeps
its file as it is::

    # ┌ minute ┌ hour ┌ day of month ┌ month ┌ day of week
    0 7 * * 1-5 send_digest ?fill=2h&max=3&id=weekday_digest&queue=mail&priority=2 {"team": "a"}

Honoured: ``id`` (the schedule's name; the job type's by default), ``fill`` (the backfill
window, a time phrase: ``1w2d3h4m5s``), ``max`` (Graphile's maxAttempts: N attempts are N-1
application retries here), ``queue``, ``priority`` (lower runs first, as there). Two options of
this project's: ``tz`` (an IANA zone; Graphile reads its crontab in UTC, as this does without
it) and ``tenant``. Refused, each with why: ``jobKey`` and ``jobKeyMode`` (every run's key is
derived from its schedule and tick). The payload is JSON (Graphile reads JSON5), and is passed
as it is: Graphile's ``_cron`` field is not added (the run's ``run_at`` is its tick).
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import parse_qsl

from orchestrator.domain.errors import ConfigError
from orchestrator.domain.schedules import Schedule, define

#: Graphile's CRONTAB_COMMAND: the task, then ?options, then a {payload}.
_COMMAND = re.compile(r"^([_a-zA-Z][_a-zA-Z0-9:/_-]*)(?:\s+\?(\S+))?(?:\s+(\{.*\}))?$")
_PHRASE = re.compile(r"([0-9]+)([smhdw])")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}
_REFUSED = {
    "jobKey": "every run's job key is schedule/<id>/<tick>, so two ticks never replace each other",
    "jobKeyMode": "every run's job key is schedule/<id>/<tick>, so two ticks never replace each "
    "other",
}


def parse(text: str, source: str) -> list[Schedule]:
    """The schedules of a crontab's ``text``; ConfigError naming ``source``, the line and the
    problem, one line per problem (every problem at once)."""
    schedules: dict[str, tuple[int, Schedule]] = {}
    problems = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            schedule = _line(line.strip(), f"{source}:{number}")
        except ConfigError as exc:
            problems.append(str(exc))
            continue
        if schedule.name in schedules:
            first = schedules[schedule.name][0]
            problems.append(
                f"{source}:{number}: schedule {schedule.name!r} is already on line {first}: "
                "give one of them another ?id="
            )
            continue
        schedules[schedule.name] = (number, schedule)
    if problems:
        raise ConfigError("\n".join(problems))
    return [schedule for _, schedule in schedules.values()]


def _line(line: str, where: str) -> Schedule:
    parts = line.split(None, 5)
    if len(parts) < 6:
        raise ConfigError(
            f"{where}: expected five time fields (minute hour day month weekday) and a task"
        )
    *fields, command = parts
    found = _COMMAND.match(command)
    if found is None:
        raise ConfigError(f"{where}: not a task, ?options and {{payload}}: {command!r}")
    task, query, payload_text = found.groups()
    options = _options(query or "", where)
    name = options.pop("id", task)
    payload = None
    if payload_text is not None:
        try:
            payload = json.loads(payload_text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: the payload is not JSON: {exc}") from None
    return define(name, task, source=where, cron=" ".join(fields), payload=payload, **options)


def _options(query: str, where: str) -> dict[str, Any]:
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ConfigError(f"{where}: options are not key=value&...: {query!r}") from None
    options: dict[str, Any] = {}
    seen = set()
    for key, value in pairs:
        if key in seen:
            raise ConfigError(f"{where}: option {key!r} is given twice")
        seen.add(key)
        if key in _REFUSED:
            raise ConfigError(f"{where}: option {key!r} is not honoured: {_REFUSED[key]}")
        match key:
            case "id":
                options["id"] = value
            case "fill":
                options["backfill_seconds"] = _seconds(value, where)
            case "max":
                options["max_retries"] = _attempts(value, where) - 1
            case "queue":
                options["queue"] = value
            case "priority":
                options["priority"] = _integer(key, value, where)
            case "tz":
                options["tz"] = value
            case "tenant":
                options["tenant_id"] = value
            case _:
                raise ConfigError(
                    f"{where}: unknown option {key!r}; known: id, fill, max, queue, priority, "
                    "tz, tenant"
                )
    return options


def _seconds(phrase: str, where: str) -> int:
    """Graphile's time phrase (``1d12h``) in seconds."""
    if not phrase or _PHRASE.sub("", phrase):
        raise ConfigError(
            f"{where}: fill={phrase!r} is not a time phrase (e.g. 30m, 1d12h: s m h d w)"
        )
    return sum(int(n) * _SECONDS[unit] for n, unit in _PHRASE.findall(phrase))


def _attempts(value: str, where: str) -> int:
    attempts = _integer("max", value, where)
    if attempts < 1:
        raise ConfigError(f"{where}: max={value!r}: a job makes at least one attempt")
    return attempts


def _integer(key: str, value: str, where: str) -> int:
    if not re.fullmatch(r"-?[0-9]{1,10}", value):
        raise ConfigError(f"{where}: {key}={value!r} is not a whole number")
    return int(value)
