"""An ordered consumer whose handler records each event it runs (tests/chaos/test_pauses.py).

The ``pause_effects`` table is created by the tests. ``TEST_HANDLER_SLEEP`` (seconds)
makes the handler slow.
"""

from __future__ import annotations

import os
import time

from sqlalchemy import text

from pipeline.envelope import ReceivedEvent
from pipeline.inbox import HandlerContext, consumer

HANDLER_SLEEP = float(os.environ.get("TEST_HANDLER_SLEEP", "0"))


@consumer("effects", ["order.placed"], ordered=True, min_backoff=0.02, max_backoff=0.2)
def record(event: ReceivedEvent, ctx: HandlerContext) -> None:
    if HANDLER_SLEEP:
        time.sleep(HANDLER_SLEEP)
    ctx.session.execute(
        text("INSERT INTO pause_effects (event_id, ordering_key, seq) VALUES (:e, :k, :s)"),
        {"e": str(event.id), "k": event.ordering_key, "s": event.seq},
    )
