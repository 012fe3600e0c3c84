"""What the dashboard's pages show, computed from what the stores return: pure functions, so
the templates only lay them out (and the tests can check them without a browser)."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from orchestrator.domain.backoff import app_delay_bounds_ms, graphile_delay_seconds
from orchestrator.domain.classification import ErrorClass
from orchestrator.domain.models import DeadLetter, Job, JobEvent
from orchestrator.domain.rollups import Stats
from orchestrator.domain.states import TERMINAL, Status
from orchestrator.interfaces.render import event_detail, first_line
from orchestrator.storage.rows import ApprovalRecord
from retry_config import JobRetryConfig

#: Rows of a backoff schedule shown at most (a type may allow thousands of retries).
SCHEDULE_ROWS = 12


def layer_of(error_class: ErrorClass | str | None) -> str | None:
    """Which layer retries a job in RETRY, from its last failure's class: the infrastructure
    layer re-runs the dispatch after a TRANSIENT_INFRA failure; every other retry (a
    TRANSIENT_APP failure, a swept zombie, a RetryLater) is the application layer's."""
    if error_class is None:
        return None
    return "infra" if ErrorClass(error_class) is ErrorClass.TRANSIENT_INFRA else "app"


@dataclass(frozen=True)
class Delay:
    retry: int
    low_s: float
    high_s: float

    @property
    def text(self) -> str:
        if self.low_s == self.high_s:
            return seconds(self.low_s)
        return f"{seconds(self.low_s)} to {seconds(self.high_s)}"


def app_schedule(config: JobRetryConfig) -> list[Delay]:
    """The application layer's delays before retries 1..n (their jitter's range)."""
    rows = []
    for n in range(1, min(config.app_max_retries, SCHEDULE_ROWS) + 1):
        low, high = app_delay_bounds_ms(n, config.backoff)
        rows.append(Delay(n, low / 1000, high / 1000))
    return rows


def infra_schedule(config: JobRetryConfig) -> list[Delay]:
    """Graphile Worker's delays after runs 1..max-1 of a dispatch (no jitter)."""
    runs = range(1, min(config.worker_max_attempts - 1, SCHEDULE_ROWS) + 1)
    return [Delay(run, graphile_delay_seconds(run), graphile_delay_seconds(run)) for run in runs]


def seconds(value: float) -> str:
    """A duration as people read it: 850 ms, 12.5 s, 3 min 20 s, 2 h 5 min."""
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 60:
        return f"{value:.3g} s"
    if value < 3600:
        return f"{int(value // 60)} min {int(value % 60)} s"
    return f"{int(value // 3600)} h {int(value % 3600 // 60)} min"


def ago(when: datetime | None, now: datetime) -> str:
    if when is None:
        return "never"
    return f"{seconds(max(0.0, (now - when).total_seconds()))} ago"


def readable(payload: Any) -> list[tuple[str, str]]:
    """An event's payload as (field, text) lines: scalars as they are, a nested value as compact
    JSON, empty fields left out (a person reads the lines; the raw JSON is shown beside)."""
    if not isinstance(payload, dict):
        return [("value", _text(payload))]
    lines = []
    for key, value in payload.items():
        if value is None or value == "" or value == {} or value == []:
            continue
        if isinstance(value, dict) and {"message", "code"} <= value.keys():
            value = f"[{value.get('classification', '')} {value['code']}] {value['message']}"
        lines.append((key.replace("_", " "), _text(value)))
    return lines


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def pretty(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=2, sort_keys=True)


@dataclass(frozen=True)
class Counts:
    """Unfinished jobs counted three ways, and the recent outcomes."""

    by_status: dict[str, int]
    by_type: dict[str, int]
    by_tenant: dict[str, int]
    finished: int
    failed: int
    window_s: float
    #: Jobs failed for good in the window, counted from their events as they happen (the
    #: rollups' ``failed`` counts them only once their minute is rolled up).
    failed_now: int = 0

    @property
    def per_second(self) -> float:
        return self.finished / self.window_s

    @property
    def failure_share(self) -> float:
        return self.failed / self.finished if self.finished else 0.0


def counts(
    jobs: list[dict[str, Any]],
    outcomes: dict[str, int],
    window_s: float,
    tenants: frozenset[str] | None,
    failed_now: int = 0,
) -> Counts:
    """From the fleet's rows (status, job_type, tenant, n), those of the principal's tenants."""
    by_status: Counter[str] = Counter({s.value: 0 for s in Status if s not in TERMINAL})
    by_type: Counter[str] = Counter()
    by_tenant: Counter[str] = Counter()
    for row in jobs:
        tenant = row["tenant"] or None
        if tenants is not None and tenant not in tenants:
            continue
        by_status[row["status"]] += row["n"]
        by_type[row["job_type"]] += row["n"]
        by_tenant[tenant or "(none)"] += row["n"]
    finished = sum(outcomes.values())
    return Counts(
        dict(by_status), dict(by_type.most_common()), dict(by_tenant.most_common()),
        finished, outcomes.get(Status.FAILED.value, 0), window_s, failed_now,
    )  # fmt: skip


# -- charts (inline SVG, drawn here: the page loads nothing from elsewhere) -------------------

#: The drawing's size in SVG units (it scales to its box).
CHART_WIDTH, CHART_HEIGHT = 600, 160


@dataclass(frozen=True)
class Line:
    name: str  # its CSS class (chart-<name>) and legend
    points: str  # an SVG polyline's points
    total: int
    peak: int


@dataclass(frozen=True)
class Chart:
    title: str
    lines: list[Line]
    top: int  # the value at the top edge
    start: str  # the x axis' ends and middle, as people read them
    end: str
    unit: str  # what one point is: "per minute", "per hour"
    nothing: str  # what it says when every line is 0
    y_label: str = "jobs"  # what the y axis counts
    middle: str = ""
    width: int = CHART_WIDTH
    height: int = CHART_HEIGHT

    @property
    def empty(self) -> bool:
        return all(line.total == 0 for line in self.lines)

    @property
    def ticks(self) -> list[str]:
        """The y axis' scale, top to bottom, at the top, the middle and the bottom edge."""
        return [f"{self.top:g}", f"{self.top / 2:g}", "0"]

    @property
    def gridlines(self) -> list[float]:
        """Where the ticks' lines are drawn (SVG units from the top)."""
        return [0.0, self.height / 2]


def chart(
    title: str,
    steps: list[datetime],
    series: dict[str, dict[datetime, int]],
    *,
    unit: str,
    known_until: datetime | None,
    sums: bool = True,
    nothing: str = "no jobs in the rollups yet",
    y_label: str = "jobs",
) -> Chart:
    """Lines of ``series`` (name -> value per step; a step missing is 0) over ``steps``, scaled
    to a round top, drawn up to ``known_until`` (the steps after it are not known yet: not
    drawn as zeros); ``sums``: a line's total is the sum of its steps (else its last value);
    ``nothing``: what an empty chart says; ``y_label``: what its y axis counts."""
    peak = max((v for values in series.values() for v in values.values()), default=0)
    top = round_up(peak)
    last = max(len(steps) - 1, 1)
    known = [at for at in steps if known_until is None or at < known_until]
    lines = []
    for name, values in series.items():
        ys = [values.get(at, 0) for at in known]
        points = " ".join(
            f"{i * CHART_WIDTH / last:.1f},{CHART_HEIGHT - y * CHART_HEIGHT / top:.1f}"
            for i, y in enumerate(ys)
        )
        total = sum(ys) if sums else (ys[-1] if ys else 0)
        lines.append(Line(name, points, total, max(ys, default=0)))
    days = bool(steps) and steps[-1] - steps[0] > timedelta(hours=12)
    start, end = (_clock(steps[0], days), _clock(steps[-1], days)) if steps else ("", "")
    middle = _clock(steps[len(steps) // 2], days) if steps else ""
    return Chart(title, lines, top, start, end, unit, nothing, y_label, middle)


def last_sample(stats: Stats) -> datetime | None:
    """Just after the newest queue depth sample of the read (None: no sample)."""
    newest = max((p.at for s in stats.queue_depth for p in s.points), default=None)
    return None if newest is None else newest + timedelta(seconds=stats.step)


def round_up(value: float) -> int:
    """The smallest of 1, 2, 5 times a power of ten at or above ``value`` (1 at least)."""
    top, factors = 1, itertools.cycle((2, 2.5, 2))  # 1, 2, 5, 10, 20, 50, ...
    while top < value:
        top = int(top * next(factors))
    return top


def _clock(when: datetime, days: bool) -> str:
    return f"{when:%a %H:%M} UTC" if days else f"{when:%H:%M} UTC"


def steps_of(since: datetime, until: datetime, step: int) -> list[datetime]:
    """Every step's start in ``[since, until)``."""
    count = int((until - since).total_seconds() // step)
    return [since + timedelta(seconds=step * i) for i in range(count)]


def outcome_series(stats: Stats) -> dict[str, dict[datetime, int]]:
    """Per step: jobs completed, failed, and retries scheduled (both layers), summed over the
    read's series."""
    lines: dict[str, dict[datetime, int]] = {"completed": {}, "failed": {}, "retried": {}}
    for series in stats.jobs:
        for p in series.points:
            for name, n in (("completed", p.completed), ("failed", p.failed),
                            ("retried", p.app_retries + p.infra_retries)):  # fmt: skip
                lines[name][p.at] = lines[name].get(p.at, 0) + n
    return lines


def depth_series(stats: Stats) -> dict[str, dict[datetime, int]]:
    lines: dict[str, dict[datetime, int]] = {"waiting": {}, "running": {}}
    for series in stats.queue_depth:
        for p in series.points:
            lines["waiting"][p.at] = lines["waiting"].get(p.at, 0) + p.waiting
            lines["running"][p.at] = lines["running"].get(p.at, 0) + p.running
    return lines


#: The usage page's grouping columns: each group's heading.
USAGE_COLUMN = {"job": "Job", "tenant": "Tenant", "agent": "Agent", "model": "Model",
                "job_type": "Job type"}  # fmt: skip


# -- a job's page: its summary, condensed events, steps and transcript ------------------------

#: A failure's class in words: what it means for the job.
CLASS_WORDS = {
    ErrorClass.TRANSIENT_INFRA: "an infrastructure failure (its run is retried)",
    ErrorClass.TRANSIENT_APP: "a transient failure (retried with backoff while retries last)",
    ErrorClass.PERMANENT: "a permanent failure (never retried)",
    ErrorClass.INVALID_OUTPUT: "an output that did not fit its type (never retried)",
    ErrorClass.VALID: "no failure",
}


@dataclass(frozen=True)
class Summary:
    """A job's page's first lines: where it stands, why, what happens next, what to do."""

    why: str | None
    next: str
    todo: str | None
    notified: str | None  # after a failure for good: who was told (the job.degraded event)


def ceiling(events: list[JobEvent]) -> int | None:
    """The most attempts the job can reach if every try fails, as its newest event that says
    so reports it (events.py: it falls as retries are spent, and rises at a fresh dispatch)."""
    for event in reversed(events):
        if "max_attempts" in event.payload:
            return int(event.payload["max_attempts"])
    return None


def summary(
    job: Job, events: list[JobEvent], letter: DeadLetter | None,
    approval: ApprovalRecord | None, now: datetime,
) -> Summary:  # fmt: skip
    error = job.last_error
    why = (
        f"{CLASS_WORDS[error.classification]}: {error.code}: {first_line(error.message)}"
        if error is not None and job.status in (Status.RETRY, Status.FAILED)
        else None
    )
    degraded = next((e for e in reversed(events) if e.kind == "job.degraded"), None)
    notified = event_detail(degraded) if degraded is not None else None
    nxt, todo = _next(job, events, letter, approval, now)
    return Summary(why, nxt, todo, notified)


def _next(
    job: Job, events: list[JobEvent], letter: DeadLetter | None,
    approval: ApprovalRecord | None, now: datetime,
) -> tuple[str, str | None]:  # fmt: skip
    """What happens next, and what an operator may do about it."""
    most = ceiling(events)
    of = f" of at most {most}" if most is not None else ""
    match job.status:
        case Status.RETRY if job.next_retry_at is not None:
            layer = layer_of(job.last_error.classification) if job.last_error else "app"
            return (
                f"retries at {clock(job.next_retry_at)}, attempt {job.attempt + 1}{of} "
                f"({layer} layer)",
                "wait, or cancel it",
            )
        case Status.WAITING_APPROVAL:
            asked = f": {approval['question']}" if approval is not None else ""
            return f"waits for approval{asked}", "approve or reject it below"
        case Status.RUNNING:
            return f"runs attempt {job.attempt}{of} on {job.locked_by}", None
        case Status.BLOCKED:
            waits = job.waiting_for or "waiting for other jobs to end"
            return f"{waits}; runs once they have, holding no worker meanwhile", None
        case Status.PENDING if job.waiting_for:
            return job.waiting_for, None
        case Status.PENDING if job.run_at > now:
            return f"runs at {clock(job.run_at)} ({_in(job.run_at, now)})", None
        case Status.PENDING:
            return f"waits for a worker of queue {job.queue}", None
        case Status.FAILED if letter is not None and letter.state == "recorded":
            return "dead-lettered: review it", "requeue it as a new job, or request its discard"
        case Status.FAILED if letter is not None and letter.requeued_job_id is not None:
            return f"nothing: requeued as job {letter.requeued_job_id}", None
        case Status.FAILED if letter is not None:
            return f"nothing: its dead letter is {letter.state.replace('_', ' ')}", None
    return f"nothing: it is {job.status.value.lower()}", None


def clock(when: datetime) -> str:
    return f"{when.astimezone(UTC):%H:%M:%S} UTC"


def _in(when: datetime, now: datetime) -> str:
    left = (when - now).total_seconds()
    return f"in {seconds(left)}" if left > 0 else "due now"


@dataclass(frozen=True)
class EventLine:
    """One event as a line: when, what, the fields that matter (the rest a click away)."""

    event: JobEvent
    text: str


def event_lines(events: list[JobEvent]) -> list[EventLine]:
    """Each event in words (the command line's, render.event_detail); an event that reports
    ``max_attempts`` says what it is: the ceiling from there, not a budget."""
    lines = []
    for event in events:
        text = event_detail(event)
        if "max_attempts" in event.payload and event.kind != "job.failed":
            text += f" · at most {event.payload['max_attempts']} attempts from here"
        lines.append(EventLine(event, text))
    return lines


def short_ids(ids: list[UUID], *, least: int = 8) -> dict[UUID, str]:
    """Each id by its shortest prefix (``least`` characters at least) that no other id of the
    list shares: UUIDv7 ids made close together share their time's first characters."""
    texts = {i: str(i) for i in ids}
    shown = {}
    for i, text in texts.items():
        others = [t for j, t in texts.items() if j != i]
        n = least
        while n < len(text) and any(o.startswith(text[:n]) for o in others):
            n += 1
        shown[i] = text if n >= len(text) else text[:n] + "…"
    return shown


@dataclass(frozen=True)
class ToolCall:
    id: str
    tool: str
    args: str
    output: str
    error: str | None


@dataclass(frozen=True)
class TurnView:
    """One turn of an agent's transcript: who spoke, what was said, the tools it called."""

    role: str
    text: str
    calls: list[ToolCall]


@dataclass(frozen=True)
class TranscriptView:
    turns: list[TurnView]
    answer: str | None
    steps: int


def transcript(result: Any) -> TranscriptView | None:
    """An agent job's result (tasks/agent.py's Transcript) as its turns, or None when the
    result is not one."""
    if not (isinstance(result, dict) and isinstance(result.get("messages"), list)
            and "tool_calls" in result):  # fmt: skip
        return None
    calls = {c.get("id"): c for c in result.get("tool_calls") or [] if isinstance(c, dict)}
    turns = []
    for message in result["messages"]:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        texts, used = [], []
        for block in blocks if isinstance(blocks, list) else []:
            match block.get("type") if isinstance(block, dict) else None:
                case "text":
                    texts.append(str(block.get("text", "")))
                case "tool_use":
                    call = calls.get(block.get("id"), {})
                    used.append(ToolCall(
                        str(block.get("id")), str(block.get("name")), _text(block.get("input", {})),
                        _text(call.get("output")) if call else "", call.get("error"),
                    ))  # fmt: skip
        if texts or used:
            turns.append(TurnView(str(message.get("role", "")), "\n".join(texts), used))
    answer = result.get("answer")
    if turns and not turns[-1].calls and turns[-1].text == answer:
        turns.pop()  # the answer, shown once, as such
    return TranscriptView(turns, answer if isinstance(answer, str) else None,
                          int(result.get("steps") or 0))  # fmt: skip
