"""What the tests that push orders through the three-stage inbox app share (the chaos
tier and the inbox's integration tests): the app, its tables, and how to read and wait
for what happened."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from sqlalchemy import text
from sqlalchemy.engine import Engine

from pipeline import NewEvent, Settings
from tests.support import (
    QUICK_FAULTS,
    installed_settings,
    pipeline_env,
    produce,
    run_cli,
    wait_until,
)

APP = "tests.apps.inbox_app"
STAGES = ("payments", "inventory", "notifications")
TABLES = """
CREATE TABLE effects (id bigserial PRIMARY KEY, stage text NOT NULL, order_id text NOT NULL,
                      event_id uuid NOT NULL);
CREATE TABLE seq_log (id bigserial PRIMARY KEY, ordering_key text NOT NULL, seq bigint NOT NULL,
                      n int NOT NULL);
"""


def stage_counts(engine, stage: str) -> Counter:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT order_id FROM effects WHERE stage = :s"), {"s": stage})
        return Counter(row[0] for row in rows)


def scalar(engine, sql: str, **params: object):
    with engine.connect() as conn:
        return conn.execute(text(sql), params).scalar()


def wait_all_sent(engine, count: int, alive: Sequence[object] = ()) -> None:
    """Wait until ``count`` events are marked sent (the relay handed them to the broker)."""
    wait_until(
        lambda: (
            scalar(engine, "SELECT count(*) FROM pipeline.outbox WHERE status = 'sent'") == count
        ),
        timeout=60,
        progress=lambda: scalar(engine, "SELECT count(*) FROM pipeline.outbox"),
        alive=list(alive),
    )


def wait_all_notified(
    engine,
    orders: list[str],
    alive: Sequence[object] = (),
    *,
    timeout: float = 60,
    interval: float = 0.5,
    progress=None,
) -> None:
    """Wait until the last stage (notifications) ran for every order; progress is the
    number of effect rows unless the test names another."""
    wait_until(
        lambda: len(stage_counts(engine, "notifications")) == len(orders),
        timeout=timeout,
        interval=interval,
        progress=progress or (lambda: scalar(engine, "SELECT count(*) FROM effects")),
        alive=list(alive),
    )


def place_orders(engine, orders: list[str]) -> None:
    produce(
        engine,
        [
            NewEvent("order.placed", {"order_id": o}, aggregate_type="order", aggregate_id=o)
            for o in orders
        ],
        per_transaction=10,
    )


def assert_each_stage_once(engine, orders: list[str]) -> None:
    for stage in STAGES:
        assert stage_counts(engine, stage) == Counter(dict.fromkeys(orders, 1)), stage
    assert scalar(engine, "SELECT count(*) FROM pipeline.dead_letters") == 0


def status_json(settings: Settings) -> tuple[int, dict]:
    done = run_cli(["status", "--json"], pipeline_env(settings, APP))
    return done.returncode, json.loads(done.stdout)


@contextmanager
def fault_settings(settings: Settings, engine: Engine, tables: str) -> Iterator[Settings]:
    """``settings`` made for faults that must show within seconds (short leases, heartbeats,
    horizon and sweeps), installed process-wide, after creating the test's ``tables``."""
    with installed_settings(
        settings,
        engine,
        tables,
        **QUICK_FAULTS,
        canary_interval=0,
        redelivery_horizon_seconds=3.0,
        reconcile_interval_seconds=0.5,
    ) as value:
        yield value
