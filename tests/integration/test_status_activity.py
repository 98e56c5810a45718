"""`pipeline status` per consumer: its figures equal what the test made happen.

A relay and a worker handle events for two consumers, one that always succeeds and one
that always fails (one retry, then a dead letter); the test then sends copies of
processed events (duplicates) and lets the ledger sweep send again events whose
deliveries Redis "forgot" (re-deliveries). The relay, the worker and ``pipeline status``
run in this process: the figures, not the processes, are the subject.
"""

from __future__ import annotations

import json
import uuid
from contextlib import ExitStack

import psycopg
import pytest

from pipeline import NewEvent
from pipeline.config import Settings
from pipeline.envelope import OutboxEvent
from pipeline.registry import Registry
from pipeline.relay.ledger import DeliveryLedger
from pipeline.runtime import build_runtime
from pipeline.transport.publisher import Delivery
from tests.support import (
    app_registry,
    pipeline_env,
    produce,
    run_cli,
    running_relay,
    running_worker,
    wait_until,
)

APP = "tests.apps.activity_app"
EVENTS = 10
DUPLICATES = 3
FORGOTTEN = 4


def scalar(url: str, query: str, *params: object) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute(query, params).fetchone()
        return int(row[0]) if row else 0


def outbox_events(url: str, ids: list[uuid.UUID]) -> list[OutboxEvent]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT id, seq, aggregate_type, aggregate_id, ordering_key, event_type, "
            "event_version, payload::text, headers::text, attempts, created_at "
            "FROM pipeline.outbox WHERE id = ANY(%s) ORDER BY seq",
            (ids,),
        ).fetchall()
    return [OutboxEvent(*row) for row in rows]


def status_json(settings: Settings, *args: str) -> dict[str, object]:
    result = run_cli(["status", "--json", "--app", APP, *args], pipeline_env(settings, APP))
    assert result.returncode in (0, 1), result.stderr  # 1: unhealthy (the dead letters)
    return json.loads(result.stdout)


def horizon_passed_last_sweep(conn: psycopg.Connection[tuple[object, ...]], horizon: float) -> bool:
    """Whether ``horizon`` seconds before now is past where the last ledger sweep ended."""
    row = conn.execute(
        "SELECT clock_timestamp() - make_interval(secs => %s) > swept_to"
        " FROM pipeline.delivery_sweep",
        (horizon,),
    ).fetchone()
    return bool(row and row[0])


@pytest.mark.timeout(240)
def test_status_per_consumer_figures_equal_the_ground_truth(settings, engine):
    url = settings.require_database_url()
    app = build_runtime(settings, app_registry(APP), set_global_broker=False)
    with ExitStack() as running:
        running.callback(app.close)
        running.enter_context(running_worker(app, threads=4))
        relay = running.enter_context(ExitStack())
        relay.enter_context(running_relay(app, app.registry, mode="inline"))
        ids = produce(engine, [NewEvent("order.placed", {"i": i}) for i in range(EVENTS)])
        wait_until(
            lambda: (
                scalar(
                    url,
                    "SELECT count(*) FROM pipeline.inbox WHERE (consumer = 'tally' AND status = "
                    "'processed') OR (consumer = 'grumpy' AND status = 'dead')",
                )
                == 2 * EVENTS
            ),
            timeout=90,
            interval=0.2,
        )
        relay.close()  # the relay stopped: from here on only this test sends anything

        routes = Registry()
        tally = routes.subscribe("tally", ["order.placed"])
        runtime = build_runtime(settings, routes)
        try:
            # Duplicates: copies of processed events reach the worker again.
            copies = outbox_events(url, ids[:DUPLICATES])
            assert (
                runtime.publisher.deliver([Delivery(tally, [e]) for e in copies])
                == [None] * DUPLICATES
            )
            wait_until(
                lambda: (
                    scalar(
                        url, "SELECT count(*) FROM pipeline.delivery_log WHERE kind = 'duplicate'"
                    )
                    == DUPLICATES
                ),
                timeout=60,
                interval=0.2,
            )
            # Re-deliveries: events marked sent to tally whose messages never reached
            # Redis (as if it forgot them); one ledger sweep sends each again.
            forgotten = [uuid.uuid4() for _ in range(FORGOTTEN)]
            with psycopg.connect(url, autocommit=True) as conn:
                for event_id in forgotten:
                    conn.execute(
                        "INSERT INTO pipeline.outbox (id, event_type, payload, status, "
                        "published_at, consumers) VALUES (%s, 'order.placed', '{}', 'sent', "
                        "clock_timestamp() - interval '3 seconds', ARRAY['tally'])",
                        (event_id,),
                    )
                ledger = DeliveryLedger(
                    settings.replace(redelivery_horizon_seconds=1.0), routes, runtime.publisher
                )
                # The relay's own sweeps (the last one maybe a moment ago) accounted up to
                # their end; this one's window opens once its horizon has passed that end.
                wait_until(lambda: horizon_passed_last_sweep(conn, 1.0), timeout=30)
                swept = ledger.sweep(conn)
            assert swept.accounted == FORGOTTEN
            assert swept.redelivered == {"tally": FORGOTTEN}
            wait_until(
                lambda: (
                    scalar(
                        url,
                        "SELECT count(*) FROM pipeline.inbox WHERE consumer = 'tally' "
                        "AND status = 'processed'",
                    )
                    == EVENTS + FORGOTTEN
                ),
                timeout=60,
                interval=0.2,
            )
        finally:
            runtime.close()

    # The ground truth, counted from what the test did (and checked against the tables).
    assert scalar(url, "SELECT count(*) FROM pipeline.dead_letters") == EVENTS
    report = status_json(settings, "--interval", "5m")
    assert report["interval_seconds"] == 300
    assert report["consumers"]["tally"] == {
        "processed": EVENTS + FORGOTTEN,
        "processed_per_second": round((EVENTS + FORGOTTEN) / 300, 3),
        "failures": 0,
        "duplicates": DUPLICATES,
        "redeliveries": FORGOTTEN,
        "dead_letters": 0,
    }
    assert report["consumers"]["grumpy"] == {
        "processed": 0,
        "processed_per_second": 0.0,
        "failures": 2 * EVENTS,  # the first attempt and its one retry
        "duplicates": 0,
        "redeliveries": 0,
        "dead_letters": EVENTS,
    }
    assert sorted(report["consumers"]) == ["grumpy", "tally"]

    # The window: what happened before it is not counted.
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "UPDATE pipeline.inbox SET processed_at = processed_at - interval '10 minutes' "
            "WHERE consumer = 'tally' AND event_id = ANY(%s)",
            (ids[:2],),
        )
        conn.execute("UPDATE pipeline.delivery_log SET at = at - interval '10 minutes'")
    shifted = status_json(settings, "--interval", "5m")["consumers"]["tally"]
    assert (shifted["processed"], shifted["duplicates"], shifted["redeliveries"]) == (
        EVENTS + FORGOTTEN - 2,
        0,
        0,
    )
    wide = status_json(settings, "--interval", "1h")["consumers"]["tally"]
    assert (wide["processed"], wide["duplicates"], wide["redeliveries"]) == (
        EVENTS + FORGOTTEN,
        DUPLICATES,
        FORGOTTEN,
    )


def test_status_text_lists_each_consumer_and_rejects_a_bad_interval(settings):
    env = pipeline_env(settings, APP)
    text = run_cli(["status", "--app", APP, "--interval", "90s"], env)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    header = lines.index("consumers (last 90s):")
    assert lines[header + 1].split() == [
        "consumer",
        "processed",
        "rate/s",
        "failures",
        "duplicates",
        "redeliveries",
        "dead",
        "letters",
    ]
    assert [line.split() for line in lines[header + 2 : header + 4]] == [
        ["grumpy", "0", "0.00", "0", "0", "0", "0"],
        ["tally", "0", "0.00", "0", "0", "0", "0"],
    ]
    bad = run_cli(["status", "--interval", "soon"], env)
    assert bad.returncode == 2
    assert "Invalid value for '--interval': 'soon' is not a duration" in bad.stderr
    assert "Traceback" not in bad.stderr
