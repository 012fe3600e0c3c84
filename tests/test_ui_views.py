"""What the dashboard's pages show, computed without a browser (orchestrator.interfaces.ui.views):
the retrying layer, the backoff schedules, durations, readable payloads and the counts."""

from __future__ import annotations

import math
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.domain.classification import ErrorClass
from orchestrator.domain.models import Job, JobEvent
from orchestrator.interfaces.ui import views
from retry_config import BackoffConfig, JobRetryConfig, ProportionalJitter


@pytest.mark.parametrize("error_class", list(ErrorClass))
def test_only_an_infrastructure_failure_is_retried_by_the_infrastructure_layer(
    error_class: ErrorClass,
) -> None:
    expected = "infra" if error_class is ErrorClass.TRANSIENT_INFRA else "app"
    assert views.layer_of(error_class) == views.layer_of(error_class.value) == expected
    assert views.layer_of(None) is None


def test_the_schedules_are_the_policy_s_delays() -> None:
    config = JobRetryConfig(
        app_max_retries=4, worker_max_attempts=3,
        backoff=BackoffConfig(base_ms=1000, cap_ms=5000, multiplier=2,
                              jitter=ProportionalJitter(ratio=0.5)),
    )  # fmt: skip
    app = views.app_schedule(config)
    assert [(d.retry, d.low_s, d.high_s) for d in app] == [
        (1, 0.5, 1.5), (2, 1.0, 3.0), (3, 2.0, 6.0), (4, 2.5, 7.5)
    ]  # fmt: skip
    assert app[0].text == "500 ms to 1.5 s"
    infra = views.infra_schedule(config)
    assert [(d.retry, d.low_s) for d in infra] == [(1, math.exp(1)), (2, math.exp(2))]
    many = JobRetryConfig(app_max_retries=10_000, worker_max_attempts=10_000)
    assert len(views.app_schedule(many)) == len(views.infra_schedule(many)) == views.SCHEDULE_ROWS


@pytest.mark.parametrize(
    ("value", "text"),
    [(0.0004, "0 ms"), (0.25, "250 ms"), (1, "1 s"), (12.5, "12.5 s"), (59.9, "59.9 s"),
     (200, "3 min 20 s"), (7500, "2 h 5 min")],
)  # fmt: skip
def test_durations_read_as_people_say_them(value: float, text: str) -> None:
    assert views.seconds(value) == text


@given(st.floats(0, 10**7, allow_nan=False))
def test_every_duration_has_a_unit(value: float) -> None:
    assert views.seconds(value).endswith(("ms", " s", "min"))


def test_a_payload_reads_as_lines_without_empty_fields() -> None:
    payload = {"attempt": 2, "error": {"message": "boom", "code": "X", "classification": "PERMANENT"},
               "layer": None, "worker": "h/1/w2", "tags": ["a"], "run_id": ""}  # fmt: skip
    assert views.readable(payload) == [
        ("attempt", "2"), ("error", "[PERMANENT X] boom"), ("worker", "h/1/w2"),
        ("tags", '["a"]'),
    ]  # fmt: skip
    assert views.readable("plain") == [("value", "plain")]


def test_counts_keep_only_the_principal_s_tenants() -> None:
    rows = [
        {"status": "PENDING", "job_type": "a", "tenant": "t1", "n": 3},
        {"status": "RETRY", "job_type": "b", "tenant": "t2", "n": 2},
        {"status": "PENDING", "job_type": "b", "tenant": "", "n": 1},
    ]
    every = views.counts(rows, {"COMPLETED": 8, "FAILED": 2}, 10.0, None)
    assert every.by_status["PENDING"] == 4 and every.by_status["RUNNING"] == 0
    assert every.by_tenant == {"t1": 3, "t2": 2, "(none)": 1}
    assert (every.per_second, every.failure_share) == (1.0, 0.2)
    one = views.counts(rows, {}, 10.0, frozenset({"t1"}))
    assert (one.by_type, one.by_tenant, one.failure_share) == ({"a": 3}, {"t1": 3}, 0.0)


# -- the overview's charts -------------------------------------------------------------------

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


@given(st.floats(0, 10**12))
def test_a_chart_s_top_is_the_next_1_2_5_step_at_or_above_its_peak(peak: float) -> None:
    top = views.round_up(peak)
    assert top >= max(peak, 1)
    assert str(top).rstrip("0") in ("1", "2", "5")
    assert top == 1 or views.round_up(peak) / 2.5 < max(peak, 1)


def test_a_chart_draws_each_line_to_scale_up_to_what_is_known() -> None:
    steps = views.steps_of(T0, T0 + timedelta(minutes=5), 60)
    assert steps == [T0 + timedelta(minutes=i) for i in range(5)]
    at = steps.__getitem__
    drawn = views.chart(
        "t", steps, {"completed": {at(0): 7, at(2): 10}, "failed": {at(1): 1}},
        unit="per minute", known_until=at(3),
    )  # fmt: skip
    assert drawn.top == 10 and (drawn.start, drawn.end) == ("12:00 UTC", "12:04 UTC")
    assert (drawn.ticks, drawn.gridlines, drawn.middle) == (["10", "5", "0"], [0.0, 80.0],
                                                            "12:02 UTC")  # fmt: skip
    completed, failed = drawn.lines
    # x: four gaps over the width; y: 0 at the bottom, the top at 0; steps 3 and 4 unknown
    assert completed.points == "0.0,48.0 150.0,160.0 300.0,0.0"
    assert (completed.total, completed.peak, failed.total) == (17, 10, 1)
    depth = views.chart("d", steps, {"waiting": {at(0): 4, at(4): 2}}, unit="", known_until=None,
                        sums=False)  # fmt: skip
    assert depth.lines[0].total == 2 and len(depth.lines[0].points.split()) == 5
    assert views.chart("e", steps, {"completed": {}}, unit="", known_until=None).empty
    day = views.steps_of(T0, T0 + timedelta(days=1), 3600)
    assert views.chart("f", day, {}, unit="", known_until=None).start == "Sun 12:00 UTC"


# -- a job's page -----------------------------------------------------------------------------

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def _job(**fields: object) -> Job:
    return Job.model_validate({
        "id": uuid.uuid4(), "job_type": "fetch", "status": "PENDING", "payload": {},
        "queue": "default", "priority": 0, "run_at": NOW, "attempt": 0, "max_attempts": 3,
        "dispatch_attempt": 0, "retry_count": 0, "max_retries": 2, "next_retry_at": None,
        "heartbeat_at": None, "locked_by": None, "procrastinate_job_id": None,
        "last_error": None, "job_key": None, "agent_id": None, "trace_id": "t",
        "tenant_id": None, "timeout_seconds": None, "replay_of": None, "created_at": NOW,
        "updated_at": NOW, "started_at": None, "finished_at": None, **fields,
    })  # fmt: skip


def _event(kind: str, **payload: object) -> JobEvent:
    return JobEvent(id=1, job_id=uuid.uuid4(), kind=kind, at=NOW, payload=payload)


def test_a_retrying_job_s_summary_says_why_when_and_which_attempt_of_its_ceiling() -> None:
    error = {"ts": NOW, "message": "429 Too Many Requests\nmore", "code": "HTTP_429",
             "classification": "TRANSIENT_APP", "attempt": 2, "terminal": False}  # fmt: skip
    job = _job(status="RETRY", attempt=2, last_error=error,
               next_retry_at=NOW + timedelta(seconds=40))  # fmt: skip
    events = [_event("job.running", attempt=1, worker="w", max_attempts=12),
              _event("job.retry_scheduled", layer="app", backoff_ms=40_000, retry_count=1,
                     max_attempts=4)]  # fmt: skip
    said = views.summary(job, events, None, None, NOW)
    assert (
        said.why == "a transient failure (retried with backoff while retries last): "
        "HTTP_429: 429 Too Many Requests"
    )
    assert said.next == "retries at 03:04:45 UTC, attempt 3 of at most 4 (app layer)"
    assert said.notified is None
    lines = [line.text for line in views.event_lines(events)]
    assert lines == ["attempt 1 on w · at most 12 attempts from here",
                     "app backoff 40.00s, retry 1 · at most 4 attempts from here"]  # fmt: skip


def test_a_failed_job_s_summary_says_who_was_told() -> None:
    job = _job(status="FAILED")
    nobody = _event("job.degraded", action="notify_human", message="Manual review required.")
    said = views.summary(job, [nobody], None, None, NOW)
    assert said.notified == (
        "nobody notified (ORCHESTRATOR_ESCALATION_TARGET is unset): Manual review required."
    )
    someone = _event("job.degraded", action="notify_human", message="Manual review required.",
                     escalation_job_id="e1")  # fmt: skip
    assert views.summary(job, [someone], None, None, NOW).notified.startswith(  # type: ignore[union-attr]
        "a person is notified (job e1)"
    )


@given(st.lists(st.uuids(), unique=True, max_size=30), st.binary(min_size=6, max_size=6))
def test_each_id_is_shown_by_a_prefix_no_other_id_of_its_list_shares(
    ids: list[uuid.UUID], shared: bytes
) -> None:
    close = [uuid.UUID(bytes=shared + i.bytes[6:]) for i in ids]  # UUIDv7's: the same time
    for listed in (ids, list(dict.fromkeys(close))):
        shown = views.short_ids(listed)
        for i in listed:
            prefix = shown[i].removesuffix("…")
            assert str(i).startswith(prefix) and len(prefix) >= 8
            assert not any(str(j).startswith(prefix) for j in listed if j != i)


def test_an_agent_s_result_reads_as_turns_with_their_tool_calls_and_answer() -> None:
    result = {
        "messages": [
            {"role": "user", "content": "tell the team"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Sending."},
                {"type": "tool_use", "id": "t1", "name": "send_message", "input": {"text": "hi"}},
            ]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": "sent"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Done. " * 400}]},
        ],
        "tool_calls": [{"step": 1, "id": "t1", "tool": "send_message", "args": {"text": "hi"},
                        "output": {"id": 7}, "error": None}],
        "steps": 2, "answer": "Done. " * 400,
    }  # fmt: skip
    shown = views.transcript(result)
    assert shown is not None and shown.answer == "Done. " * 400  # whole
    assert [(t.role, t.text) for t in shown.turns] == [
        ("user", "tell the team"),
        ("assistant", "Sending."),
    ]  # the last one is the answer
    [call] = shown.turns[1].calls
    assert (call.tool, call.args, call.output) == ("send_message", '{"text": "hi"}', '{"id": 7}')
    assert views.transcript({"answer": "not an agent's"}) is None
    assert views.transcript([1, 2]) is None
