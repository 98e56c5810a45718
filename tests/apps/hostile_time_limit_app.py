"""A consumer declared with a time limit of NaN seconds (refused)."""

from __future__ import annotations

from pipeline.envelope import ReceivedEvent
from pipeline.inbox import HandlerContext, consumer


@consumer("hostile_time_limit", ["order.placed"], time_limit=float("nan"))
def handle(event: ReceivedEvent, ctx: HandlerContext) -> None:
    """Never registered: the declaration is refused at import."""
