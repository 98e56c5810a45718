"""The relay's half of the end-to-end canary: commit a heartbeat event.

The relay commits a ``pipeline.canary`` event every ``PIPELINE_CANARY_INTERVAL``
seconds; the built-in consumer (:mod:`pipeline.inbox.canary`) records its arrival. A
pipeline that stalls silently — relay dead, workers wedged, Redis gone — shows as a
growing age (``time() - pipeline_canary_last_success_timestamp_seconds``).
"""

from __future__ import annotations

import json
import time
from typing import Any

import psycopg

from pipeline.db.queries import queries_for
from pipeline.ids import uuid7
from pipeline.registry import CANARY_EVENT_TYPE


def emit_canary(conn: psycopg.Connection[Any], schema: str) -> None:
    """Commit one canary event (the connection is in autocommit mode)."""
    event_id = uuid7()
    conn.execute(
        queries_for(schema)["canary_insert"],
        {
            "id": event_id,
            "event_type": CANARY_EVENT_TYPE,
            "payload": json.dumps({"emitted_at": time.time()}),
            "headers": json.dumps({"correlation_id": str(event_id)}),
        },
    )
