"""The demo's load: a shop placing orders, and a broker that delivers some messages twice.

:class:`OrderProducer` is the application side of the outbox: each order is one
transaction that writes the ``demo_orders`` row and its ``order.placed`` event.
:class:`DuplicateInjector` re-delivers a sample of already-sent events to their
consumers' queues, as Redis redelivery after a worker crash, or an operator's replay,
would; the inbox must absorb every copy.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from pipeline.config import Settings
from pipeline.envelope import OutboxEvent
from pipeline.outbox import add_event
from pipeline.registry import Registry
from pipeline.tools.demo.sql import DemoQueries
from pipeline.tools.harness.workload import LoadThread, wait_turn
from pipeline.transport.publisher import Delivery, Publisher

SKUS = 200
STOCK_PER_SKU = 1_000_000
CUSTOMERS = 60


def order_id(run: str, number: int) -> str:
    return f"{run}-{number:05d}"


def poison_order_id(run: str) -> str:
    return f"{run}-poison"


def make_order(run: str, number: int, rng: random.Random) -> dict[str, Any]:
    sku_number = rng.randrange(1, SKUS + 1)
    quantity = rng.randrange(1, 4)
    unit_price = 500 + (sku_number * 137) % 4500
    return {
        "run": run,
        "order_id": order_id(run, number),
        "customer": f"cus_{rng.randrange(1, CUSTOMERS + 1):03d}",
        "sku": f"sku-{sku_number:03d}",
        "quantity": quantity,
        "amount_cents": quantity * unit_price,
    }


def make_poison_order(run: str) -> dict[str, Any]:
    """An order a legacy client sent with the amount as a decimal string: never payable."""
    return {
        "run": run,
        "order_id": poison_order_id(run),
        "customer": "cus_000",
        "sku": "sku-001",
        "quantity": 1,
        "amount_cents": "25,98",
    }


class OrderProducer(LoadThread):
    """Places ``count`` orders (plus the poison one) at ``rate`` per second, then stops."""

    def __init__(
        self,
        engine: Engine,
        queries: DemoQueries,
        run: str,
        count: int,
        rate: float,
        poison: bool,
        seed: int | None = None,
    ) -> None:
        super().__init__("demo-producer", engine, queries, rate)
        self.run_id = run
        self.count = count
        self.poison = poison
        self.rng = random.Random(seed)

    @property
    def total(self) -> int:
        return self.count + (1 if self.poison else 0)

    def finished(self) -> bool:
        return self.placed >= self.total

    def work(self) -> None:
        orders = [make_order(self.run_id, n, self.rng) for n in range(1, self.count + 1)]
        if self.poison:
            orders.insert(len(orders) // 2, make_poison_order(self.run_id))
        started = time.monotonic()
        for index, order in enumerate(orders):
            if not wait_turn(started, index, self.rate, self.stop):
                return
            self._place(order)
            self.placed += 1

    def _place(self, order: dict[str, Any]) -> None:
        """One business transaction: the order row and its event commit together, or neither."""
        amount = order["amount_cents"]
        row = {**order, "amount_cents": amount if isinstance(amount, int) else None}
        with Session(self.engine) as session, session.begin():
            session.connection().exec_driver_sql(self.queries.text("place_order"), row)
            add_event(
                session,
                "order.placed",
                order,
                aggregate_type="order",
                aggregate_id=order["order_id"],
            )


class DuplicateInjector(LoadThread):
    """Delivers a random ``rate`` of this run's sent events a second time.

    ``injected`` counts the extra deliveries per consumer exactly: every one of them
    must come back as a duplicate absorbed by that consumer's inbox.
    """

    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        queries: DemoQueries,
        run: str,
        routes: Registry,
        publisher: Publisher,
        rate: float,
        interval: float = 0.2,
        seed: int | None = None,
    ) -> None:
        super().__init__("demo-duplicates", engine, queries, rate)
        self.settings = settings
        self.run_id = run
        self.routes = routes
        self.publisher = publisher
        self.interval = interval
        self.rng = random.Random(seed)
        self.injected: Counter[str] = Counter()
        self._seen: set[str] = set()
        self._since: datetime | None = None

    @property
    def total(self) -> int:
        return sum(self.injected.values())

    def work(self) -> None:
        while not self.stop.wait(self.interval):
            self.inject_once()

    def inject_once(self) -> int:
        """Look at newly sent events once and re-deliver a sample; returns deliveries made."""
        events = self._newly_sent()
        chosen = [e for e in events if self.rng.random() < self.rate or not self.injected]
        deliveries: list[Delivery] = []
        for event in chosen:
            for subscription in self.routes.routes_for(event.event_type):
                deliveries.append(Delivery(subscription, [event]))
        if not deliveries:
            return 0
        outcomes = self.publisher.deliver(deliveries)
        for delivery, outcome in zip(deliveries, outcomes, strict=True):
            if outcome is None:
                self.injected[delivery.subscription.consumer] += 1
        return len(deliveries)

    def _newly_sent(self) -> list[OutboxEvent]:
        # A publisher's commit can land after a later published_at: look back a while,
        # and remember what was already considered.
        since = (self._since or datetime(1970, 1, 1, tzinfo=UTC)) - timedelta(seconds=10)
        with self.engine.connect() as connection:
            rows = connection.exec_driver_sql(
                self.queries.text("sent_since"), {"run": self.run_id, "since": since}
            ).all()
        events = []
        for row in rows:
            key = str(row[0])
            published_at: datetime = row[11]
            if self._since is None or published_at > self._since:
                self._since = published_at
            if key in self._seen:
                continue
            self._seen.add(key)
            events.append(OutboxEvent.from_row(row))
        return events
