"""The drill's checker on crafted database states: each broken guarantee is reported.

The states are written with the real producer (``add_event``) and the drill's own tables;
the ledger is the real payment API's, fed with the requests a consumer would make.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import psycopg
import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from pipeline import add_event
from pipeline.tools.drill.check import check_run
from pipeline.tools.drill.faults import Fault
from pipeline.tools.drill.report import RunFacts, build_report, exit_code, render_text
from pipeline.tools.drill.sql import DrillQueries
from pipeline.tools.drill.workflow import (
    LEDGER,
    NOTIFICATIONS,
    ORDER_PLACED,
    ORDER_SHIPPED,
    PAYMENT_CHARGED,
    PAYMENTS,
    SHIPPING,
    ordering_key,
)
from pipeline.tools.harness.payment_api import CHARGES_PATH, EMAILS_PATH, PaymentServer

RUN = "r1"
ACCOUNT = "acct-0001"


@pytest.fixture
def queries(engine: Engine) -> DrillQueries:
    value = DrillQueries("pipeline", "drill_app")
    with engine.begin() as conn:
        conn.exec_driver_sql(value.text("create_schema"))
        conn.exec_driver_sql(value.text("create_tables"))
    return value


@pytest.fixture
def api() -> Any:
    server = PaymentServer().start()
    yield server
    server.stop()


class Shop:
    """Writes a crafted run: orders, their events, and what each consumer did."""

    def __init__(self, engine: Engine, queries: DrillQueries, api_url: str) -> None:
        self.engine = engine
        self.queries = queries
        self.api_url = api_url
        self.orders: dict[str, dict[str, Any]] = {}

    def place(self, number: int, n: int, poison: bool = False) -> str:
        order_id = f"{RUN}-{number:07d}"
        payload = {
            "run": RUN,
            "order_id": order_id,
            "account": ACCOUNT,
            "n": n,
            "amount_cents": "12,50" if poison else 1000 + number,
        }
        with Session(self.engine) as session, session.begin():
            event_id = add_event(
                session, ORDER_PLACED, payload, aggregate_type="account", aggregate_id=ACCOUNT
            )
            session.connection().exec_driver_sql(
                self.queries.text("place_order"),
                {
                    "order_id": order_id,
                    "event_id": event_id,
                    "account": ACCOUNT,
                    "n": n,
                    "amount_cents": None if poison else 1000 + number,
                    "poison": poison,
                    "producer": "main",
                },
            )
        self.orders[order_id] = {"n": n, ORDER_PLACED: event_id}
        return order_id

    def follow_up(self, order_id: str, event_type: str) -> uuid.UUID:
        order = self.orders[order_id]
        payload = {"run": RUN, "order_id": order_id, "account": ACCOUNT, "n": order["n"]}
        fields: dict[str, Any] = (
            {"aggregate_type": "account", "aggregate_id": ACCOUNT}
            if event_type == PAYMENT_CHARGED
            else {"ordered": False}
        )
        with Session(self.engine) as session, session.begin():
            order[event_type] = add_event(session, event_type, payload, **fields)
        return order[event_type]

    def sent(self) -> None:
        with self.engine.begin() as conn:
            conn.exec_driver_sql(
                "UPDATE pipeline.outbox SET status = 'sent', published_at = clock_timestamp()"
            )

    def inbox(self, consumer: str, order_id: str, event_type: str, status: str) -> None:
        event_id = self.orders[order_id][event_type]
        with self.engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO pipeline.inbox (consumer, event_id, event_type, ordering_key, seq,"
                " status, attempts) SELECT %(consumer)s, id, event_type, ordering_key, seq,"
                " %(status)s, 1 FROM pipeline.outbox WHERE id = %(event_id)s",
                {"consumer": consumer, "event_id": event_id, "status": status},
            )

    def effect(
        self, consumer: str, order_id: str, event_type: str, position: int | None = None
    ) -> None:
        order = self.orders[order_id]
        with self.engine.begin() as conn:
            seq = conn.exec_driver_sql(
                "SELECT seq FROM pipeline.outbox WHERE id = %(id)s", {"id": order[event_type]}
            ).scalar_one()
            conn.exec_driver_sql(
                self.queries.text("record_effect"),
                {
                    "consumer": consumer,
                    "event_id": order[event_type],
                    "order_id": order_id,
                    "key": None if event_type == ORDER_SHIPPED else ordering_key(ACCOUNT),
                    "seq": seq,
                    "n": order["n"],
                    "position": position,
                    "ref": None,
                },
            )

    def done(self, consumer: str, order_id: str, event_type: str, position: int | None = None):
        self.inbox(consumer, order_id, event_type, "processed")
        self.effect(consumer, order_id, event_type, position)

    def dead_letter(self, consumer: str, order_id: str, event_type: str) -> None:
        with self.engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO pipeline.dead_letters (stage, event_id, consumer, event_type, reason,"
                " error_class, error, attempts) VALUES ('consume', %(id)s, %(consumer)s,"
                " %(type)s, 'non-retryable', 'PoisonOrder', 'PoisonOrder: bad amount', 1)",
                {"id": self.orders[order_id][event_type], "consumer": consumer, "type": event_type},
            )

    def call_api(self, path: str, order_id: str, consumer: str) -> None:
        key = f"{consumer}:{self.orders[order_id][ORDER_PLACED]}"
        response = httpx.post(
            self.api_url + path,
            json={"run": RUN, "order_id": order_id},
            headers={"Idempotency-Key": key},
        )
        assert response.status_code == 200

    def complete(self, order_id: str, ledger_position: int, shipping_position: int) -> None:
        """The order went through every consumer once, the API called once per step."""
        self.call_api(CHARGES_PATH, order_id, PAYMENTS)
        self.done(PAYMENTS, order_id, ORDER_PLACED)
        self.done(LEDGER, order_id, ORDER_PLACED, ledger_position)
        self.follow_up(order_id, PAYMENT_CHARGED)
        self.done(SHIPPING, order_id, PAYMENT_CHARGED, shipping_position)
        self.follow_up(order_id, ORDER_SHIPPED)
        self.call_api(EMAILS_PATH, order_id, NOTIFICATIONS)
        self.done(NOTIFICATIONS, order_id, ORDER_SHIPPED)

    def poison_dead(self, order_id: str) -> None:
        for consumer in (PAYMENTS, LEDGER):
            self.inbox(consumer, order_id, ORDER_PLACED, "dead")
            self.dead_letter(consumer, order_id, ORDER_PLACED)


def run_check(
    settings: Any, queries: DrillQueries, api: PaymentServer, **facts: Any
) -> dict[str, Any]:
    """The drill's report on what the test left in the database and the API's ledger, for
    a run with one crafted fault that recovered in time (``facts`` change that)."""
    ledger = httpx.get(f"{api.url}/ledger", params={"run": RUN}).json()
    with psycopg.connect(settings.require_database_url(), autocommit=True) as conn:
        check = check_run(conn, queries, ledger)
    values: dict[str, Any] = {
        "run": RUN,
        "seed": 1,
        "options": {"rate": 10.0},
        "setup": {},
        "started": 0.0,
        "faults": [Fault("worker-kill", 0.0, started=0.0, ended=1.0, detail="crafted")],
        "exits": [],
        "recovery_from": 1.0,
        "recovery_after": "the last fault",
        "recovered_at": 2.0,
        "recovery_timeout": 10.0,
        "clock_offset": 0.0,
        "duplicates_absorbed": None,
        "wall_seconds": 2.0,
    }
    return build_report(RunFacts(**{**values, **facts}), check)


def kinds(report: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for violation in report["violations"]:
        found.setdefault(violation["kind"], []).append(violation)
    return found


def test_a_clean_run_passes_with_exit_code_zero(engine, settings, queries, api):
    shop = Shop(engine, queries, api.url)
    first, second = shop.place(1, 1), shop.place(2, 2)
    poison = shop.place(3, 3, poison=True)
    shop.complete(first, ledger_position=1, shipping_position=1)
    shop.complete(second, ledger_position=2, shipping_position=2)
    shop.poison_dead(poison)
    shop.sent()

    report = run_check(settings, queries, api)

    assert report["violations"] == []
    assert exit_code(report) == 0
    assert report["events"]["orders"] == 2 and report["events"]["poison"] == 1
    assert report["api"]["charges"] == {
        "total": 2, "orders": 2, "twice": 0, "missing": 0, "unknown": 0
    }  # fmt: skip
    assert report["dead_letters"] == {"expected": 2, "found": 2, "unexpected": 0}
    assert "PASSED" in render_text(report)


def test_each_broken_guarantee_is_reported_and_the_exit_code_is_non_zero(
    engine, settings, queries, api
):
    shop = Shop(engine, queries, api.url)
    first, second, third = shop.place(1, 1), shop.place(2, 2), shop.place(3, 3)
    poison = shop.place(4, 4, poison=True)
    shop.complete(first, ledger_position=1, shipping_position=1)
    # The second order: its payment effect committed twice, and the ledger handled it
    # after the third order of the same account (out of order).
    shop.call_api(CHARGES_PATH, second, PAYMENTS)
    shop.done(PAYMENTS, second, ORDER_PLACED)
    shop.effect(PAYMENTS, second, ORDER_PLACED)
    shop.done(LEDGER, second, ORDER_PLACED, position=3)
    shop.follow_up(second, PAYMENT_CHARGED)
    shop.done(SHIPPING, second, PAYMENT_CHARGED, position=2)
    shop.follow_up(second, ORDER_SHIPPED)
    shop.call_api(EMAILS_PATH, second, NOTIFICATIONS)
    shop.done(NOTIFICATIONS, second, ORDER_SHIPPED)
    # The third order: charged by the API, but its payments delivery was lost.
    shop.call_api(CHARGES_PATH, third, PAYMENTS)
    shop.done(LEDGER, third, ORDER_PLACED, position=2)
    # The poison order: dead-lettered by payments only; the ledger never saw it. And an
    # unexpected dead letter: the first order's shipping event.
    shop.inbox(PAYMENTS, poison, ORDER_PLACED, "dead")
    shop.dead_letter(PAYMENTS, poison, ORDER_PLACED)
    shop.dead_letter(SHIPPING, first, PAYMENT_CHARGED)
    shop.sent()

    report = run_check(settings, queries, api)
    found = kinds(report)

    assert exit_code(report) == 1
    assert "FAILED" in render_text(report)
    lost = found["lost"][0]
    assert lost["count"] == 2  # the third order's payment, the poison order's ledger delivery
    assert any(third in example and PAYMENTS in example for example in lost["examples"])
    assert report["api"]["charged_without_payment_row"] == 1
    duplicate = found["duplicate-effect"][0]
    assert duplicate["count"] == 1 and second in duplicate["examples"][0]
    assert "committed 2 times" in duplicate["examples"][0]
    order = found["order"][0]
    assert order["count"] == 1
    assert LEDGER in order["examples"][0] and "position 3" in order["examples"][0]
    dead = {v["message"]: v for v in found["dead-letter"]}
    unexpected = dead["dead letters that are not an injected poison order's"]
    assert unexpected["count"] == 1 and SHIPPING in unexpected["examples"][0]
    missing = dead["a poison order was not dead-lettered"]
    assert missing["count"] == 1 and LEDGER in missing["examples"][0]
    assert report["dead_letters"] == {"expected": 2, "found": 1, "unexpected": 1}
    # The third order never got its follow-ups, so no e-mail either.
    emails = {v["message"]: v["count"] for v in found["emails"]}
    assert emails == {"a payable order got no e-mail": 1}
    assert "charges" not in found  # every payable order was charged exactly once
    assert report["losses"]["total"] == 2


def test_an_unsent_event_and_a_missed_recovery_bound_are_violations(engine, settings, queries, api):
    shop = Shop(engine, queries, api.url)
    shop.place(1, 1)  # never published, never processed

    report = run_check(
        settings,
        queries,
        api,
        options={"rate": 1.0},
        faults=[],
        recovery_after="the last order",
        recovered_at=None,
        recovery_timeout=5.0,
        wall_seconds=6.0,
    )
    found = kinds(report)

    assert exit_code(report) == 1
    assert found["backlog"][0]["examples"] == ["1 events of the workflow still unsent"]
    assert found["recovery"][0]["count"] == 1
    assert report["losses"]["by_stage"] == {"never published": 2}
    assert report["losses"]["by_probable_cause"] == {"not published": {LEDGER: 1, PAYMENTS: 1}}
