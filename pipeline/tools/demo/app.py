"""The demo's consumers: an order workflow run by real relay and worker processes.

``order.placed`` -> **payments** charges the order through the payment API (with the
handler's idempotency key) and publishes ``payment.charged`` -> **inventory** reserves
stock and publishes ``stock.reserved`` -> **notifications** sends the confirmation
e-mail through the same API (with a step key).

Relays and workers load this module through ``PIPELINE_APP_MODULES=pipeline.tools.demo.app``.
It reads its own settings when a handler first runs, never at import time:

* ``PIPELINE_DEMO_API_URL`` — base URL of the payment/e-mail API
  (``python -m pipeline.tools.demo.payment_api``);
* ``PIPELINE_DEMO_SCHEMA`` — schema of the business tables (default ``pipeline_demo``);
* ``PIPELINE_DEMO_FAIL_RATE`` — probability that a handler attempt fails after doing
  its work (default 0): a transient fault that the retry must absorb without a second
  charge, reservation or e-mail.
"""

from __future__ import annotations

import os
import random
import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import httpx

from pipeline.config import validate_identifier
from pipeline.envelope import ReceivedEvent
from pipeline.inbox import HandlerContext, consumer
from pipeline.inbox.http import idempotent_post
from pipeline.tools.demo.sql import DemoQueries

API_URL_ENV = "PIPELINE_DEMO_API_URL"
SCHEMA_ENV = "PIPELINE_DEMO_SCHEMA"
FAIL_RATE_ENV = "PIPELINE_DEMO_FAIL_RATE"
DEFAULT_SCHEMA = "pipeline_demo"
CHARGES_PATH = "/v1/charges"
EMAILS_PATH = "/v1/emails"
CONFIRMATION_STEP = "confirmation-email"
RETRIES: dict[str, Any] = {"max_retries": 10, "min_backoff": 0.05, "max_backoff": 1.0}


class InvalidOrder(Exception):
    """The event can never be processed as it is (a poison event): dead-letter it at once."""


class OutOfStock(Exception):
    """Not enough stock to reserve: a business outcome for a person to look at."""


class ApiRejected(Exception):
    """The API refused the request for good (4xx other than 409): retrying cannot help."""


class DemoMisconfigured(Exception):
    """A worker lacks a demo setting; every attempt would fail the same way."""


class TransientFailure(Exception):
    """A fault that goes away: the API is busy (409, 5xx), or one the demo injected."""


@dataclass(frozen=True)
class DemoConfig:
    api_url: str
    app_schema: str
    fail_rate: float


@lru_cache(maxsize=1)
def demo_config() -> DemoConfig:
    """This process's demo settings, read from the environment on first use."""
    api_url = os.environ.get(API_URL_ENV, "").rstrip("/")
    if not api_url.startswith(("http://", "https://")):
        raise DemoMisconfigured(f"{API_URL_ENV} must be the payment API's http(s) URL")
    try:
        fail_rate = float(os.environ.get(FAIL_RATE_ENV, "0"))
    except ValueError:
        raise DemoMisconfigured(f"{FAIL_RATE_ENV} must be a number between 0 and 1") from None
    schema = validate_identifier(os.environ.get(SCHEMA_ENV, DEFAULT_SCHEMA), SCHEMA_ENV)
    return DemoConfig(api_url, schema, min(max(fail_rate, 0.0), 1.0))


_clients: dict[int, httpx.Client] = {}
_clients_lock = threading.Lock()


def http_client() -> httpx.Client:
    """One connection pool per process (Dramatiq forks workers after importing this)."""
    pid = os.getpid()
    with _clients_lock:
        client = _clients.get(pid)
        if client is None:
            client = _clients[pid] = httpx.Client(timeout=10.0)
        return client


def _queries() -> DemoQueries:
    # The pipeline schema is not used by the handlers' queries; only {app} is.
    return DemoQueries("pipeline", demo_config().app_schema)


def _execute(ctx: HandlerContext, name: str, params: dict[str, Any]) -> Any:
    """Run a named query in the handler's transaction (the inbox record's transaction)."""
    return ctx.session.connection().exec_driver_sql(_queries().text(name), params)


def _maybe_fail(stage: str) -> None:
    rate = demo_config().fail_rate
    if rate and random.random() < rate:
        raise TransientFailure(f"injected transient failure in {stage} (demo)")


def _api_result(response: httpx.Response) -> dict[str, Any]:
    if response.status_code == 409 or response.status_code >= 500:
        raise TransientFailure(f"API answered {response.status_code}; retry later")
    if response.status_code >= 400:
        raise ApiRejected(f"API refused the request with {response.status_code}")
    result: dict[str, Any] = response.json()
    return result


def parse_order(data: Any) -> dict[str, Any]:
    """The order in an ``order.placed`` payload, or :class:`InvalidOrder` (no payload in it)."""
    if not isinstance(data, dict):
        raise InvalidOrder("payload is not a JSON object")
    for name in ("run", "order_id", "customer", "sku"):
        if not isinstance(data.get(name), str) or not data[name]:
            raise InvalidOrder(f"{name} must be a non-empty string")
    for name in ("quantity", "amount_cents"):
        value = data.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InvalidOrder(
                f"{name} must be a positive integer, got a {type(value).__name__} value"
            )
    return data


def _follow_up(event: ReceivedEvent, **extra: Any) -> dict[str, Any]:
    keep = ("run", "order_id", "customer", "sku", "quantity", "amount_cents")
    return {**{k: event.data[k] for k in keep if k in event.data}, **extra}


@consumer(
    "payments",
    ["order.placed"],
    non_retryable=[InvalidOrder, ApiRejected, DemoMisconfigured],
    **RETRIES,
)
def charge_payment(event: ReceivedEvent, ctx: HandlerContext) -> None:
    """Charge the order once, however often this runs: the API sees one idempotency key."""
    order = parse_order(event.data)
    config = demo_config()
    response = idempotent_post(
        http_client(),
        config.api_url + CHARGES_PATH,
        ctx,
        json={
            "run": order["run"],
            "order_id": order["order_id"],
            "customer": order["customer"],
            "amount_cents": order["amount_cents"],
            "currency": "EUR",
        },
    )
    charge = _api_result(response)
    _execute(
        ctx,
        "record_payment",
        {
            "run": order["run"],
            "order_id": order["order_id"],
            "charge_id": charge["id"],
            "amount_cents": order["amount_cents"],
        },
    )
    _maybe_fail("payments")  # after the charge: the retry gets the stored response
    ctx.publish(
        "payment.charged",
        _follow_up(event, charge_id=charge["id"]),
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
        _follow_up(event),
        aggregate_type="order",
        aggregate_id=data["order_id"],
    )


@consumer(
    "notifications",
    ["stock.reserved"],
    non_retryable=[ApiRejected, DemoMisconfigured],
    **RETRIES,
)
def send_confirmation(event: ReceivedEvent, ctx: HandlerContext) -> None:
    """Send one confirmation e-mail per order (with a step key, like multi-call handlers)."""
    data = event.data
    response = idempotent_post(
        http_client(),
        demo_config().api_url + EMAILS_PATH,
        ctx,
        step=CONFIRMATION_STEP,
        json={
            "run": data["run"],
            "order_id": data["order_id"],
            "to": f"{data['customer']}@example.com",
            "template": "order-confirmed",
        },
    )
    message = _api_result(response)
    params = {"run": data["run"], "order_id": data["order_id"], "message_id": message["id"]}
    _execute(ctx, "record_confirmation", params)
    _execute(ctx, "confirm_order", {"order_id": data["order_id"]})
    _maybe_fail("notifications")
