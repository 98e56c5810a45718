"""The demo's consumers: an order workflow run by real relay and worker processes.

``order.placed`` -> **payments** charges the order through the payment API (with the
handler's idempotency key) and publishes ``payment.charged`` -> **inventory** reserves
stock and publishes ``stock.reserved`` -> **notifications** sends the confirmation
e-mail through the same API (with a step key). What the drill's workflow shares with it
is in :mod:`pipeline.tools.harness.orders`.

Relays and workers load this module through ``PIPELINE_APP_MODULES=pipeline.tools.demo.app``.
It reads its own settings when a handler first runs, never at import time:

* ``PIPELINE_DEMO_API_URL`` — base URL of the payment/e-mail API
  (``python -m pipeline.tools.harness.payment_api``);
* ``PIPELINE_DEMO_SCHEMA`` — schema of the business tables (default ``pipeline_demo``);
* ``PIPELINE_DEMO_FAIL_RATE`` — probability that a handler attempt fails after doing
  its work (default 0): a transient fault that the retry must absorb without a second
  charge, reservation or e-mail.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from pipeline.config import validate_identifier
from pipeline.envelope import ReceivedEvent
from pipeline.inbox import HandlerContext, consumer
from pipeline.tools.demo.sql import DemoQueries
from pipeline.tools.harness import orders
from pipeline.tools.harness.orders import ApiRejected, Misconfigured

API_URL_ENV = "PIPELINE_DEMO_API_URL"
SCHEMA_ENV = "PIPELINE_DEMO_SCHEMA"
FAIL_RATE_ENV = "PIPELINE_DEMO_FAIL_RATE"
DEFAULT_SCHEMA = "pipeline_demo"
CONFIRMATION_STEP = "confirmation-email"
RETRIES: dict[str, Any] = {"max_retries": 10, "min_backoff": 0.05, "max_backoff": 1.0}
FOLLOW_UP = ("run", "order_id", "customer", "sku", "quantity", "amount_cents")


class InvalidOrder(Exception):
    """The event can never be processed as it is (a poison event): dead-letter it at once."""


class OutOfStock(Exception):
    """Not enough stock to reserve: a business outcome for a person to look at."""


class TransientFailure(Exception):
    """A fault that goes away: one the demo injected after the handler did its work."""


@dataclass(frozen=True)
class DemoConfig:
    api_url: str
    queries: DemoQueries
    fail_rate: float


@lru_cache(maxsize=1)
def demo_config() -> DemoConfig:
    """This process's demo settings, read from the environment on first use."""
    api_url = orders.api_url_from(API_URL_ENV)
    try:
        fail_rate = float(os.environ.get(FAIL_RATE_ENV, "0"))
    except ValueError:
        raise Misconfigured(f"{FAIL_RATE_ENV} must be a number between 0 and 1") from None
    schema = validate_identifier(os.environ.get(SCHEMA_ENV, DEFAULT_SCHEMA), SCHEMA_ENV)
    # The handlers' queries use only {app}; the pipeline schema name is a placeholder.
    return DemoConfig(api_url, DemoQueries("pipeline", schema), min(max(fail_rate, 0.0), 1.0))


def _execute(ctx: HandlerContext, name: str, params: dict[str, Any]) -> Any:
    return orders.execute(ctx, demo_config().queries, name, params)


def _maybe_fail(stage: str) -> None:
    rate = demo_config().fail_rate
    if rate and random.random() < rate:
        raise TransientFailure(f"injected transient failure in {stage} (demo)")


def parse_order(data: Any) -> dict[str, Any]:
    """The order in an ``order.placed`` payload, or :class:`InvalidOrder` (no payload in it)."""
    return orders.validated(
        data, ("run", "order_id", "customer", "sku"), ("quantity", "amount_cents"), InvalidOrder
    )


@consumer(
    "payments",
    ["order.placed"],
    non_retryable=[InvalidOrder, ApiRejected, Misconfigured],
    **RETRIES,
)
def charge_payment(event: ReceivedEvent, ctx: HandlerContext) -> None:
    """Charge the order once, however often this runs: the API sees one idempotency key."""
    order = parse_order(event.data)
    charge_id = orders.charge(ctx, demo_config().api_url, order, customer=order["customer"])
    _execute(
        ctx,
        "record_payment",
        {
            "run": order["run"],
            "order_id": order["order_id"],
            "charge_id": charge_id,
            "amount_cents": order["amount_cents"],
        },
    )
    _maybe_fail("payments")  # after the charge: the retry gets the stored response
    ctx.publish(
        "payment.charged",
        orders.follow_up(event.data, FOLLOW_UP, charge_id=charge_id),
        aggregate_type="order",
        aggregate_id=order["order_id"],
    )


@consumer("inventory", ["payment.charged"], non_retryable=[OutOfStock], **RETRIES)
def reserve_stock(event: ReceivedEvent, ctx: HandlerContext) -> None:
    """Take the order's items off the shelf, in the same transaction as the inbox record."""
    data = event.data
    row = _execute(ctx, "reserve_stock", {"sku": data["sku"], "quantity": data["quantity"]}).first()
    if row is None:
        raise OutOfStock(f"not enough stock of {data['sku']}")
    _execute(
        ctx,
        "record_reservation",
        {
            "run": data["run"],
            "order_id": data["order_id"],
            "sku": data["sku"],
            "quantity": data["quantity"],
        },
    )
    _maybe_fail("inventory")
    ctx.publish(
        "stock.reserved",
        orders.follow_up(data, FOLLOW_UP),
        aggregate_type="order",
        aggregate_id=data["order_id"],
    )


@consumer("notifications", ["stock.reserved"], non_retryable=orders.API_FAILURES, **RETRIES)
def send_confirmation(event: ReceivedEvent, ctx: HandlerContext) -> None:
    """Send one confirmation e-mail per order (with a step key, like multi-call handlers)."""
    data = event.data
    api_url = demo_config().api_url
    message_id = orders.send_email(
        ctx, api_url, CONFIRMATION_STEP, data, data["customer"], "order-confirmed"
    )
    params = {"run": data["run"], "order_id": data["order_id"], "message_id": message_id}
    _execute(ctx, "record_confirmation", params)
    _execute(ctx, "confirm_order", {"order_id": data["order_id"]})
    _maybe_fail("notifications")
