"""Consumers for inbox tests, run by real worker processes (steered by environment variables).

Tables they write are created by the tests (see tests/integration/test_inbox.py).
"""

from __future__ import annotations

import os
import random
import time

import httpx
from sqlalchemy import text

from pipeline.envelope import ReceivedEvent
from pipeline.inbox import HandlerContext, consumer
from pipeline.inbox.http import idempotent_post

FAIL_RATE = float(os.environ.get("TEST_FAIL_RATE", "0"))
HANDLER_SLEEP = float(os.environ.get("TEST_HANDLER_SLEEP", "0"))  # seconds inside the transaction
PAYMENT_API = os.environ.get("TEST_PAYMENT_API", "")
_http = httpx.Client(timeout=10)


class Flaky(Exception):
    """A transient failure injected by the tests."""


def maybe_fail() -> None:
    if FAIL_RATE and random.random() < FAIL_RATE:
        raise Flaky("injected failure")


def effect(ctx: HandlerContext, stage: str, event: ReceivedEvent) -> None:
    ctx.session.execute(
        text("INSERT INTO effects (stage, order_id, event_id) VALUES (:s, :o, :e)"),
        {"s": stage, "o": event.data["order_id"], "e": str(event.id)},
    )
    if HANDLER_SLEEP:  # a window in which the tests kill the worker's connection
        time.sleep(HANDLER_SLEEP)


@consumer("ledger", ["entry.booked"], min_backoff=0.05, max_backoff=0.2)
def ledger(event: ReceivedEvent, ctx: HandlerContext) -> None:
    effect(ctx, "ledger", event)
    if event.data.get("slow"):
        ctx.session.execute(text("SELECT pg_advisory_xact_lock(42)"))  # queue behind the test
        time.sleep(float(event.data["slow"]))


@consumer("payments", ["order.placed"], max_retries=20, min_backoff=0.02, max_backoff=0.2)
def payments(event: ReceivedEvent, ctx: HandlerContext) -> None:
    effect(ctx, "payments", event)
    if PAYMENT_API:
        response = idempotent_post(
            _http,
            f"{PAYMENT_API}/charges",
            ctx,
            json={"order_id": event.data["order_id"], "amount": event.data.get("amount", 1)},
        )
        response.raise_for_status()
    maybe_fail()
    ctx.publish(
        "payment.charged",
        {"order_id": event.data["order_id"]},
        aggregate_type="order",
        aggregate_id=event.data["order_id"],
    )


@consumer("inventory", ["payment.charged"], max_retries=20, min_backoff=0.02, max_backoff=0.2)
def inventory(event: ReceivedEvent, ctx: HandlerContext) -> None:
    effect(ctx, "inventory", event)
    maybe_fail()
    ctx.publish(
        "stock.reserved",
        {"order_id": event.data["order_id"]},
        aggregate_type="order",
        aggregate_id=event.data["order_id"],
    )


@consumer("notifications", ["stock.reserved"], max_retries=20, min_backoff=0.02, max_backoff=0.2)
def notifications(event: ReceivedEvent, ctx: HandlerContext) -> None:
    effect(ctx, "notifications", event)
    maybe_fail()


@consumer(
    "sequencer", ["seq.step"], ordered=True, max_retries=20, min_backoff=0.02, max_backoff=0.2
)
def sequencer(event: ReceivedEvent, ctx: HandlerContext) -> None:
    ctx.session.execute(
        text("INSERT INTO seq_log (ordering_key, seq, n) VALUES (:k, :s, :n)"),
        {"k": event.ordering_key, "s": event.seq, "n": event.data["n"]},
    )
    maybe_fail()
