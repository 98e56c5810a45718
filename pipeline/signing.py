"""Message authentication: the relay signs each envelope for the consumer it is sent to,
workers handle only envelopes whose signature they can verify.

The signature is an HMAC-SHA256, keyed with ``PIPELINE_MESSAGE_KEY`` (a secret shared by
relays and workers, never by the broker), over the envelope's canonical bytes: the
deployment (the CloudEvents ``source``, which names the pipeline's schema), the consumer
it is addressed to, and the event's id, type, version, aggregate, ordering key and the
SHA-256 of its payload. Someone who can write to the broker but does not hold the key
can neither make up an event, nor alter one, nor move one to another consumer or
replay it into another deployment: the worker dead-letters it as unauthentic.

It sits at the envelope level, independent of the transport: a publisher adds the
signature attribute (``pipelinesignature``) to each envelope's JSON text, and the inbox
verifies the decoded envelope. The payload digest is taken over a canonical JSON form of
the *parsed* payload (sorted keys, no spaces, ASCII), so it survives the re-encoding of a
retried message; trace context and other headers are not covered.

Keys rotate in two steps: ``PIPELINE_MESSAGE_KEY_PREVIOUS`` is accepted beside the
current key (which alone signs). ``PIPELINE_MESSAGE_KEY=insecure`` turns signing and
verification off; ``PIPELINE_MESSAGE_KEY_PREVIOUS=insecure`` accepts unsigned messages
beside signed ones, while a key is introduced into a running deployment.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _quote_ascii  # C-accelerated
from typing import Any

from pipeline.config import MESSAGE_KEY_OFF, Settings
from pipeline.envelope import OutboxEvent

log = logging.getLogger("pipeline.signing")
SIGNATURE_ATTRIBUTE = "pipelinesignature"
UNSIGNED = "unsigned"  # reasons an envelope is refused (the metric's ``reason`` label)
MISMATCH = "mismatch"
REASONS = {
    UNSIGNED: "unauthentic: the message carries no signature",
    MISMATCH: (
        "unauthentic: the signature does not match (forged, altered, addressed to another "
        "consumer, or signed by another deployment or key)"
    ),
}


@dataclass(frozen=True)
class MessageKeys:
    """The keys a process signs with (``current``) and accepts (``current``, ``previous``)."""

    current: bytes | None = None
    previous: bytes | None = None
    accept_unsigned: bool = True  # no key configured, or the previous one is "insecure"
    explicit: bool = False  # configured (a key, or "insecure"): no warning at start

    @classmethod
    def from_settings(cls, settings: Settings) -> MessageKeys:
        current = _key(settings.message_key)
        previous = _key(settings.message_key_previous)
        previous_off = _off(settings.message_key_previous)
        return cls(
            current=current,
            previous=previous,
            accept_unsigned=current is None or previous_off,
            explicit=settings.message_key is not None,
        )

    @property
    def signing(self) -> bool:
        return self.current is not None

    def warning(self) -> str | None:
        """One line for the log when messages go unauthenticated without being told to."""
        if self.explicit:
            return None
        return (
            "PIPELINE_MESSAGE_KEY is not set: messages are not authenticated, so anyone who "
            "can write to the broker can make handlers run; set the same key on relays and "
            "workers (or PIPELINE_MESSAGE_KEY=insecure to silence this), see docs/security.md"
        )


def warn_if_unauthenticated(settings: Settings) -> None:
    """Log one warning line when no message key is configured (relay and worker start)."""
    warning = MessageKeys.from_settings(settings).warning()
    if warning is not None:
        log.warning(warning)


def _key(value: Any) -> bytes | None:
    if value is None or _off(value):
        return None
    key: str = value.get_secret_value()
    return key.encode()


def _off(value: Any) -> bool:
    return value is not None and value.get_secret_value() in MESSAGE_KEY_OFF


def event_source(settings: Settings) -> str:
    """The CloudEvents ``source`` of this pipeline's events: the deployment signatures name."""
    return f"/pipeline/{settings.schema_name}"


# Built once: json.dumps with any option builds a new encoder on every call.
_canonical = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True
).encode
_fields = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True, default=str).encode


def canonical_json(data: Any) -> bytes:
    """The payload's canonical bytes: sorted keys, no spaces, ASCII (for its digest)."""
    return _canonical(data).encode()


def payload_digest(data: Any) -> str:
    return hashlib.sha256(canonical_json(data)).hexdigest()


def _signed_bytes(
    deployment: str,
    consumer: str,
    event_id: Any,
    event_type: Any,
    version: Any,
    aggregate_type: Any,
    aggregate_id: Any,
    ordering_key: Any,
    digest: str,
) -> bytes:
    fields = (
        "pipeline-message-v1",
        deployment,
        consumer,
        event_id,
        event_type,
        version,
        aggregate_type,
        aggregate_id,
        ordering_key,
        digest,
    )
    return ("[" + ",".join(map(_field, fields)) + "]").encode()


def _field(value: Any) -> str:
    """A field as its JSON text (strings, ints and null, the genuine values, the fast way)."""
    kind = type(value)
    if kind is str:
        text: str = _quote_ascii(value)
        return text
    if kind is int:
        return str(value)
    if value is None:
        return "null"
    return _fields(value)


class EnvelopeSigner:
    """Signs envelopes for a consumer and verifies received ones, for one deployment."""

    def __init__(self, keys: MessageKeys, deployment: str) -> None:
        self.keys = keys
        self.deployment = deployment

    @classmethod
    def from_settings(cls, settings: Settings, deployment: str) -> EnvelopeSigner:
        return cls(MessageKeys.from_settings(settings), deployment)

    @property
    def signing(self) -> bool:
        return self.keys.signing

    # -- the relay's side ---------------------------------------------------------------
    def event_digest(self, event: OutboxEvent) -> str:
        """The payload digest of an outbox event (parses its JSON text once)."""
        return payload_digest(json.loads(event.payload_json))

    def signature(self, event: OutboxEvent, consumer: str, digest: str) -> str:
        assert self.keys.current is not None, "signature() without a key"
        message = _signed_bytes(
            self.deployment,
            consumer,
            str(event.id),
            event.event_type,
            event.event_version,
            event.aggregate_type,
            event.aggregate_id,
            event.ordering_key,
            digest,
        )
        return hmac.digest(self.keys.current, message, "sha256").hex()

    def signed_text(self, envelope_text: str, signature: str) -> str:
        """The envelope's JSON text (an object) with the signature attribute added."""
        return f'{envelope_text[:-1]},"{SIGNATURE_ATTRIBUTE}":"{signature}"}}'

    def sign_texts(
        self,
        events: Any,
        consumer: str,
        texts: Mapping[Any, str],
        digests: dict[Any, str],
    ) -> list[str]:
        """Each event's envelope text (``texts`` by event id), signed for ``consumer``.

        ``digests`` caches payload digests across the deliveries of a batch (an event fanned
        out to several consumers is parsed once). Unsigned texts when no key is set.
        """
        if not self.signing:
            return [texts[event.id] for event in events]
        signed = []
        for event in events:
            digest = digests.get(event.id)
            if digest is None:
                digest = digests[event.id] = self.event_digest(event)
            signature = self.signature(event, consumer, digest)
            signed.append(self.signed_text(texts[event.id], signature))
        return signed

    # -- the worker's side --------------------------------------------------------------
    def verify(self, envelope: Any, consumer: str) -> str | None:
        """None if ``envelope`` is authentic for ``consumer``; else the refusal's reason
        (:data:`UNSIGNED` or :data:`MISMATCH`). Everything passes when no key is set."""
        if self.keys.current is None and self.keys.previous is None:
            return None
        if not isinstance(envelope, Mapping):
            return MISMATCH
        signature = envelope.get(SIGNATURE_ATTRIBUTE)
        if signature is None:
            return None if self.keys.accept_unsigned else UNSIGNED
        if not isinstance(signature, str):
            return MISMATCH
        try:
            digest = payload_digest(envelope.get("data"))
        except (TypeError, ValueError, RecursionError):
            return MISMATCH
        message = _signed_bytes(
            self.deployment,
            consumer,
            envelope.get("id"),
            envelope.get("type"),
            envelope.get("pipelineeventversion", 1),
            envelope.get("pipelineaggregatetype"),
            envelope.get("subject"),
            envelope.get("pipelineorderingkey"),
            digest,
        )
        for key in (self.keys.current, self.keys.previous):
            if key is not None:
                expected = hmac.digest(key, message, "sha256").hex()
                if hmac.compare_digest(expected, signature.encode("ascii", "replace").decode()):
                    return None
        return MISMATCH
