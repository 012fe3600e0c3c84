"""How the command line (and the demo) shows jobs, their histories, dead letters and stats: as
an operator wants to read them, one fact per line."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from orchestrator.domain.applications import Applications
from orchestrator.domain.flow import FlowKey
from orchestrator.domain.models import Awaited, DeadLetter, Job, JobEvent
from orchestrator.domain.rollups import Stats
from orchestrator.domain.schedules import ScheduleView
from orchestrator.domain.states import Status
from orchestrator.domain.summary import FleetSummary, HeldKey
from orchestrator.domain.usage import GROUPS, JobUsage, UsageTotal, groups_of
from orchestrator.services.retention import RetentionResult
from orchestrator.storage.rows import ApprovalRecord, StepRecord


def describe(job: Job, events: list[JobEvent], steps: list[StepRecord] | None = None) -> str:
    """One job: its state, counters, schedule, last error, result, history and steps."""
    now = datetime.now(UTC)
    lines = [
        f"job {job.id}  {job.job_type}  {job.status.value}",
        f"  attempt {job.attempt} (run {job.dispatch_attempt}/{job.max_attempts} of this "
        f"dispatch), retries {job.retry_count}/{job.max_retries}",
    ]
    if job.tenant_id is not None:
        lines.append(f"  tenant {job.tenant_id}")
    if job.job_key is not None:
        lines.append(f"  job key {job.job_key} (revision {job.revision})")
    if job.status is Status.PENDING and job.run_at > now:
        lines.append(f"  scheduled for {job.run_at.isoformat()} ({_in(job.run_at, now)})")
    if job.next_retry_at is not None:
        lines.append(
            f"  next retry at {job.next_retry_at.isoformat()} ({_in(job.next_retry_at, now)})"
        )
    if job.waiting_for is not None:
        lines.append(f"  {job.waiting_for}")
    if job.last_error is not None:
        e = job.last_error
        lines.append(f"  last error: [{e.classification.value} {e.code}] {first_line(e.message)}")
    if job.result is not None:
        lines.append(f"  result: {clip(json.dumps(job.result), 160)}")
    lines.append("  history:")
    start = events[0].at if events else None
    for event in events:
        offset = (event.at - start).total_seconds() if start else 0.0
        lines.append(f"    +{offset:8.3f}s  {event.kind:<24} {event_detail(event)}".rstrip())
    if steps:
        lines.append("  steps:")
        lines.extend(f"    {_step_line(row)}" for row in steps)
    return "\n".join(lines)


def graph_lines(parents: list[Awaited], children: list[Awaited], more: bool) -> list[str]:
    """A job's parents and the children it spawned (docs/workflows.md), a line each."""
    lines = []
    for title, jobs, tail in (("parents", parents, False), ("children", children, more)):
        if jobs:
            lines.append(f"  {title}:" + (" (the first shown)" if tail else ""))
            lines.extend(f"    {_relative(job)}" for job in jobs)
    return lines


def _relative(job: Awaited) -> str:
    policy = f"  (on failure: {job.on_failure})" if job.on_failure else ""
    error = f"  [{job.last_error.code}]" if job.last_error is not None else ""
    return f"{job.job_id}  {job.job_type:<20} {job.status.value}{error}{policy}"


#: The columns' names over ``job_line``'s rows (the optional tenant, key and wait are named in
#: the row).
JOB_HEAD = f"{'ID':<36}  {'TYPE':<20} {'STATUS':<16} {'ATTEMPT':>7} {'RETRIES':>7}  CREATED"


def job_line(job: Job) -> str:
    tenant = f"  tenant {job.tenant_id}" if job.tenant_id is not None else ""
    key = f"  key {job.job_key} rev {job.revision}" if job.job_key is not None else ""
    waiting = f"  {job.waiting_for}" if job.waiting_for is not None else ""
    retries = f"{job.retry_count}/{job.max_retries}"
    return (
        f"{job.id}  {job.job_type:<20} {job.status.value:<16} {job.attempt:>7} {retries:>7}  "
        f"{job.created_at:%Y-%m-%d %H:%M:%S}{tenant}{key}{waiting}"
    )


#: Over ``flow_key_line``'s rows: each part after the key is named in the row.
FLOW_KEY_HEAD = f"{'KEY':<32} LIMIT, USE, WAITING, PAUSE"


def flow_key_line(k: FlowKey) -> str:
    """A flow key: its limit and use, its waiting jobs, its pause or slow-down."""
    parts = [f"{k.key:<32} limit {k.limit_name}"]
    if k.concurrency is not None:
        parts.append(f"running {k.running}/{k.concurrency}")
    window = f"{k.interval_seconds:g}s" if k.interval_seconds is not None else "-"
    if k.requests is not None:
        parts.append(f"requests {k.requests_used}/{k.requests} per {window}")
    if k.units is not None:
        parts.append(f"units {k.units_used}/{k.units} per {window}")
    if k.learn:
        said = [f"{n} {v}" for n, v in (("requests", k.learned_requests),
                                         ("units", k.learned_units)) if v is not None]  # fmt: skip
        parts.append(f"provider's: {', '.join(said)}" if said else "learning from replies")
    parts.append(f"waiting {k.waiting}")
    if k.paused_until is not None and k.paused_until > datetime.now(UTC):
        parts.append(f"PAUSED until {_utc(k.paused_until)} by {k.paused_by}: {k.pause_reason}")
    if k.rate_factor is not None and k.rate_factor < 1:
        parts.append(f"rate x{k.rate_factor:.2f} (429s without a hint)")
    return "  ".join(parts)


#: Over ``dead_letter_line``'s rows.
DEAD_LETTER_HEAD = f"{'DEAD LETTER':<36}  {'JOB':<40}  {'TYPE':<20} {'STATE':<18} [TENANT] ERROR"


def dead_letter_line(letter: DeadLetter) -> str:
    tenant = f"tenant {letter.tenant_id}  " if letter.tenant_id is not None else ""
    return (
        f"{letter.id}  job {letter.job_id}  {letter.job_type:<20} {letter.state:<18} {tenant}"
        f"[{letter.error.classification.value} {letter.error.code}] "
        f"{clip(first_line(letter.error.message), 60)}"
    )


def describe_dead_letter(letter: DeadLetter) -> str:
    e = letter.error
    lines = [
        f"dead letter {letter.id}  {letter.state}",
        f"  job {letter.job_id}  {letter.job_type}  (orchestrator status {letter.job_id})",
        f"  error: [{e.classification.value} {e.code}] {first_line(e.message)}",
        f"  recorded at {letter.created_at.isoformat()}",
    ]
    if letter.tenant_id is not None:
        lines.append(f"  tenant {letter.tenant_id}")
    if letter.discard_requested_by is not None:
        lines.append(
            f"  discard requested by {letter.discard_requested_by}: {letter.discard_reason}"
        )
    if letter.discarded_by is not None:
        lines.append(f"  discarded by {letter.discarded_by}")
    if letter.requeued_job_id is not None:
        lines.append(f"  requeued as job {letter.requeued_job_id}")
    lines.append(f"  payload: {clip(json.dumps(letter.payload), 160)}")
    return "\n".join(lines)


#: Over ``approval_line``'s rows.
APPROVAL_HEAD = f"{'ID':<36}  {'JOB':<36}  {'STEP':>4}  {'STATUS':<9}  {'EXPIRES':<19}  QUESTION"


def approval_line(a: ApprovalRecord) -> str:
    decided = f"  {a['status']} by {a['decided_by']}: {a['reason']}" if a["decided_by"] else ""
    return (
        f"{a['id']}  {a['job_id']}  {a['step']:>4}  {a['status']:<9}  "
        f"{a['expires_at']:%Y-%m-%d %H:%M:%S}  {a['question']}{decided}"
    )


#: Over ``schedule_line``'s rows.
SCHEDULE_HEAD = f"{'NAME':<24} {'TYPE':<20} {'WHEN':<32} {'NEXT':<26} LAST"


def schedule_line(s: ScheduleView) -> str:
    """A schedule: its name, type, expression and zone, its next run (or who paused it), its
    last run and that run's job."""
    when = f"{s.cron} ({s.tz})"
    state = f"paused by {s.paused_by}" if s.paused else f"next {_utc(s.next_tick)}"
    last = f"last {_utc(s.last_tick)} job {s.last_job_id}" if s.last_tick else "never run"
    tenant = f"  tenant {s.tenant_id}" if s.tenant_id is not None else ""
    return f"{s.name:<24} {s.job_type:<20} {when:<32} {state:<26} {last}{tenant}"


def _utc(when: datetime | None) -> str:
    return "-" if when is None else f"{when.astimezone(UTC):%Y-%m-%d %H:%M:%S}Z"


def event_detail(event: JobEvent) -> str:
    p = event.payload
    match event.kind:
        case "job.running":
            return f"attempt {p['attempt']} on {p['worker']}"
        case "job.completed":
            return f"attempt {p['attempt']} in {p['duration_ms'] / 1000:.3f}s"
        case "job.replaced":
            return f"job key {p['job_key']} ({p['mode']}): revision {p['revision']}"
        case "job.key_revoked":
            return f"job key {p['job_key']} went to job {p['replaced_by']}"
        case "job.redispatched":
            return f"its dispatch {p['lost_procrastinate_job_id']} was lost; a new one queued"
        case "job.maintenance_failed":
            return f"{p['service']} passed it over: {p['code']}: {clip(str(p['error']), 60)}"
        case "job.failed":
            error = p["error"]
            tail = "terminal" if p["terminal"] else f"{p.get('layer')} retry"
            message = clip(first_line(error["message"]), 70)
            return f"{error['classification']} {error['code']}: {message} ({tail})"
        case "job.retry_scheduled":
            return f"{p['layer']} backoff {p['backoff_ms'] / 1000:.2f}s, retry {p['retry_count']}"
        case "job.dead_lettered":
            return f"dead letter {p['dead_letter_id']}"
        case "job.degraded":
            return _degradation(p)
        case "job.cancelled":
            return f"by {p['by']}: {p['reason']}" if p["reason"] else f"by {p['by']} (no reason)"
        case "job.interrupted":
            return f"attempt {p['attempt']} on {p['worker']}: {p['reason']}"
        case "job.checkpointed":
            return f"step {p['step']}" + (" (final)" if p.get("final") else "")
        case "job.model_fallback":
            where = f"step {p['step']}: " if p.get("step") is not None else ""
            hint = f", hint {p['retry_after']:g}s" if p.get("retry_after") is not None else ""
            return f"{where}{p['from']} {p['reason']} ({p['code']}{hint}): now {p['to']}"
        case "job.zombie_detected":
            return f"attempt {p['attempt']} on {p['worker']}: {p['reason']}"
        case "job.waiting_for_capacity":
            return f"on {p['key']} ({p['waiting_on']})"
        case "job.waiting_approval":
            return f"step {p['step']}: {p['question']}"
        case "job.approved" | "job.rejected" | "job.approval_expired":
            return f"by {p['decided_by']}: {p['reason']}"
    return ""


def _degradation(p: dict[str, object]) -> str:
    """What followed the failure (orchestrator.domain.degradation)."""
    message = clip(str(p["message"]), 70)
    match p["action"]:
        case "notify_human" if p.get("escalation_job_id"):
            return f"a person is notified (job {p['escalation_job_id']}): {message}"
        case "notify_human":
            return f"nobody notified (ORCHESTRATOR_ESCALATION_TARGET is unset): {message}"
        case "fallback":
            kept = clip(json.dumps(p.get("content")), 50)
            return f"fallback {p.get('fallback')}: content kept in this event: {kept}"
    return message


def _step_line(row: StepRecord) -> str:
    if row["kind"] == "checkpoint":
        state = clip(json.dumps(row["detail"]), 90)
        return f"step {row['step']}  checkpoint (attempt {row['attempt']})  {state}"
    detail = row["detail"]
    how = "reconciled" if detail.get("reconciled") else f"attempt {row['attempt']}"
    return (
        f"step {row['step']}  side effect {row['name']} {row['status']} ({how})  "
        f"{row['invocation_id']}"
    )


def _in(when: datetime, now: datetime) -> str:
    return f"in {max(0.0, (when - now).total_seconds()):.1f}s"


def first_line(text: str) -> str:
    return text.splitlines()[0] if text else text


def clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def prune_lines(result: RetentionResult, *, dry_run: bool) -> list[str]:
    """What a run of prune_finished deleted (or, dry, would delete): jobs by type and status,
    the rows that went with them by kind, and the bookkeeping that aged out."""
    verb = "would delete" if dry_run else "deleted"
    lines = [f"{verb} {result.jobs} finished jobs past their retention"]
    if result.limit is not None and result.jobs >= result.limit:
        lines[0] += f" (a dry run counts {result.limit} at most: more may be due)"
    width = max((len(t) for t, _ in result.by_type), default=0)
    for (job_type, status), n in sorted(result.by_type.items()):
        lines.append(f"  {job_type:<{width}}  {status:<9}  {n}")
    kinds = ("events", "checkpoints", "side_effects", "approvals", "dead_letters", "dispatches",
             "dispatch_events", "llm_usage", "output_chunks")  # fmt: skip
    lines.append("with them: " + _counts(result, kinds))
    bookkeeping = ("maintenance_dispatches", "sessions", "event_listeners", "revoked_tokens")
    lines.append("aged out: " + _counts(result, bookkeeping))
    if result.archive is not None:
        lines.append(f"archived to {result.archive}")
    if result.behind:
        lines.append(f"more are due: the run's {result.run_seconds:g} s ran out"
                     " (ORCHESTRATOR_RETENTION_RUN_SECONDS); run it again")  # fmt: skip
    return lines


def _counts(result: RetentionResult, kinds: tuple[str, ...]) -> str:
    return ", ".join(f"{getattr(result, k)} {k.replace('_', ' ')}" for k in kinds)


def stats_lines(stats: Stats) -> list[str]:
    """A stats read (``orchestrator stats``): per series, a line per step with jobs."""
    lines = [
        f"jobs finished from {stats.since.isoformat()} to {stats.until.isoformat()}, per "
        f"{stats.step} s (rolled up to "
        f"{stats.rolled_up_to.isoformat() if stats.rolled_up_to else 'nothing yet'})"
    ]
    for series in stats.jobs:
        lines.append(_key_words(series.key))
        lines.append(f"  {'at':<25} {'done':>7} {'failed':>7} {'cancel':>7} {'dead':>6} "
                     f"{'app rt':>6} {'infra':>6} {'p50':>9} {'p95':>9} {'max':>9}")  # fmt: skip
        for p in series.points:
            d = p.durations
            lines.append(
                f"  {p.at.isoformat():<25} {p.completed:>7} {p.failed:>7} {p.cancelled:>7} "
                f"{p.dead_lettered:>6} {p.app_retries:>6} {p.infra_retries:>6} "
                f"{_ms(d.p50_ms):>9} {_ms(d.p95_ms):>9} {_ms(d.max_ms):>9}"
            )
    if not stats.jobs:
        lines.append("  no job finished in this range")
    lines.append("queue depth (waiting, running), sampled at each step's start")
    for depth in stats.queue_depth:
        points = ", ".join(f"{p.at:%H:%M} {p.waiting}/{p.running}" for p in depth.points)
        lines.append(f"{_key_words(depth.key)}: {points}")
    if not stats.queue_depth:
        lines.append("  none waiting or running at any sample")
    return lines


def _key_words(key: dict[str, str | None]) -> str:
    return " ".join(f"{k}={'(none)' if v is None else v}" for k, v in key.items()) or "all jobs"


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f} ms" if value < 10_000 else f"{value / 1000:.1f} s"


_TOKEN_COLUMNS = ("calls", "input", "output", "cache read", "cache write", "total")


def usage_lines(
    totals: list[UsageTotal], by: str, since: datetime | None, until: datetime | None
) -> list[str]:
    """``orchestrator usage``: a line per group, its calls and tokens, and the sum of all."""
    groups = groups_of(by)
    when = (
        f"from {since.isoformat() if since else 'the first call recorded'}"
        f" to {until.isoformat() if until else 'now'}"
    )
    lines = [f"LLM usage {when}" + (f", by {', '.join(groups)}" if groups else "")]
    if not totals:
        return [*lines, "  no LLM call recorded in this range"]
    keys = [[_group_value(t, g) for g in groups] for t in totals]
    widths = [max(len(g), *(len(k[i]) for k in keys)) for i, g in enumerate(groups)]
    head = [f"{g:<{w}}" for g, w in zip(groups, widths, strict=True)]
    lines.append("  ".join([*head, *(f"{c:>11}" for c in _TOKEN_COLUMNS)]).rstrip())
    for key, t in zip(keys, totals, strict=True):
        cells = [f"{k:<{w}}" for k, w in zip(key, widths, strict=True)]
        lines.append("  ".join([*cells, *(f"{n:>11}" for n in _token_cells(t))]))
    if len(totals) > 1 and groups:
        whole = UsageTotal(
            calls=sum(t.calls for t in totals),
            input_tokens=sum(t.input_tokens for t in totals),
            output_tokens=sum(t.output_tokens for t in totals),
            cache_read_tokens=sum(t.cache_read_tokens for t in totals),
            cache_creation_tokens=sum(t.cache_creation_tokens for t in totals),
        )
        label = f"{'all':<{sum(widths) + 2 * (len(widths) - 1)}}"
        lines.append("  ".join([label, *(f"{n:>11}" for n in _token_cells(whole))]))
    return lines


def _group_value(total: UsageTotal, group: str) -> str:
    value = getattr(total, GROUPS[group])
    return "(none)" if value is None else str(value)


def _token_cells(t: UsageTotal) -> list[int]:
    return [t.calls, t.input_tokens, t.output_tokens, t.cache_read_tokens,
            t.cache_creation_tokens, t.total_tokens]  # fmt: skip


def job_usage_line(usage: JobUsage) -> str:
    """A job's LLM usage in one line (``orchestrator status``)."""
    t = usage.total
    budget = f" of a budget of {usage.token_budget}" if usage.token_budget is not None else ""
    d = usage.descendants_total
    below = (
        f"; with the {usage.descendants} jobs below it: {usage.descendant_calls} calls more,"
        f" {t.total_tokens + d.total_tokens} tokens in all"
        if usage.descendants
        else ""
    )
    return (
        f"LLM usage: {len(usage.calls)} calls, {t.total_tokens} tokens{budget} (input"
        f" {t.input_tokens}, output {t.output_tokens}, cache read {t.cache_read_tokens}, cache"
        f" write {t.cache_creation_tokens}){below}"
    )


def summary_lines(summary: FleetSummary) -> list[str]:
    """The fleet at a glance: one line per fact, then each problem with what to do."""
    jobs = ", ".join(f"{n} {status}" for status, n in summary.jobs.items())
    runners = ", ".join(p.worker or f"#{p.worker_id}" for p in summary.runners)
    letters = summary.letters_to_review
    held = [_held(k) for k in summary.held_keys]
    unserved = [f"{u.job_type} ({u.due} due, queue {', '.join(u.queues)})"
                for u in summary.unserved]  # fmt: skip
    notified = summary.notifications
    lines = [
        f"jobs unfinished: {jobs}",
        f"workers alive that run jobs: {len(summary.runners)}"
        + (f" ({runners})" if runners else "")
        + f"; API servers: {len(summary.servers)}; stalled: {len(summary.stalled)}",
        f"jobs waiting that no live worker runs: {'; '.join(unserved) or 'none'}",
        f"flow keys paused or slowed: {'; '.join(held) or 'none'}",
        f"dead letters to review: {sum(letters.values())} ({letters.get('recorded', 0)} "
        f"recorded, {letters.get('discard_requested', 0)} discard requested)",
        f"approvals waiting: {summary.approvals_waiting}",
        f"failures notified to: {notified.failures or 'nobody'}; approvals notified to: "
        f"{notified.approvals or 'nobody'}",
    ]
    lines += [f"PROBLEM {p.text}: {p.fix} ({p.link})" for p in summary.problems]
    return lines


def _held(key: HeldKey) -> str:
    if not key.paused or key.paused_until is None:
        return f"{key.key} slowed to {key.rate_factor or 0:.0%}"
    why = f": {key.pause_reason}" if key.pause_reason else ""
    return f"{key.key} paused by {key.paused_by or 'unknown'} until {_utc(key.paused_until)}{why}"


def application_lines(found: Applications) -> list[str]:
    """Each application: live or not, its processes with their config versions, what it
    declares, its refusals; then the waiting jobs no live application serves."""
    lines: list[str] = []
    for app in found.applications:
        state = f"{len(app.processes)} live process(es)" if app.live else "no live process"
        versions = f", config {', '.join(app.config_versions)}" if app.config_versions else ""
        lines.append(f"{app.name}: {state}{versions}")
        for process in app.processes:
            lines.append(f"  process {process.worker} (config {process.config_version})")
        lines.append(f"  job types: {', '.join(app.job_types) or 'none'}")
        limits = [f"{limit.name} ({_set_fields(limit.definition)})" for limit in app.limits]
        lines.append(f"  limits: {'; '.join(limits) or 'none'}")
        if app.limited_types:
            limited = ", ".join(f"{t} -> {lim}" for t, lim in sorted(app.limited_types.items()))
            lines.append(f"  limited types: {limited}")
        lines.append(f"  schedules: {', '.join(app.schedules) or 'none'}")
        for c in app.conflicts:
            said = ", ".join(f"{field} {ours} here, {theirs} there"
                             for field, (ours, theirs) in sorted(c.difference.items()))  # fmt: skip
            lines.append(
                f"  REFUSED {c.kind.replace('_', ' ')} {c.name!r}: application {c.other!r} "
                f"defines it otherwise ({said})"
            )
    if not found.applications:
        lines.append("no applications")
    for jobs in found.unserved:
        lines.append(
            f"UNSERVED {jobs.job_type}: {jobs.pending} pending, {jobs.retry} to retry, {jobs.due} "
            f"due (queue {', '.join(jobs.queues)}); no live worker runs this type (they wait for "
            "one)"
        )
    return lines


def _set_fields(definition: dict[str, object]) -> str:
    return ", ".join(
        f"{k} {v}" for k, v in sorted(definition.items()) if v not in (None, {}, False)
    )
