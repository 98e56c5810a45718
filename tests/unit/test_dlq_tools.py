"""Dead-letter tools without servers: filters, pacing, envelopes, the sandboxed HTTP helper."""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from pipeline.envelope import decode_envelope, encode_envelope
from pipeline.errors import ConfigurationError
from pipeline.inbox.context import ExternalCall, HandlerContext, SandboxLog
from pipeline.inbox.http import idempotent_post
from pipeline.inbox.idempotency import idempotency_key
from pipeline.registry import Registry
from pipeline.tools.ops.audit import AuditRecord, render_actions
from pipeline.tools.ops.dlq.events import event_from_envelope
from pipeline.tools.ops.dlq.filters import FilterError, build_filter, parse_when
from pipeline.tools.ops.dlq.rate import TokenBucket
from pipeline.tools.ops.dlq.records import DeadLetter, DeadLetterGroup, FailedAttempt
from pipeline.tools.ops.dlq.render import attempt_error, render_groups
from pipeline.tools.ops.dlq.replay import plan_replay, require_routes
from tests.support import outbox_event

NOW = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30m", NOW - timedelta(minutes=30)),
        ("2h", NOW - timedelta(hours=2)),
        ("7d", NOW - timedelta(days=7)),
        ("1.5h", NOW - timedelta(minutes=90)),
        ("2025-02-28T10:00:00", datetime(2025, 2, 28, 10, tzinfo=UTC)),  # no offset: UTC
        ("2025-02-28T10:00:00+02:00", datetime(2025, 2, 28, 8, tzinfo=UTC)),
        ("2025-02-28T10:00:00Z", datetime(2025, 2, 28, 10, tzinfo=UTC)),
    ],
)
def test_time_bounds_are_timestamps_or_durations_back_from_now(text, expected):
    assert parse_when(text, "--since", NOW) == expected


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"since": "yesterday"}, "--since 'yesterday' is neither an ISO-8601 timestamp"),
        ({"until": "5 parsecs"}, "--until '5 parsecs' is neither"),
        ({"since": "1h", "until": "2h"}, "--since must be earlier than --until"),
        ({"ids": (0,)}, "--id 0 is not a dead-letter id"),
        ({"event_ids": ("xyz",)}, "--event-id 'xyz' is not an event id"),
        ({"caused_by": "1234"}, "--caused-by '1234' is not an event id"),
        ({"stage": "both"}, "--stage must be one of publish, consume"),
        ({"group": "3b1f0c9a7d2"}, "--group '3b1f0c9a7d2' is not a fingerprint"),
        ({"group": "3b1f0c9a7d2g"}, "--group '3b1f0c9a7d2g' is not a fingerprint"),
    ],
)
def test_bad_filters_name_the_option(options, message):
    with pytest.raises(FilterError, match="^" + message.replace("(", r"\(")):
        build_filter(now=NOW, **options)


def test_filter_parameters_and_audit_record():
    event = uuid.uuid4()
    scope = build_filter(consumer="payments", since="2h", event_ids=(str(event),), now=NOW)
    assert scope.scoped and not build_filter().scoped
    params = scope.params(limit=5, in_event_order=True)
    assert params["consumer"] == "payments" and params["event_ids"] == [event]
    assert params["since"] == NOW - timedelta(hours=2)
    assert params["stage"] is None and params["ids"] is None and params["limit"] == 5
    assert scope.as_json() == {
        "consumer": "payments",
        "since": "2h",
        "event_id": [str(event)],
        "since_resolved": (NOW - timedelta(hours=2)).isoformat(),
    }


def test_a_group_is_a_scope_resolved_to_ids_later():
    scope = build_filter(group=" 3B1F0C9A7D22 ")
    assert scope.scoped and scope.group == "3b1f0c9a7d22"
    assert scope.params()["group_ids"] is None  # looked up in SQL before the selection
    assert replace(scope, group_ids=(4, 2)).params()["group_ids"] == [4, 2]
    assert scope.as_json() == {"group": " 3B1F0C9A7D22 "}  # as the operator typed it


def test_groups_table_lists_counts_then_message_and_sample():
    group = DeadLetterGroup(
        fingerprint="3b1f0c9a7d22",
        stage="consume",
        consumer="payments",
        event_type="order.placed",
        error_class="Poison",
        message="cannot charge order o<n>",
        count=110,
        waiting=7,
        first_seen=NOW - timedelta(hours=1),
        last_seen=NOW,
        sample_id=41,
        sample_error="Poison: cannot charge order o1\nTraceback line",
    )
    lines = render_groups([group], 50)
    assert lines[0].split() == [
        "FINGERPRINT", "COUNT", "WAITING", "FIRST", "SEEN", "LAST", "SEEN", "STAGE", "CONSUMER"
    ]  # fmt: skip
    assert lines[1].split()[:3] == ["3b1f0c9a7d22", "110", "7"]
    assert lines[2] == "    order.placed  Poison: cannot charge order o<n>"
    assert lines[3] == "    sample #41: Poison: cannot charge order o1"
    assert lines[4] == "1 group(s), 110 dead letter(s)"
    assert render_groups([], 50) == ["no dead letters match"]
    assert group.as_json()["count"] == 110 and "ids" not in group.as_json()


@pytest.mark.parametrize(
    ("error_class", "error", "shown"),
    [
        ("CardDeclined", "CardDeclined: card 4242 declined", "CardDeclined: card 4242 declined"),
        ("CardDeclined", "card 4242 declined", "CardDeclined: card 4242 declined"),
        ("Timeout", "TimeoutError: slow", "Timeout: TimeoutError: slow"),
    ],
)
def test_an_attempts_error_class_is_written_once(error_class, error, shown):
    assert attempt_error(FailedAttempt(1, error_class, error, NOW)) == shown


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_token_bucket_paces_to_the_rate():
    clock = FakeClock()
    bucket = TokenBucket(4.0, clock=clock, sleep=clock.sleep)
    for _ in range(9):
        bucket.acquire()
    assert clock.now == pytest.approx(2.0)  # the first is free, then 8 at 4/s
    bucket.acquire(3)  # a message of three events pays for all three
    assert clock.now == pytest.approx(2.75)
    clock.now += 10  # idle time saves up at most one token
    bucket.acquire(2)
    assert clock.now == pytest.approx(13.0)


def test_unlimited_bucket_never_sleeps():
    clock = FakeClock()
    bucket = TokenBucket(None, clock=clock, sleep=clock.sleep)
    for _ in range(1000):
        bucket.acquire()
    assert clock.slept == []


def test_kept_envelope_gives_back_the_event_the_relay_encoded():
    event = outbox_event(seq=42, attempts=3, created_at=NOW)
    envelope = json.loads(encode_envelope(event, "/pipeline/x"))
    rebuilt = event_from_envelope(envelope)
    assert rebuilt is not None
    assert json.loads(encode_envelope(rebuilt, "/pipeline/x")) == envelope
    assert event_from_envelope({"id": "nope", "type": "t", "data": 1}) is None


def _letter(**fields) -> DeadLetter:
    values = {
        "id": 1,
        "stage": "consume",
        "event_id": uuid.uuid4(),
        "consumer": "payments",
        "event_type": "order.placed",
        "queue": "pipeline.payments",
        "reason": "gave up",
        "error_class": "Boom",
        "error": "Boom: x",
        "attempts": 3,
        "created_at": NOW,
        "replayed_at": None,
        "replay_count": 0,
        "outbox_status": "sent",
        "inbox_status": "dead",
    }
    values.update(fields)
    return DeadLetter(**values)


def test_plan_says_what_each_dead_letter_would_do():
    routes = Registry()
    routes.subscribe("payments", ["order.placed"], queue="pay.q")
    routes.subscribe("audit", ["*"])
    shared = uuid.uuid4()
    steps = plan_replay(
        [
            _letter(id=1),
            _letter(id=2, inbox_status="processed"),
            _letter(id=3, stage="publish", consumer=None, queue=None, outbox_status="dead"),
            _letter(id=4, stage="publish", consumer=None, outbox_status="sent"),
            _letter(id=5, consumer="retired", queue=None),
            _letter(id=6, consumer="retired", queue="old.q", event_id=shared),
            _letter(id=7, consumer="retired", queue="old.q", event_id=shared),
            _letter(id=8, consumer=None, event_id=None),
        ],
        routes,
    )
    kinds = [(s.letter.id, s.kind, s.subscription.queue if s.subscription else None) for s in steps]
    assert kinds == [
        (1, "deliver", "pay.q"),  # the registry's queue
        (2, "skip", None),
        (3, "requeue", None),
        (4, "skip", None),
        (5, "unroutable", None),
        (6, "deliver", "old.q"),  # not registered: the queue the dead letter names
        (7, "skip", None),
        (8, "skip", None),
    ]
    assert "has processed the event since" in steps[1].detail
    assert "subscribers (audit, payments)" in steps[2].detail
    assert "the event is sent, not dead" in steps[3].detail
    assert "replayed by dead letter #6" in steps[6].detail
    with pytest.raises(ConfigurationError, match="no queue known for consumer\\(s\\) retired"):
        require_routes(steps)


def test_sandboxed_helper_records_the_call_and_sends_nothing():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"a sandbox sent {request.method} {request.url}")

    client = httpx.Client(transport=httpx.MockTransport(refuse))
    event = decode_envelope(
        {"specversion": "1.0", "id": str(uuid.uuid4()), "type": "t", "source": "s", "data": {}}
    )
    log = SandboxLog()
    ctx = HandlerContext(event, None, "payments", 1, "q", sandbox=log)  # type: ignore[arg-type]
    response = idempotent_post(
        client, "https://user:pw@pay.example/v1/charges", ctx, step="charge", json={"card": "4242"}
    )
    assert response.status_code == 200 and response.json() == {}
    assert response.headers["X-Pipeline-Sandbox"] == "recorded"
    assert log.external_calls == [
        ExternalCall(
            "POST",
            "https://pay.example/v1/charges",
            idempotency_key("payments", event.id, "charge"),
        )
    ]


def test_audit_lines_say_who_what_why_and_how_many():
    record = AuditRecord(
        7,
        NOW,
        "alice",
        "dlq.replay",
        {"reason": "fix deployed", "filter": {"consumer": "payments"}, "rate": 5.0, "limit": None},
        3,
    )
    (line,) = render_actions([record])
    assert line == (
        "#7  2025-03-01T12:00:00+00:00  alice  dlq.replay  affected=3  reason='fix deployed'  "
        'filter={"consumer": "payments"}  rate=5.0'
    )
    assert render_actions([]) == ["no operator actions recorded"]
