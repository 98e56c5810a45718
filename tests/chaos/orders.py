"""What the chaos tests that push orders through a three-stage workflow share: the app,
its tables, and how to read what happened."""

from __future__ import annotations

import json
from collections import Counter

from sqlalchemy import text

from pipeline import NewEvent, Settings
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
