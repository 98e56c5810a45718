"""The drill's consumers, run by real relay and worker processes (see :mod:`.workflow`).

What they share with the demo's workflow (the payment API calls, the handlers' tools) is
in :mod:`pipeline.tools.harness.orders`.

Relays and workers load this module through ``PIPELINE_APP_MODULES=pipeline.tools.drill.app``.
Its settings are read when a handler first runs, never at import time:

* ``PIPELINE_DRILL_API_URL`` — base URL of the payment/e-mail API
  (``python -m pipeline.tools.harness.payment_api``), which honours ``Idempotency-Key``;
* ``PIPELINE_DRILL_APP_SCHEMA`` — the schema of the drill's business tables.

A poison order (an amount that is not a positive integer) is refused by every consumer of
``order.placed`` as non-retryable, so it must end as a dead letter and nothing else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from pipeline.config import validate_identifier
from pipeline.envelope import ReceivedEvent
from pipeline.inbox import HandlerContext, consumer
from pipeline.tools.drill.sql import DrillQueries
from pipeline.tools.drill.workflow import (
    AGGREGATE_TYPE,
    API_URL_ENV,
    APP_SCHEMA_ENV,
    EMAIL_STEP,
    LEDGER,
    NOTIFICATIONS,
    ORDER_PLACED,
    ORDER_SHIPPED,
    PAYMENT_CHARGED,
    PAYMENTS,
    SHIPPING,
)
from pipeline.tools.harness import orders
from pipeline.tools.harness.orders import ApiRejected, Misconfigured

RETRIES: dict[str, Any] = {"max_retries": 20, "min_backoff": 0.05, "max_backoff": 2.0}
FOLLOW_UP = ("run", "order_id", "account", "n", "amount_cents")


class PoisonOrder(Exception):
    """The order can never be processed as it is: dead-letter it at once."""


@dataclass(frozen=True)
class DrillConfig:
    api_url: str
    queries: DrillQueries


@lru_cache(maxsize=1)
def drill_config() -> DrillConfig:
    """This process's drill settings, read from the environment on first use."""
    api_url = orders.api_url_from(API_URL_ENV)
    schema = validate_identifier(os.environ.get(APP_SCHEMA_ENV, ""), APP_SCHEMA_ENV)
    # The handlers' queries use only {app}; the pipeline schema name is a placeholder.
    return DrillConfig(api_url, DrillQueries("pipeline", schema))


def _execute(ctx: HandlerContext, name: str, params: dict[str, Any]) -> Any:
    return orders.execute(ctx, drill_config().queries, name, params)


def parse_order(data: Any) -> dict[str, Any]:
    """The order in an ``order.placed`` payload, or :class:`PoisonOrder`."""
    return orders.validated(
        data, ("run", "order_id", "account"), ("n", "amount_cents"), PoisonOrder
    )


def _record(
    ctx: HandlerContext,
    event: ReceivedEvent,
    data: dict[str, Any],
    *,
    ordered: bool,
    ref: str | None = None,
) -> None:
    """The consumer's effect row; an ordered consumer also takes its next position for the key."""
    position = None
    if ordered:
        row = _execute(ctx, "take_position", {"consumer": ctx.consumer, "key": event.ordering_key})
        position = int(row.scalar_one())
    _execute(
        ctx,
        "record_effect",
        {
            "consumer": ctx.consumer,
            "event_id": event.id,
            "order_id": data["order_id"],
            "key": event.ordering_key,
            "seq": event.seq,
            "n": data["n"],
            "position": position,
            "ref": ref,
        },
    )


@consumer(
    PAYMENTS,
    [ORDER_PLACED],
    non_retryable=[PoisonOrder, ApiRejected, Misconfigured],
    **RETRIES,
)
def charge(event: ReceivedEvent, ctx: HandlerContext) -> None:
    """Charge the order once however often this runs: the API sees one idempotency key."""
    order = parse_order(event.data)
    charge_id = orders.charge(ctx, drill_config().api_url, order, customer=order["account"])
    _record(ctx, event, order, ordered=False, ref=charge_id)
    ctx.publish(
        PAYMENT_CHARGED,
        orders.follow_up(order, FOLLOW_UP, charge_id=charge_id),
        aggregate_type=AGGREGATE_TYPE,
        aggregate_id=order["account"],
    )


@consumer(LEDGER, [ORDER_PLACED], ordered=True, non_retryable=[PoisonOrder], **RETRIES)
def post_to_ledger(event: ReceivedEvent, ctx: HandlerContext) -> None:
    """Record the order in the account's ledger, in the account's order."""
    _record(ctx, event, parse_order(event.data), ordered=True)


@consumer(SHIPPING, [PAYMENT_CHARGED], ordered=True, **RETRIES)
def ship(event: ReceivedEvent, ctx: HandlerContext) -> None:
    """Ship a paid order, in the account's order, and announce it (an unordered event)."""
    _record(ctx, event, event.data, ordered=True)
    ctx.publish(ORDER_SHIPPED, orders.follow_up(event.data, FOLLOW_UP), ordered=False)


@consumer(NOTIFICATIONS, [ORDER_SHIPPED], non_retryable=orders.API_FAILURES, **RETRIES)
def notify(event: ReceivedEvent, ctx: HandlerContext) -> None:
    """Send one shipping e-mail per order (with a step key, like multi-call handlers)."""
    data = event.data
    api_url = drill_config().api_url
    message_id = orders.send_email(ctx, api_url, EMAIL_STEP, data, data["account"], "order-shipped")
    _record(ctx, event, data, ordered=False, ref=message_id)
