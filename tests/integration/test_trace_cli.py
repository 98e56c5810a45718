"""``pipeline trace``: an event's whole lineage from the database, or a clear error."""

from __future__ import annotations

import json
import os
import subprocess
import uuid

from sqlalchemy import text
from sqlalchemy.orm import Session

from pipeline import add_event
from tests.support import cli_argv


def trace(settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPELINE_")}
    env["PIPELINE_DATABASE_URL"] = settings.require_database_url()
    env["PIPELINE_TRACE_UI_URL"] = "http://jaeger.local:16686"
    return subprocess.run(
        cli_argv("trace", *args),
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_trace_prints_the_whole_workflow(engine, settings):
    from opentelemetry.sdk.trace import TracerProvider

    request = TracerProvider().get_tracer("test").start_as_current_span("checkout request")
    with request, Session(engine) as session, session.begin():
        placed = add_event(
            session, "order.placed", {"order_id": "o1"}, aggregate_type="order", aggregate_id="o1"
        )
    with Session(engine) as session, session.begin():
        charged = add_event(
            session,
            "payment.charged",
            {"order_id": "o1"},
            causation_id=placed,
            correlation_id=placed,
        )
    with Session(engine) as session, session.begin():
        reserved = add_event(
            session,
            "stock.reserved",
            {"order_id": "o1"},
            causation_id=charged,
            correlation_id=placed,
        )
        session.execute(
            text(
                "INSERT INTO pipeline.inbox (consumer, event_id, event_type, status, attempts, "
                "processed_at) VALUES ('payments', :p, 'order.placed', 'processed', 2, now()),"
                " ('inventory', :c, 'payment.charged', 'processed', 1, now())"
            ),
            {"p": placed, "c": charged},
        )
        session.execute(
            text(
                "INSERT INTO pipeline.attempts"
                " (event_id, stage, consumer, attempt, error_class, error)"
                " VALUES (:p, 'consume', 'payments', 1, 'Flaky', 'Flaky: injected')"
            ),
            {"p": placed},
        )
        session.execute(
            text(
                "INSERT INTO pipeline.dead_letters (stage, event_id, consumer, reason, error_class,"
                " error) VALUES ('consume', :r, 'notifications', 'gave up after 3 attempts',"
                " 'SMTPError', 'SMTPError: down')"
            ),
            {"r": reserved},
        )
    result = trace(settings, str(placed))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for expected in (
        "order.placed",
        "payment.charged",
        "stock.reserved",
        "consumer   payments: processed",
        "failed     consume payments attempt 1",
        "DEAD       consume notifications",
        "gave up after 3 attempts",
        "http://jaeger.local:16686/trace/",
    ):
        assert expected in out, (expected, out)
    assert out.index("order.placed") < out.index("payment.charged") < out.index("stock.reserved")

    as_json = json.loads(trace(settings, str(placed), "--json").stdout)
    assert as_json["id"] == str(placed)
    assert as_json["deliveries"][0]["attempts"] == 2
    child = as_json["follow_ups"][0]
    assert child["id"] == str(charged) and child["causation_id"] == str(placed)
    grandchild = child["follow_ups"][0]
    assert grandchild["id"] == str(reserved)
    assert grandchild["dead_letters"][0]["reason"] == "gave up after 3 attempts"
    assert len(as_json["trace_id"]) == 32


def test_unknown_and_malformed_ids_are_clear_errors(settings):
    missing = uuid.uuid4()
    result = trace(settings, str(missing))
    assert result.returncode == 1
    assert result.stderr.strip() == f"pipeline: error: no event {missing} in schema 'pipeline'"
    result = trace(settings, "not-a-uuid")
    assert result.returncode == 2 and "is not an event id" in result.stderr
    assert "Traceback" not in result.stderr
