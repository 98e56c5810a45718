"""Consumers for the dead-letter tests, run by real worker processes and by the sandbox.

``payments`` fails permanently on orders marked ``poison`` while the ``dlq_switches`` row
for it says ``broken``: the tests dead-letter such orders, then "deploy a fix" by clearing
the switch, then replay. Orders marked ``declined`` fail permanently with a second cause
(``CardDeclined``, whose message varies per order as real messages do: numbers, a
quoted value, a UUID), fix or no fix; orders marked ``unauthorized`` fail the same way with
an HTTP client's error that quotes the URL it called, secrets and all (:data:`CHARGE_URL`).
``audit`` takes the same events and never fails; ``shipping``
takes the follow-up events ``payments`` publishes. Tables are created by the tests
(tests/integration/test_dlq.py).
"""

from __future__ import annotations

import os
import uuid

import httpx
from sqlalchemy import text

from pipeline.envelope import ReceivedEvent
from pipeline.inbox import HandlerContext, consumer
from pipeline.inbox.http import idempotent_post

PAYMENT_API = os.environ.get("TEST_PAYMENT_API", "")
# A URL carrying a password and an API key, as a handler's HTTP client would quote it.
CHARGE_URL = "https://charger:hunter2-pw@api.example/v1/charge?order=o7&api_key=sk-live-4f9a2c"
_http = httpx.Client(timeout=10)


class Poison(Exception):
    """This order cannot be charged until the fix is deployed (never retried)."""


def effect(ctx: HandlerContext, event: ReceivedEvent) -> None:
    ctx.session.execute(
        text("INSERT INTO effects (consumer, order_id, event_id) VALUES (:c, :o, :e)"),
        {"c": ctx.consumer, "o": event.data["order_id"], "e": str(event.id)},
    )


def broken(ctx: HandlerContext) -> bool:
    return bool(
        ctx.session.execute(
            text("SELECT broken FROM dlq_switches WHERE consumer = :c"), {"c": ctx.consumer}
        ).scalar()
    )


class CardDeclined(Exception):
    """The card was declined: a cause of its own, never retried."""


@consumer("payments", ["order.placed"], max_retries=2, non_retryable=[Poison, CardDeclined])
def payments(event: ReceivedEvent, ctx: HandlerContext) -> None:
    effect(ctx, event)
    if PAYMENT_API:
        response = idempotent_post(
            _http,
            f"{PAYMENT_API}/v1/charges",
            ctx,
            json={"order_id": event.data["order_id"], "amount": 5},
        )
        response.raise_for_status()
    if event.data.get("poison") and broken(ctx):
        raise Poison(f"cannot charge order {event.data['order_id']}")
    if event.data.get("unauthorized"):
        raise CardDeclined(f"Client error '401 Unauthorized' for url '{CHARGE_URL}'")
    if event.data.get("declined"):
        raise CardDeclined(
            f"card {event.data['declined']} declined for order '{event.data['order_id']}' "
            f"(reference {uuid.uuid4()})"
        )
    ctx.publish("payment.charged", {"order_id": event.data["order_id"]})


@consumer("audit", ["order.placed"])
def audit(event: ReceivedEvent, ctx: HandlerContext) -> None:
    effect(ctx, event)


@consumer("shipping", ["payment.charged"])
def shipping(event: ReceivedEvent, ctx: HandlerContext) -> None:
    effect(ctx, event)
