"""The end-to-end benchmark's consumer: one trivial database write per event.

``BENCH_E2E_API`` (set by ``end_to_end.py --api``) picks how the row is written: ``core``
(the default) through the session's connection at the driver level, as the peers'
handlers write theirs with asyncpg's ``execute``; ``session`` through
``Session.execute(text(...))``, which adds SQLAlchemy's statement caching and result
machinery to every event.
"""

from __future__ import annotations

import os
import time

from sqlalchemy import text

from pipeline.envelope import ReceivedEvent
from pipeline.inbox import HandlerContext, consumer

API_VARIABLE = "BENCH_E2E_API"
DRIVER_SQL = "INSERT INTO bench_e2e (event_id, done_at) VALUES (%(id)s, %(done)s)"
SESSION_SQL = text("INSERT INTO bench_e2e (event_id, done_at) VALUES (:id, :done)")
THROUGH_SESSION = os.environ.get(API_VARIABLE, "core") == "session"


@consumer("e2e", ["bench.e2e"])
def record(event: ReceivedEvent, ctx: HandlerContext) -> None:
    row = {"id": event.id, "done": time.time()}
    if THROUGH_SESSION:
        ctx.session.execute(SESSION_SQL, row)
    else:
        ctx.session.connection().exec_driver_sql(DRIVER_SQL, row)
