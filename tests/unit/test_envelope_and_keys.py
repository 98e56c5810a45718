"""Envelopes are CloudEvents JSON; idempotency keys are deterministic; upcasters chain."""

from __future__ import annotations

import json
import uuid

import pytest

from pipeline.envelope import EnvelopeError, decode_envelope, encode_envelope
from pipeline.errors import ConfigurationError
from pipeline.inbox.idempotency import idempotency_key
from pipeline.inbox.upcasting import Upcasters
from tests.support import outbox_event


def test_envelope_round_trip_keeps_payload_text_and_attributes():
    event = outbox_event()
    text = encode_envelope(event, "/pipeline/test")
    envelope = json.loads(text)
    assert envelope["specversion"] == "1.0" and envelope["type"] == "order.placed"
    assert envelope["data"] == {"total": 42, "items": ["a", "é"]}
    assert envelope["subject"] == "o-1" and envelope["time"] == "2026-01-02T03:04:05+00:00"
    assert all(k.isalnum() and k.islower() for k in envelope)  # CloudEvents attribute naming
    received = decode_envelope(envelope)
    assert received.id == event.id and received.version == 2 and received.seq == 7
    assert received.ordering_key == "order:o-1" and received.causation_id == "x-1"
    assert received.traceparent.startswith("00-aaa") and received.headers == {"tenant": "t"}


@pytest.mark.parametrize(
    ("envelope", "reason"),
    [
        ([], "must be a JSON object"),
        ({"specversion": "0.3"}, "unsupported specversion"),
        ({"specversion": "1.0", "id": "x", "type": "t", "source": "s", "data": 1}, "not a UUID"),
        ({"specversion": "1.0", "id": str(uuid.uuid4()), "type": "t", "source": "s"}, "no data"),
        ({"specversion": "1.0", "type": "t", "source": "s", "data": 1}, "'id' is missing"),
    ],
)
def test_invalid_envelopes_say_why(envelope, reason):
    with pytest.raises(EnvelopeError, match=reason):
        decode_envelope(envelope)


def test_idempotency_keys_are_deterministic_per_consumer_event_and_step():
    event = uuid.uuid4()
    assert idempotency_key("billing", event) == idempotency_key("billing", event)
    keys = {
        idempotency_key("billing", event),
        idempotency_key("shipping", event),
        idempotency_key("billing", uuid.uuid4()),
        idempotency_key("billing", event, "charge"),
        idempotency_key("billing", event, "refund"),
    }
    assert len(keys) == 5
    assert uuid.UUID(idempotency_key("b", uuid.UUID(int=1))).version == 5


def test_upcasters_chain_to_the_newest_version():
    registry = Upcasters()
    registry.register("order.placed", 1)(lambda p: {**p, "currency": "EUR"})
    registry.register("order.placed", 2)(
        lambda p: {"currency": p["currency"], "total_cents": p["total"] * 100}
    )
    assert registry.upcast("order.placed", 1, {"total": 3}) == (
        3,
        {"currency": "EUR", "total_cents": 300},
    )
    assert registry.upcast("order.placed", 3, {"x": 1}) == (3, {"x": 1})
    assert registry.upcast("other", 1, {"x": 1}) == (1, {"x": 1})
    with pytest.raises(ConfigurationError, match="two upcasters"):
        registry.register("order.placed", 1)(lambda p: p)
