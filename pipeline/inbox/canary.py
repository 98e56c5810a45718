"""The inbox's half of the end-to-end canary: the built-in consumer that times it.

Registered in every process by the runtime, so relays route the relay's heartbeat
event (:mod:`pipeline.relay.canary`) and workers handle it; each arrival sets
``pipeline_canary_last_success_timestamp_seconds`` and observes the latency.
"""

from __future__ import annotations

import time
from datetime import datetime

from pipeline.envelope import ReceivedEvent
from pipeline.inbox.consumer import consumer
from pipeline.inbox.context import HandlerContext
from pipeline.observability import metrics
from pipeline.registry import CANARY_CONSUMER, CANARY_EVENT_TYPE, Registry


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
