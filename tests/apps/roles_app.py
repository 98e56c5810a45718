"""Consumers for the least-privilege test: every database path a worker can take.

An ordered consumer (the relay records its deliveries in the inbox) that fails once
before it succeeds (an attempt row), dead-letters poison (a dead letter) and publishes
a follow-up event (an outbox insert) to an unordered consumer. ``role_effects`` is
created and granted by the test.
"""

from __future__ import annotations

from sqlalchemy import text

from pipeline.envelope import ReceivedEvent
from pipeline.inbox import HandlerContext, consumer


class Poison(Exception):
    """An event no retry can fix."""


class FirstTry(Exception):
    """The first attempt of an event that asks for it fails."""


def record(ctx: HandlerContext, event: ReceivedEvent) -> None:
    ctx.session.execute(
        text("INSERT INTO role_effects (consumer, event_id) VALUES (:c, :e)"),
        {"c": ctx.consumer, "e": str(event.id)},
    )


@consumer(
    "role_orders",
    ["role.order"],
    ordered=True,
    non_retryable=[Poison],
    max_retries=5,
    min_backoff=0.02,
    max_backoff=0.1,
)
def orders(event: ReceivedEvent, ctx: HandlerContext) -> None:
    if event.data.get("poison"):
        raise Poison("refused")
    if event.data.get("fail_once") and ctx.attempt == 1:
        raise FirstTry("try again")
    record(ctx, event)
    ctx.publish(
        "role.shipped", {"order": event.data["order"]}, causation_id=event.id, ordered=False
    )


@consumer("role_shipping", ["role.shipped"], max_retries=5, min_backoff=0.02, max_backoff=0.1)
def shipping(event: ReceivedEvent, ctx: HandlerContext) -> None:
    record(ctx, event)
