"""The drill's load: orders placed by an application, some by producers with skewed clocks.

Each order is one business transaction that writes the ``orders`` row and its
``order.placed`` event together (the outbox write joins the caller's transaction). When
a commit's outcome is unknown (the connection broke during it), the producer looks the
order up before trying again, so an order is never placed twice and never skipped: the
database, not the producer's memory, says what was placed.

Orders are placed one after another in plan order, so within an account (an ordering
key) the plan's order is the commit order. A segment of the plan may be handed to a
producer process whose clock is shifted (:mod:`pipeline.tools.drill.skewed`): its UUIDv7 ids
then sort before (or after) the ids of events committed before them.
"""

from __future__ import annotations

import json
import random
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from pipeline.outbox import add_event
from pipeline.tools.drill.sql import DrillQueries
from pipeline.tools.drill.workflow import AGGREGATE_TYPE, ORDER_PLACED
from pipeline.tools.harness.fleet import Fleet
from pipeline.tools.harness.sql import WorkflowQueries
from pipeline.tools.harness.workload import LoadThread, wait_turn

POISON_AMOUNT = "12,50"  # a legacy client's decimal string: never payable
RETRY_DELAY = 0.2
PLACE_TIMEOUT = 120.0


@dataclass(frozen=True)
class PlannedOrder:
    order_id: str
    account: str
    n: int  # this order's position among its account's orders
    amount_cents: int | None  # None: a poison order
    run: str

    @property
    def poison(self) -> bool:
        return self.amount_cents is None

    def payload(self) -> dict[str, Any]:
        amount: Any = POISON_AMOUNT if self.amount_cents is None else self.amount_cents
        return {
            "run": self.run,
            "order_id": self.order_id,
            "account": self.account,
            "n": self.n,
            "amount_cents": amount,
        }


@dataclass(frozen=True)
class SkewSegment:
    """Orders ``start`` .. ``start + length - 1`` of the plan, placed with a shifted clock."""

    start: int
    length: int
    skew_seconds: float


def account_count(orders: int) -> int:
    """About forty orders per account, so every key sees many events, within 10..1000 keys."""
    return max(10, min(1000, orders // 40))


def plan_orders(run: str, orders: int, poison: int, rng: random.Random) -> list[PlannedOrder]:
    """``orders`` payable orders and ``poison`` poison ones at random places, over the accounts."""
    accounts = [f"acct-{i:04d}" for i in range(1, account_count(orders) + 1)]
    kinds = [False] * orders
    for _ in range(poison):
        kinds.insert(rng.randrange(len(kinds) + 1), True)
    counters: dict[str, int] = {}
    plan = []
    for index, is_poison in enumerate(kinds, start=1):
        account = rng.choice(accounts)
        counters[account] = counters.get(account, 0) + 1
        amount = None if is_poison else rng.randrange(100, 100_000)
        plan.append(PlannedOrder(f"{run}-{index:07d}", account, counters[account], amount, run))
    return plan


def place_order(
    engine: Engine,
    queries: WorkflowQueries,
    order: PlannedOrder,
    producer: str,
    stop: threading.Event | None = None,
    timeout: float = PLACE_TIMEOUT,
) -> uuid.UUID:
    """Commit the order and its event exactly once, through connection failures.

    Returns the event id. Raises :class:`TimeoutError` when the database stayed
    unreachable for ``timeout`` seconds (or ``stop`` was set).
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            with Session(engine) as session, session.begin():
                event_id = add_event(
                    session,
                    ORDER_PLACED,
                    order.payload(),
                    aggregate_type=AGGREGATE_TYPE,
                    aggregate_id=order.account,
                )
                session.connection().exec_driver_sql(
                    queries.text("place_order"),
                    {
                        "order_id": order.order_id,
                        "event_id": event_id,
                        "account": order.account,
                        "n": order.n,
                        "amount_cents": order.amount_cents,
                        "poison": order.poison,
                        "producer": producer,
                    },
                )
            return event_id
        except DBAPIError as exc:
            if not _connection_trouble(exc):
                raise
        while True:  # the commit may have landed before the connection broke: look first
            if (stop is not None and stop.is_set()) or time.monotonic() > deadline:
                raise TimeoutError(f"could not place order {order.order_id} within {timeout:g} s")
            time.sleep(RETRY_DELAY)
            try:
                landed = order_event(engine, queries, order.order_id)
            except DBAPIError as exc:
                if not _connection_trouble(exc):
                    raise
                continue
            if landed is not None:
                return landed
            break


def order_event(engine: Engine, queries: WorkflowQueries, order_id: str) -> uuid.UUID | None:
    """The event id of a placed order, or None if it was never committed."""
    with engine.connect() as connection:
        row = connection.exec_driver_sql(
            queries.text("order_event"), {"order_id": order_id}
        ).first()
    return None if row is None else uuid.UUID(str(row[0]))


def _connection_trouble(exc: DBAPIError) -> bool:
    """A lost or refused connection (a fault the drill injected), not a bug in the drill."""
    import psycopg

    return exc.connection_invalidated or isinstance(
        exc.orig, psycopg.OperationalError | psycopg.InterfaceError
    )


class Producer(LoadThread):
    """Places the plan at ``rate`` orders per second; skewed segments go to other processes."""

    def __init__(
        self,
        engine: Engine,
        queries: DrillQueries,
        plan: list[PlannedOrder],
        rate: float,
        segments: list[SkewSegment],
        fleet: Fleet,
        skewed_command: Callable[[SkewSegment], list[str]],
        skewed_env: dict[str, str],
        on_segment: Callable[[SkewSegment, float, float, str], None],
    ) -> None:
        super().__init__("drill-producer", engine, queries, rate)
        self.plan = plan
        self.segments = {segment.start: segment for segment in segments}
        self.fleet = fleet
        self.skewed_command = skewed_command
        self.skewed_env = skewed_env
        self.on_segment = on_segment
        self.finished_at: float | None = None  # wall clock of the last order's commit

    def work(self) -> None:
        started = time.monotonic()
        index = 0
        while index < len(self.plan):
            if not wait_turn(started, index, self.rate, self.stop):
                return
            segment = self.segments.get(index)
            if segment is not None:
                self._skewed(segment)
                index += segment.length
                continue
            place_order(self.engine, self.queries, self.plan[index], "main", self.stop)
            self.placed += 1
            index += 1
        self.finished_at = time.time()

    def _skewed(self, segment: SkewSegment) -> None:
        """Run a skewed producer on the segment; place whatever it did not, here, in order."""
        orders = self.plan[segment.start : segment.start + segment.length]
        began = time.time()
        child = self.fleet.start(
            f"skewed producer {segment.skew_seconds:+.0f} s",
            self.skewed_command(segment),
            env=self.skewed_env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        process = child.process
        body = json.dumps([asdict(order) for order in orders]).encode()
        try:
            output, _ = process.communicate(body, timeout=PLACE_TIMEOUT + len(orders))
        except subprocess.TimeoutExpired:
            child.kill()
            output, _ = process.communicate()
        finally:
            self.fleet.forget(child)
        detail = f"exit {process.returncode}"
        for order in orders:  # in plan order: the key order holds whoever placed them
            if not self._landed(order):
                place_order(self.engine, self.queries, order, "main", self.stop)
                detail = f"exit {process.returncode}; the rest placed by the main producer"
            self.placed += 1
        if process.returncode != 0:
            tail = output.decode("utf-8", "replace").strip().splitlines()[-1:] if output else []
            detail += f" ({tail[0][:200]})" if tail else ""
        self.on_segment(segment, began, time.time(), detail)

    def _landed(self, order: PlannedOrder) -> bool:
        deadline = time.monotonic() + PLACE_TIMEOUT
        while True:
            try:
                return order_event(self.engine, self.queries, order.order_id) is not None
            except DBAPIError as exc:
                if not _connection_trouble(exc) or time.monotonic() > deadline:
                    raise
            if self.stop.wait(RETRY_DELAY):
                raise TimeoutError("stopped while checking the skewed producer's orders")
