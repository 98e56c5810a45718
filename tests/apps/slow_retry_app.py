"""A consumer that may retry for ten hours: its retry horizon is 10 x 3600 s + the
redelivery horizon, so an inbox retention must be at least that (test_retention.py)."""

from pipeline.envelope import ReceivedEvent
from pipeline.inbox import HandlerContext, consumer


@consumer("slowpoke", ["order.placed"], max_retries=10, max_backoff=3600)
def slowpoke(event: ReceivedEvent, ctx: HandlerContext) -> None:
    """Never called: the app is only imported for its declaration."""
