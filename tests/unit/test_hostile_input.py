"""Checks made before any I/O: events, consumer declarations, URLs and printed text."""

from __future__ import annotations

import json
import uuid

import pytest

from pipeline.config import (
    Settings,
    unknown_variables,
    unknown_variables_warning,
)
from pipeline.errors import ConfigurationError, EventValidationError
from pipeline.inbox.consumer import consumer
from pipeline.outbox import NewEvent, prepare_rows, stored_size
from pipeline.redaction import mask_secret, redact_secrets, redact_url
from pipeline.registry import Registry
from pipeline.tools.ops.text import printable, printable_lines


def nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (NewEvent("a.b", nested(5000)), "nests lists and objects deeper than 100 levels"),
        (NewEvent("a.b", nested(101)), "deeper than 100 levels"),
        (NewEvent("a.b", [nested(101), *[[]] * 200]), "deeper than 100 levels"),
        (
            NewEvent("a.b", {}, event_version=True),
            "event_version must be a positive integer below 2147483648",
        ),
        (
            NewEvent("a.b", {}, event_version=2**40),
            "event_version must be a positive integer below 2147483648",
        ),
        (
            NewEvent("a.b", {}, event_version=2**31),
            "event_version must be a positive integer below 2147483648",
        ),
        (
            NewEvent("a.b", {}, event_version=0),
            "event_version must be a positive integer below 2147483648",
        ),
        (NewEvent("a.b", {}, event_id="not-a-uuid"), "event_id must be a UUID"),  # type: ignore[arg-type]
        (NewEvent("a.b", {}, event_id=42), "event_id must be a UUID"),  # type: ignore[arg-type]
        (NewEvent("a.b", {}, causation_id="x"), "causation_id must be a UUID"),  # type: ignore[arg-type]
        (NewEvent("a.b", {}, correlation_id=b"x"), "correlation_id must be a UUID"),  # type: ignore[arg-type]
    ],
)
def test_add_event_refuses_before_any_sql(event: NewEvent, message: str) -> None:
    with pytest.raises(EventValidationError, match=message):
        prepare_rows([event], Settings())


def test_a_self_containing_payload_is_refused_not_recursed() -> None:
    """json.dumps finds the cycle; the depth walk only ever sees payloads without one."""
    loop: dict[str, object] = {}
    loop["self"] = loop
    with pytest.raises(EventValidationError, match="Circular reference detected"):
        prepare_rows([NewEvent("a.b", loop)], Settings())


def test_what_add_event_accepts_at_the_edges() -> None:
    event_id = uuid.uuid4()
    rows = prepare_rows(
        [
            NewEvent(
                "a.b", [nested(99), *[[]] * 500], event_version=2**31 - 1, event_id=str(event_id)
            ),  # type: ignore[arg-type]
        ],
        Settings(),
    )
    assert rows[0]["id"] == event_id and isinstance(rows[0]["id"], uuid.UUID)
    assert rows[0]["event_version"] == 2**31 - 1


@pytest.mark.parametrize(
    ("payload", "stored"),
    [
        ({"n": 1e300}, '{"n":1' + "0" * 300 + "}"),  # Postgres prints numbers in full
        ([1e-05, 1.5e16, -0.0], "[0.00001,15000000000000000,0.0]"),
        ({"text": "1e+5 and -0.0 in a string"}, '{"text":"1e+5 and -0.0 in a string"}'),
        ([0.5, -0.05, 10**20], "[0.5,-0.05,100000000000000000000]"),
    ],
)
def test_payload_size_counts_numbers_as_the_outbox_stores_them(
    payload: object, stored: str
) -> None:
    encoded = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    assert stored_size(payload, encoded, len(encoded)) == len(stored)
    limit = Settings(max_payload_bytes=len(stored) - 1)
    with pytest.raises(EventValidationError, match=f"payload is {len(stored)} bytes, over"):
        prepare_rows([NewEvent("a.b", payload)], limit)
    prepare_rows([NewEvent("a.b", payload)], Settings(max_payload_bytes=len(stored)))


def test_the_payload_limit_cannot_be_raised_past_what_the_outbox_accepts() -> None:
    assert Settings(max_payload_bytes=262_144).max_payload_bytes == 262_144
    with pytest.raises(ValueError, match="less than or equal to 262144"):
        Settings(max_payload_bytes=262_145)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"event_types": "order"}, "event types must be a list such as ['order'], not a str"),
        ({"event_types": b"order"}, "event types must be a list"),
        ({"event_types": ["a"], "time_limit": float("nan")}, "time_limit must be a number"),
        ({"event_types": ["a"], "time_limit": float("inf")}, "time_limit must be a number"),
        ({"event_types": ["a"], "time_limit": 0}, "time_limit must be a number"),
        ({"event_types": ["a"], "min_backoff": -1}, "min_backoff must be a number"),
        ({"event_types": ["a"], "max_backoff": 10**9}, "max_backoff must be a number"),
        ({"event_types": ["a"], "max_retries": True}, "max_retries must be a whole number"),
        ({"event_types": ["a"], "max_retries": 2**40}, "max_retries must be a whole number"),
    ],
)
def test_consumer_declarations_are_checked_where_they_are_made(
    options: dict[str, object], message: str
) -> None:
    registry = Registry()
    with pytest.raises(ConfigurationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        consumer("x", registry=registry, **options)(lambda event, ctx: None)  # type: ignore[arg-type]
    assert registry.all() == []


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://u:p@ss@h/db", "postgresql://u:***@h/db"),
        (
            "https://api.example/x?api_key=S1&a=1&token=S2&client_secret=S3&X-Amz-Signature=S4",
            "https://api.example/x?api_key=***&a=1&token=***&client_secret=***&X-Amz-Signature=***",
        ),
        (
            "postgresql://h/db?password=S&sslmode=require",
            "postgresql://h/db?password=***&sslmode=require",
        ),
        ("redis://:pw@h:6379/0?access_token=S", "redis://:***@h:6379/0?access_token=***"),
    ],
)
def test_secrets_in_urls_are_masked(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_a_short_password_does_not_mask_parts_of_words() -> None:
    url = "postgresql://u:p@127.0.0.1:1/db"
    text = 'connection to server at "127.0.0.1", port 1 failed; password p refused'
    assert redact_secrets(text, url) == (
        'connection to server at "127.0.0.1", port 1 failed; password *** refused'
    )
    assert mask_secret("p@ss and p@ss!", "p@ss") == "*** and ***!"


def test_a_literal_at_in_a_postgres_password_is_refused() -> None:
    with pytest.raises(Exception, match="has an @ in its user name or password"):
        Settings(database_url="postgresql://u:p@ss@h/db")  # type: ignore[arg-type]
    Settings(database_url="postgresql://u:p%40ss@h/db")  # type: ignore[arg-type]


def test_control_characters_are_escaped_for_the_terminal() -> None:
    spoof = "o-1\x1b]0;pwned\x07\nFAKE\u202e\x9b"
    assert printable(spoof) == "o-1\\x1b]0;pwned\\x07\\x0aFAKE\\u202e\\x9b"
    assert printable_lines(["a\nb", "c"]) == "a\\x0ab\nc"
    assert printable("one\ntwo\x1b", keep="\n") == "one\ntwo\\x1b"
    assert printable("naïve café ✓") == "naïve café ✓"


def test_unknown_variables_name_the_closest_setting() -> None:
    environ = {
        "PIPELINE_DATABASE_ULR": "x",
        "PIPELINE_REDELIVERY_HORIZON": "5",
        "PIPELINE_WORKSPACE": "/w",
        "PIPELINE_BATCH_SIZE": "10",
        "PIPELINE_DEMO_API_URL": "http://x",
        "PIPELINE_TEST_DATABASE_URL": "postgresql://",
        "HOME": "/root",
    }
    assert unknown_variables(environ) == [
        ("PIPELINE_DATABASE_ULR", "PIPELINE_DATABASE_URL"),
        ("PIPELINE_REDELIVERY_HORIZON", "PIPELINE_REDELIVERY_HORIZON_SECONDS"),
        ("PIPELINE_WORKSPACE", None),
    ]
    line = unknown_variables_warning(environ)
    assert line is not None and "\n" not in line
    assert "PIPELINE_DATABASE_ULR (did you mean PIPELINE_DATABASE_URL?)" in line
    assert unknown_variables_warning({"PIPELINE_BATCH_SIZE": "1"}) is None


def test_the_sandbox_report_masks_secrets_in_the_urls_it_would_call() -> None:
    """A handler's call in a sandbox is shown, never made: its URL's query secrets are masked
    in the JSON and in the text report alike."""
    from pipeline.inbox.context import ExternalCall
    from pipeline.inbox.sandbox import SandboxOutcome
    from pipeline.tools.ops.dlq.render import render_sandbox

    call = ExternalCall("POST", "https://pay.example/v1/charges?api_key=S3CRET&a=1", "k-1")
    outcome = SandboxOutcome("payments", uuid.uuid4(), "order.placed", ok=True)
    outcome.external_calls.append(call)
    result = outcome.as_json()
    assert result["external_calls"][0]["url"] == "https://pay.example/v1/charges?api_key=***&a=1"
    run = {"id": 1, "stage": "consume", "consumer": "payments", "event_type": "order.placed"}
    text = "\n".join(render_sandbox([{**run, "outcome": "ok", "results": [result]}], 7))
    assert "would call POST https://pay.example/v1/charges?api_key=***&a=1" in text
    assert "S3CRET" not in json.dumps(result) + text
