"""Consumers for the stuck-worker tests, run by real worker processes.

* ``tally`` (ordered) records every ``order.placed`` with its key and sequence number;
* ``counter`` (unordered) records every ``item.added``;
* ``holder`` publishes a follow-up of a hot key, then waits for an advisory lock the
  test holds (``HOLD_LOCK``): the test knows the transaction is open and where;
* ``noter`` records the follow-up.

Tables are created by the tests (see tests/chaos/test_stuck_workers.py).
"""

from __future__ import annotations

import os

from sqlalchemy import text

from pipeline.envelope import ReceivedEvent
from pipeline.inbox import HandlerContext, consumer

HOLD_LOCK = 4242
PID_FILE = os.environ.get("TEST_HOLD_PID_FILE", "")


def record(ctx: HandlerContext, event: ReceivedEvent) -> None:
    ctx.session.execute(
        text("INSERT INTO tally (consumer, event_id, ordering_key, seq) VALUES (:c, :e, :k, :s)"),
        {"c": ctx.consumer, "e": str(event.id), "k": event.ordering_key, "s": event.seq},
    )


@consumer("tally", ["order.placed"], ordered=True, max_retries=20, max_backoff=0.2)
def tally(event: ReceivedEvent, ctx: HandlerContext) -> None:
    record(ctx, event)


@consumer("counter", ["item.added"], max_retries=20, max_backoff=0.2)
def counter(event: ReceivedEvent, ctx: HandlerContext) -> None:
    record(ctx, event)


@consumer("holder", ["hold.start"], max_retries=20, max_backoff=0.2)
def holder(event: ReceivedEvent, ctx: HandlerContext) -> None:
    record(ctx, event)
    ctx.publish("order.noted", {"held": True}, ordering_key=event.data["key"])
    if PID_FILE:
        with open(PID_FILE, "w") as handle:
            handle.write(str(os.getpid()))
    # waits as long as the test holds the lock (the workers' lock_timeout would end it)
    ctx.session.execute(text("SET LOCAL lock_timeout = 0"))
    ctx.session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": HOLD_LOCK})


@consumer("noter", ["order.noted"], max_retries=20, max_backoff=0.2)
def noter(event: ReceivedEvent, ctx: HandlerContext) -> None:
    record(ctx, event)
