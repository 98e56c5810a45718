"""The relay's half of the end-to-end canary: commit a heartbeat event.

The relay commits a ``pipeline.canary`` event every ``PIPELINE_CANARY_INTERVAL``
seconds; the built-in consumer (:mod:`pipeline.inbox.canary`) records its arrival. A
pipeline that stalls silently — relay dead, workers wedged, the broker gone — shows as a
growing age (``time() - pipeline_canary_last_success_timestamp_seconds``).
"""

from __future__ import annotations

import json
import time
from typing import Any

import psycopg

from pipeline.db.stores.outbox import OutboxStore
from pipeline.ids import uuid7
from pipeline.registry import CANARY_EVENT_TYPE


def emit_canary(conn: psycopg.Connection[Any], schema: str) -> None:
    """Commit one canary event (the connection is in autocommit mode)."""
    event_id = uuid7()
    OutboxStore(schema).insert_canary(
        conn,
        event_id,
        CANARY_EVENT_TYPE,
        json.dumps({"emitted_at": time.time()}),
        json.dumps({"correlation_id": str(event_id)}),
    )
