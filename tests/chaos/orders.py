"""What the chaos tests that push orders through a three-stage workflow share: the app,
its tables, and how to read what happened."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import text
from sqlalchemy.engine import Engine

from pipeline import NewEvent, Settings, configure
from tests.support import pipeline_env, produce, run_cli

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


def scalar(engine, sql: str):
    with engine.connect() as conn:
        return conn.execute(text(sql)).scalar()


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
    with engine.begin() as conn:
        conn.exec_driver_sql(tables)
    value = settings.replace(
        lease_seconds=3.0,
        poll_interval_max=0.5,
        broker_heartbeat_timeout_ms=3000,
        broker_maintenance_chance=200_000,
        canary_interval=0,
        redelivery_horizon_seconds=3.0,
        reconcile_interval_seconds=0.5,
    )
    configure(value)
    try:
        yield value
    finally:
        configure(settings)
