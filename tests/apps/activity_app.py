"""Consumers for the per-consumer status test: one that always succeeds, one that always fails."""

from __future__ import annotations

from pipeline.envelope import ReceivedEvent
from pipeline.inbox import HandlerContext, consumer


class Grumpy(Exception):
    """Every attempt of the failing consumer raises this."""


@consumer("tally", ["order.placed"])
def tally(event: ReceivedEvent, ctx: HandlerContext) -> None:
    """Succeeds."""


@consumer("grumpy", ["order.placed"], max_retries=1, min_backoff=0.05, max_backoff=0.05)
def grumpy(event: ReceivedEvent, ctx: HandlerContext) -> None:
    """Fails twice per event (one retry), then the event is dead-lettered."""
    raise Grumpy("always")
