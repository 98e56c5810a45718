"""The drill's workflow, shared by its consumers (in the workers) and its checker.

One order makes three events and four deliveries::

    order.placed ──▶ drill_payments (unordered): charges through the payment API,
         │                 publishes payment.charged
         └─────────▶ drill_ledger (ordered by account): records its per-key position
    payment.charged ─▶ drill_shipping (ordered by account): records its per-key position,
                           publishes order.shipped (unordered)
    order.shipped ──▶ drill_notifications (unordered): sends an e-mail through the API

Ordered consumers take a per-(consumer, key) counter in their own transaction, so the
positions they record are the order in which their work committed for that key.
"""

from __future__ import annotations

from dataclasses import dataclass

API_URL_ENV = "PIPELINE_DRILL_API_URL"
APP_SCHEMA_ENV = "PIPELINE_DRILL_APP_SCHEMA"

ORDER_PLACED = "order.placed"
PAYMENT_CHARGED = "payment.charged"
ORDER_SHIPPED = "order.shipped"
EVENT_TYPES = (ORDER_PLACED, PAYMENT_CHARGED, ORDER_SHIPPED)
AGGREGATE_TYPE = "account"

PAYMENTS = "drill_payments"
LEDGER = "drill_ledger"
SHIPPING = "drill_shipping"
NOTIFICATIONS = "drill_notifications"

EMAIL_STEP = "shipped-email"


@dataclass(frozen=True)
class Route:
    """A consumer of the workflow: the event type it takes and whether it is ordered."""

    consumer: str
    event_type: str
    ordered: bool


ROUTES = (
    Route(PAYMENTS, ORDER_PLACED, ordered=False),
    Route(LEDGER, ORDER_PLACED, ordered=True),
    Route(SHIPPING, PAYMENT_CHARGED, ordered=True),
    Route(NOTIFICATIONS, ORDER_SHIPPED, ordered=False),
)
CONSUMERS = tuple(route.consumer for route in ROUTES)
ORDERED_CONSUMERS = tuple(route.consumer for route in ROUTES if route.ordered)
POISON_CONSUMERS = tuple(route.consumer for route in ROUTES if route.event_type == ORDER_PLACED)
"""Consumers that must dead-letter a poison order (every consumer of ``order.placed``)."""


def ordering_key(account: str) -> str:
    """The ordering key the producer's ``aggregate_type``/``aggregate_id`` give an order."""
    return f"{AGGREGATE_TYPE}:{account}"
