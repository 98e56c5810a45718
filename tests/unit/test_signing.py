"""Message signatures: what they cover, rotation, and the settings that choose the keys."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime

import pytest

from pipeline.config import load_settings
from pipeline.envelope import OutboxEvent, encode_envelope
from pipeline.errors import ConfigurationError
from pipeline.signing import MISMATCH, UNSIGNED, EnvelopeSigner, MessageKeys

pytestmark = pytest.mark.unit

KEY, OLD = "n" * 40, "o" * 40
SOURCE = "/pipeline/pipeline"


def event(payload: str = '{"b": [1, 2.50, "\\u00e9"], "a": {"z": null, "y": 1e3}}') -> OutboxEvent:
    return OutboxEvent(
        uuid.uuid4(), 7, "order", "o-1", "o-1", "order.placed", 2, payload, "{}", 0,
        datetime.now(UTC),
    )  # fmt: skip


def signer(current: str | None = KEY, previous: str | None = None, **kw: object) -> EnvelopeSigner:
    keys = MessageKeys(
        current=current.encode() if current else None,
        previous=previous.encode() if previous else None,
        accept_unsigned=bool(kw.get("accept_unsigned", current is None)),
    )
    return EnvelopeSigner(keys, str(kw.get("deployment", SOURCE)))


def envelope_for(outbox: OutboxEvent, consumer: str, by: EnvelopeSigner) -> dict:
    [text] = by.sign_texts([outbox], consumer, {outbox.id: encode_envelope(outbox, SOURCE)}, {})
    return json.loads(text)


def test_a_signed_envelope_verifies_and_survives_re_encoding():
    outbox = event()
    envelope = envelope_for(outbox, "billing", signer())
    assert signer().verify(envelope, "billing") is None
    # A retried message is re-encoded by Dramatiq from the parsed envelope.
    assert signer().verify(json.loads(json.dumps(envelope)), "billing") is None


@pytest.mark.parametrize(
    "change",
    [
        lambda e: e["data"].update(b=[1]),
        lambda e: e.update(id=str(uuid.uuid4())),
        lambda e: e.update(type="order.cancelled"),
        lambda e: e.update(pipelineeventversion=3),
        lambda e: e.update(subject="o-2"),
        lambda e: e.update(pipelineaggregatetype="invoice"),
        lambda e: e.update(pipelineorderingkey="o-2"),
        lambda e: e.update(pipelinesignature=e["pipelinesignature"][::-1]),
        lambda e: e.update(pipelinesignature=["not", "a", "string"]),
    ],
    ids=["payload", "id", "type", "version", "aggregate", "agg-type", "key", "sig", "sig-type"],
)
def test_any_covered_change_is_a_mismatch(change):
    envelope = envelope_for(event(), "billing", signer())
    change(envelope)
    assert signer().verify(envelope, "billing") == MISMATCH


def test_another_consumer_deployment_or_key_is_a_mismatch():
    envelope = envelope_for(event(), "billing", signer())
    assert signer().verify(envelope, "shipping") == MISMATCH
    assert signer(deployment="/pipeline/other").verify(envelope, "billing") == MISMATCH
    assert signer(current="x" * 40).verify(envelope, "billing") == MISMATCH


def test_unsigned_is_refused_with_a_key_unless_the_previous_key_is_insecure():
    envelope = json.loads(encode_envelope(event(), SOURCE))
    assert signer().verify(envelope, "billing") == UNSIGNED
    assert signer(accept_unsigned=True).verify(envelope, "billing") is None
    assert signer(current=None).verify(envelope, "billing") is None  # no key: no checks


def test_rotation_accepts_the_previous_key_and_signs_with_the_current():
    old = envelope_for(event(), "billing", signer(current=OLD))
    rotated = signer(current=KEY, previous=OLD)
    assert rotated.verify(old, "billing") is None
    new = envelope_for(event(), "billing", rotated)
    assert signer(current=KEY).verify(new, "billing") is None
    assert signer(current=OLD).verify(new, "billing") == MISMATCH


def test_settings_choose_the_keys_and_keep_them_secret():
    keys = MessageKeys.from_settings(load_settings(message_key=KEY, message_key_previous=OLD))
    assert (keys.current, keys.previous) == (KEY.encode(), OLD.encode())
    assert not keys.accept_unsigned
    assert keys.warning() is None
    transition = MessageKeys.from_settings(
        load_settings(message_key=KEY, message_key_previous="insecure")
    )
    assert transition.accept_unsigned and transition.previous is None
    off = MessageKeys.from_settings(load_settings(message_key="INSECURE"))
    assert not off.signing and off.accept_unsigned and off.warning() is None
    unset = MessageKeys.from_settings(load_settings())
    assert not unset.signing and "PIPELINE_MESSAGE_KEY is not set" in (unset.warning() or "")
    with pytest.raises(ConfigurationError, match=r"PIPELINE_MESSAGE_KEY: .*at least 32") as short:
        load_settings(message_key="secret-but-short")
    assert "secret-but-short" not in str(short.value)
    with pytest.raises(ConfigurationError, match="PREVIOUS is set without"):
        load_settings(message_key_previous=OLD)
    assert KEY not in repr(load_settings(message_key=KEY))
