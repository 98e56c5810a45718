"""A consumer whose first attempt fails and whose retry waits 8 s: longer than the
5 s ``consumer_timeout`` of the RabbitMQ node in test_amqp_consumer_timeout.py, so the
retry sits on the delay queue past it."""

from sqlalchemy import text

from pipeline.envelope import ReceivedEvent
from pipeline.inbox import HandlerContext, consumer

RETRY_BACKOFF = 8.0  # seconds, min and max alike: the retry waits exactly this


class NotYet(Exception):
    """The first attempt's injected, transient failure."""


@consumer(
    "patient",
    ["parcel.shipped"],
    max_retries=3,
    min_backoff=RETRY_BACKOFF,
    max_backoff=RETRY_BACKOFF,
)
def patient(event: ReceivedEvent, ctx: HandlerContext) -> None:
    ctx.session.execute(
        text("INSERT INTO effects (stage, order_id, event_id) VALUES (:s, :o, :e)"),
        {"s": "patient", "o": event.data["order_id"], "e": str(event.id)},
    )
    if ctx.attempt == 1:
        raise NotYet("first attempt fails; the retry waits out the backoff")
