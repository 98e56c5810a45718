"""The end-to-end benchmark's consumer: one trivial database write per event."""

from __future__ import annotations

import time

from sqlalchemy import text

from pipeline.envelope import ReceivedEvent
from pipeline.inbox import HandlerContext, consumer


@consumer("e2e", ["bench.e2e"])
def record(event: ReceivedEvent, ctx: HandlerContext) -> None:
    ctx.session.execute(
        text("INSERT INTO bench_e2e (event_id, done_at) VALUES (:id, :done)"),
        {"id": event.id, "done": time.time()},
    )
