"""A consumer declared with a string where a list of event types belongs (refused)."""

from __future__ import annotations

from pipeline.envelope import ReceivedEvent
from pipeline.inbox import HandlerContext, consumer


@consumer("hostile_letters", "order")  # type: ignore[arg-type]
def handle(event: ReceivedEvent, ctx: HandlerContext) -> None:
    """Never registered: the declaration is refused at import."""
