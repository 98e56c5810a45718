"""The end-to-end canary: a heartbeat event that travels the whole pipeline.

The relay commits a ``pipeline.canary`` event every ``PIPELINE_CANARY_INTERVAL``
seconds; the built-in consumer ``pipeline_canary`` (registered in every process by the
runtime) records when one last made it and how long it took. A pipeline that stalls
silently — relay dead, workers wedged, Redis gone — shows as a growing age
(``time() - pipeline_canary_last_success_timestamp_seconds``), which the alert rules watch.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from typing import Any

import psycopg

from pipeline.db.queries import queries_for
from pipeline.envelope import ReceivedEvent
from pipeline.ids import uuid7
from pipeline.inbox.consumer import consumer
from pipeline.inbox.context import HandlerContext
from pipeline.observability import metrics
from pipeline.registry import Registry

CANARY_EVENT_TYPE = "pipeline.canary"
CANARY_CONSUMER = "pipeline_canary"


def handle_canary(event: ReceivedEvent, ctx: HandlerContext) -> None:
    created = datetime.fromisoformat(event.time).timestamp()
    metrics.record_canary_success(time.time() - created)


def register_canary(consumers: Registry) -> None:
    """Add the built-in canary consumer (idempotent)."""
    existing = {s.consumer for s in consumers.all()}
    if CANARY_CONSUMER not in existing:
        consumer(CANARY_CONSUMER, [CANARY_EVENT_TYPE], max_retries=0, registry=consumers)(
            handle_canary
        )


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
