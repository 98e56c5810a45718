"""The events behind a dead letter, as the relay would deliver them again.

An event is read from its outbox row, exactly as the relay reads it, so a replayed copy
keeps its id, sequence number and trace context (every inbox still recognises a copy it
already processed). When the outbox row is gone (pruned), the envelope the consumer was
given, kept with a consume-stage dead letter, stands in for it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import psycopg

from pipeline.db.stores.dead_letters import DeadLetterStore
from pipeline.envelope import OutboxEvent
from pipeline.tools.ops.dlq.records import DeadLetter

# Envelope attributes that came from the outbox row's headers (encode_envelope).
_HEADER_ATTRIBUTES = {
    "traceparent": "traceparent",
    "tracestate": "tracestate",
    "pipelinecorrelationid": "correlation_id",
    "pipelinecausationid": "causation_id",
}


def load_events(
    conn: psycopg.Connection[Any], schema: str, letter: DeadLetter
) -> list[OutboxEvent]:
    """The dead letter's events in sequence order: outbox rows, else its kept envelopes."""
    wanted = letter.event_ids
    if not wanted:
        return []
    store = DeadLetterStore(schema)
    found = {event.id: event for event in store.events(conn, wanted)}
    missing = [event_id for event_id in wanted if event_id not in found]
    if missing:
        stored = store.envelope(conn, letter.id)
        for envelope in _envelopes(json.loads(stored) if stored else None):
            event = event_from_envelope(envelope)
            if event is not None and event.id in missing:
                found[event.id] = event
    return sorted(found.values(), key=lambda event: event.seq)


def _envelopes(stored: Any) -> Sequence[dict[str, Any]]:
    """An envelope kept alone, or the envelopes inside a kept message's arguments."""
    if not isinstance(stored, dict):
        return []
    if "data" in stored:
        return [stored]
    args = stored.get("args")
    if isinstance(args, list) and args and isinstance(args[0], list):
        return [e for e in args[0] if isinstance(e, dict)]
    return []


def event_from_envelope(envelope: dict[str, Any]) -> OutboxEvent | None:
    """The outbox event an envelope was made from (the inverse of ``encode_envelope``)."""
    try:
        event_id = uuid.UUID(str(envelope["id"]))
        event_type = str(envelope["type"])
        data = envelope["data"]
        created = datetime.fromisoformat(str(envelope.get("time") or ""))
    except (KeyError, ValueError):
        return None
    headers: dict[str, Any] = {}
    extra = envelope.get("pipelineheaders")
    if isinstance(extra, dict):
        headers.update(extra)
    for attribute, header in _HEADER_ATTRIBUTES.items():
        if isinstance(envelope.get(attribute), str):
            headers[header] = envelope[attribute]
    return OutboxEvent(
        id=event_id,
        seq=_int(envelope.get("pipelineseq"), 0),
        aggregate_type=envelope.get("pipelineaggregatetype"),
        aggregate_id=envelope.get("subject"),
        ordering_key=envelope.get("pipelineorderingkey"),
        event_type=event_type,
        event_version=_int(envelope.get("pipelineeventversion"), 1),
        payload_json=json.dumps(data, separators=(",", ":")),
        headers_json=json.dumps(headers, separators=(",", ":")),
        attempts=0,
        created_at=created if created.tzinfo else created.replace(tzinfo=UTC),
    )


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default
